"""`serve --local` in a subprocess, driven with the openai SDK; /metrics parsed; the log canary.

The server runs the shared runtime (the agent's model manager, prompt counter and prefix cache), so
its refusals are the manager's: a model that can never fit is refused at admission, before any load.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import httpx
import mlx_lm
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_reference import reference_greedy
from local_server import CANARY, MODEL, Server, running_server, start_server
from openai_shape import assert_openai_stream
from vision_images import data_uri, png_bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("local"), tiny_model_path) as srv:
        yield srv


def test_non_streaming_chat_with_the_openai_sdk(server):
    reply = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0)
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 1 <= reply.usage.completion_tokens <= 8 and reply.usage.prompt_tokens > 0


def test_streaming_chat_with_the_openai_sdk(server, tiny_model_path):
    stream = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    *body, finish, usage = chunks  # as OpenAI ends it: the usage in a last chunk of its own, with no choices
    assert finish.choices[0].finish_reason in ("stop", "length") and finish.usage is None
    assert usage.choices == [] and 1 <= usage.usage.completion_tokens <= 8
    assert all(c.usage is None and c.choices[0].finish_reason is None for c in body)
    same = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0)
    # The repeat reuses the cached prompt, its prefill split another way: the same tokens only where
    # no greedy choice is a near-tie, which reference_greedy checks for this prompt.
    reference_greedy(mlx_lm.load(str(tiny_model_path)), "hello", 8)
    assert same.choices[0].message.content == text  # greedy: stream and non-stream agree


def test_a_streaming_client_receives_openais_stream_byte_for_byte(server):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=request, timeout=60) as response:
        raw = response.read()
    assert_openai_stream(raw)


def test_models_health_and_status(server):
    assert [m.id for m in server.client().models.list()] == [MODEL]
    assert httpx.get(server.base_url + "/healthz").json() == {"status": "ok"}
    assert httpx.head(server.base_url + "/healthz").status_code == 200  # what uptime checks send
    status = httpx.get(server.base_url + "/status").json()
    assert status["mode"] == "local" and status["in_flight"] == 0
    assert [(m["id"], m["state"]) for m in status["models"]] in ([(MODEL, "loaded")], [(MODEL, "not_loaded")])
    assert set(status["ledger"]["bytes_by_kind"]) == {"request_kv", "media", "pending_load", "prefix_cache", "prompt",
                                                       "grammar", "prefix_index"}
    assert status["pressure"]["level"] in ("green", "yellow", "red", "fatal")
    assert status["cap"]["effective_cap_bytes"] > 0
    assert set(status["prefix_cache"]) >= {"hits", "partial_hits", "misses", "ram_bytes", "disk_bytes"}


def test_a_repeated_prompt_hits_the_prefix_cache(server):
    before = httpx.get(server.base_url + "/status").json()["prefix_cache"]
    for _ in range(2):
        server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "the same words twice over"}], max_tokens=2,
            temperature=0)
    status = httpx.get(server.base_url + "/status").json()
    after = status["prefix_cache"]
    lookups = ("hits", "partial_hits", "misses")
    assert sum(after[k] for k in lookups) == sum(before[k] for k in lookups) + 2  # one lookup each
    assert after["hits"] == before["hits"] + 1  # the repeat found its whole prompt but the last token
    assert after["ram_bytes"] > 0 and after["ram_bytes"] == status["ledger"]["bytes_by_kind"]["prefix_cache"]
    assert after["disk_bytes"] == 0  # a few tokens reused is no reason to copy a sequence off the device
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text)}
    hits = next(s.value for s in families["darkbloom_prefix_cache_lookups"].samples
                if s.name == "darkbloom_prefix_cache_lookups_total" and s.labels == {"result": "hit"})
    assert hits == after["hits"]


def test_unknown_model_is_404_without_retry_after(server):
    with pytest.raises(openai.NotFoundError) as err:
        server.client().chat.completions.create(model="no/such-model", messages=[{"role": "user", "content": "x"}])
    assert "retry-after" not in err.value.response.headers
    assert err.value.response.json()["error"]["code"] == "model_unavailable"


def test_an_image_for_a_text_model_is_415_unsupported_media(server):
    with pytest.raises(openai.APIStatusError) as err:
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": data_uri(png_bytes(8, 8))}}]}], max_tokens=2)
    assert err.value.status_code == 415
    error = err.value.response.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_media", "image_url")
    assert f"Model '{MODEL}' reads text only" in error["message"]  # the reason, in words
    assert "retry-after" not in err.value.response.headers


@pytest.mark.parametrize(("url", "status", "param", "words"), [
    ("https://example.com/cat.png", 415, "image_url", "never fetches"),
    ("data:text/plain;base64,aGk=", 415, "image_url", "image/* media type"),
    ("data:image/png;base64,%%%", 400, "image_url", "base64"),
])
def test_an_image_refusal_names_its_reason_and_param(server, url, status, param, words):
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]}]})
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (status, param) and words in error["message"], error
    assert url not in response.text


def test_unknown_routes_and_methods_are_in_the_request_log(server):
    assert httpx.get(server.base_url + "/v1/nope-route-qzxw", timeout=10).status_code == 404
    assert httpx.delete(server.base_url + "/v1/models", timeout=10).status_code == 405
    assert httpx.get(server.base_url + "/v1/models/no/such-model-qzxw", timeout=10).status_code == 404
    events = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
    routed = [(e["status_code"], e["code"]) for e in events if e["event"] == "request_not_routed"]
    assert (404, "unknown_route") in routed and (405, "method_not_allowed") in routed
    assert any(e["event"] == "request_refused" and e.get("status_code") == 404 for e in events)
    assert "qzxw" not in server.log_path.read_text()  # the path and the id asked for are not logged


def test_a_model_name_the_client_chose_never_reaches_the_log(server):
    """As in coordinator mode, a requested model is logged only when it is one of ours."""
    canary_model = f"no/such-model-{CANARY}"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model=canary_model, messages=[{"role": "user", "content": "x"}])
    server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    log = server.log_path.read_text()
    refused = [json.loads(line) for line in log.splitlines() if '"request_refused"' in line]
    assert any(e["code"] == "model_unavailable" for e in refused)  # the refusal is logged, without the name
    assert CANARY not in log


def test_metrics_parse_with_prometheus_client(server):
    server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    resp = httpx.get(server.base_url + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name in ("darkbloom_requests", "darkbloom_tokens", "darkbloom_rejects", "darkbloom_model_loads",
                 "darkbloom_model_evictions", "darkbloom_settle_seconds", "darkbloom_ledger_bytes",
                 "darkbloom_cap_bytes", "darkbloom_loaded_models", "darkbloom_in_flight_requests",
                 "darkbloom_prefix_cache_lookups", "darkbloom_prefix_cache_bytes"):
        assert name in families, name

    def value(family: str, sample: str, **labels: str) -> float:
        return next(s.value for s in families[family].samples if s.name == sample and s.labels == labels)

    assert value("darkbloom_requests", "darkbloom_requests_total", outcome="completed") >= 1
    assert value("darkbloom_model_loads", "darkbloom_model_loads_total", result="loaded") == 1
    assert value("darkbloom_loaded_models", "darkbloom_loaded_models") == 1
    status = httpx.get(server.base_url + "/status").json()
    assert value("darkbloom_cap_bytes", "darkbloom_cap_bytes", figure="effective_cap") == \
        status["cap"]["effective_cap_bytes"]


def test_a_model_too_large_for_this_machine_is_a_400_naming_it_its_need_and_the_cap(tmp_path, tiny_model_path):
    """A 6 GiB machine: effective cap 2 GiB, but a load needs weights + the operator's fixed 3 GiB
    activation reserve + 1 GiB KV. On the owner's own server there is no other node to reroute to, so this
    is permanent: a 400 (no Retry-After, which an SDK would take as "try again") whose message names the
    model, what it needs and the cap, and nothing loads. The coordinator's front keeps its rerouted 503."""
    small = start_server(tmp_path, tiny_model_path, "--memory-limit-gb", "6",
                         env_extra={"DARKBLOOM_ACTIVATION_RESERVE_GB": "3"})
    try:
        with pytest.raises(openai.BadRequestError) as err:
            small.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"tell me about {CANARY}"}], max_tokens=4)
        assert "retry-after" not in err.value.response.headers
        body = err.value.response.json()["error"]
        assert (body["code"], body["reason"], body["param"]) == ("model_too_large", "request_exceeds_node", "model")
        status = httpx.get(small.base_url + "/status").json()
        cap_gib = status["cap"]["effective_cap_bytes"] / 2**30
        assert MODEL in body["message"] and f"{cap_gib:.2f} GiB" in body["message"]
        assert "doctor" in body["message"] and CANARY not in err.value.response.text
        metrics = httpx.get(small.base_url + "/metrics").text
        assert 'darkbloom_rejects_total{reason="memory_cap"} 1.0' in metrics
        assert 'darkbloom_model_loads_total{result="loaded"} 0.0' in metrics
        assert 'darkbloom_loaded_models 0.0' in metrics
        assert small.client().models.list().data == []  # it can never load here: not offered
    finally:
        code, log = small.stop()
    assert code == 0
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any(e["event"] == "request_refused" and e["rejection_reason"] == "memory_cap" for e in events)
    assert CANARY not in log


def test_failing_requests_never_log_the_prompt(tmp_path, tiny_model_path):
    srv = start_server(tmp_path, tiny_model_path, "--log-level", "debug")
    try:
        client = srv.client()
        too_long = f"{CANARY} " * 1500  # longer than the model's 2048-token context
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": too_long}])
        assert err.value.response.json()["error"]["reason"] == "request_exceeds_context"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CANARY}],
                                           temperature=7)
        raw = urllib.request.Request(srv.base_url + "/v1/chat/completions", data=CANARY.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(raw, timeout=10)
        assert bad.value.code == 400 and CANARY not in bad.value.read().decode()
    finally:
        code, log = srv.stop()
    assert code == 0
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert {"request_refused", "request_invalid"} <= {e["event"] for e in events}
    assert CANARY not in log
