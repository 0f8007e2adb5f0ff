"""The local server's error answers are JSON, always: a model folder that cannot serve is
never advertised, and a template that raises is a JSON 422 `template_render`, not a plain-text 500.
Driven with the openai SDK against `serve --local` in a subprocess."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from local_server import CANARY, Server, start_server
from provider.models import SkipReason, discover

GOOD, BROKEN_TEMPLATE = "demo/tiny", "demo/bad-template"


def variant(base: Path, dest: Path, *, drop: tuple[str, ...] = (), write: dict[str, str] | None = None) -> Path:
    shutil.copytree(base, dest)
    for name in drop:
        (dest / name).unlink()
    for name, text in (write or {}).items():
        (dest / name).write_text(text)
    return dest


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    return {
        "no-tokenizer": variant(tiny_model_path, root / "no-tokenizer", drop=("tokenizer.json", "tokenizer_config.json")),
        "no-template": variant(tiny_model_path, root / "no-template", drop=("chat_template.jinja",)),
        "template-in-config": variant(tiny_model_path, root / "template-in-config", drop=("chat_template.jinja",),
                                      write={"tokenizer_config.json": json.dumps({
                                          "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                                          "chat_template": (tiny_model_path / "chat_template.jinja").read_text()})}),
        # Renders nothing but raises an error nobody expects (not a template error): the request path's edge.
        "bad-template": variant(tiny_model_path, root / "bad-template", write={"chat_template.jinja": "{{ 1 // 0 }}"}),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path, folders) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("errors"), tiny_model_path,
                       "--model-aliases", f"demo/no-tokenizer={folders['no-tokenizer']}",
                       "--model-aliases", f"demo/no-template={folders['no-template']}",
                       "--model-aliases", f"{BROKEN_TEMPLATE}={folders['bad-template']}")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_discovery_skips_a_folder_without_tokenizer_or_chat_template(folders):
    inventory = discover(hf_cache=None, aliases={k: v for k, v in folders.items()})
    assert {s.id: s.reason for s in inventory.skipped} == {
        "no-tokenizer": SkipReason.NO_TOKENIZER, "no-template": SkipReason.NO_CHAT_TEMPLATE}
    assert {m.id for m in inventory.models} == {"template-in-config", "bad-template"}


def test_a_folder_that_cannot_serve_is_not_advertised_and_a_request_to_it_is_a_json_404(server):
    client = server.client()
    assert {m.id for m in client.models.list()} == {GOOD, BROKEN_TEMPLATE}
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="demo/no-tokenizer", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2)
    assert caught.value.body["code"] == "model_unavailable"


@pytest.mark.parametrize("stream", [False, True])
def test_a_template_that_raises_is_a_json_422_never_plain_text(server, stream):
    """A template's own error, whatever it raises (here a division by zero), is the template's failure:
    it renders in the bounded template process (provider/models/template.py), so it no longer
    reaches the request's edge as an unexpected error (that edge's JSON 500 is test_jobs')."""
    body = {"model": BROKEN_TEMPLATE, "messages": [{"role": "user", "content": CANARY}], "max_tokens": 2,
            "stream": stream}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 422
    assert resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["code"] == "template_render"
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        server.client().chat.completions.create(model=BROKEN_TEMPLATE, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=2, stream=stream)
    assert caught.value.body["code"] == "template_render"
    # The good model still serves afterwards, and the log carries no prompt.
    assert server.client().chat.completions.create(model=GOOD, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2).choices
    log = server.log_path.read_text()
    assert CANARY not in log
    assert "request_unexpected_error" not in log and "Exception in ASGI application" not in log


# --- 400s name the parameter and the rule, in OpenAI's shape

BAD_BODIES = [  # (what the client sends on top of a valid body, param, words of the rule)
    ({"max_tokens": 0}, "max_tokens", "must be an integer >= 1"),
    ({"max_tokens": -1}, "max_tokens", "must be an integer >= 1"),
    ({"max_tokens": 1e30}, "max_tokens", "must be an integer >= 1"),
    ({"temperature": 5}, "temperature", "must be a number between 0 and 2"),
    ({"top_p": 2}, "top_p", "greater than 0 and at most 1"),
    ({"n": 2}, "n", "must be 1"),
    ({"messages": []}, "messages", "non-empty array of messages"),
    ({"messages": [{"content": CANARY}]}, "messages.0.role", "is required"),
    ({"messages": [{"role": "wizard", "content": CANARY}]}, "messages.0.role", "must be one of"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "is required"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": CANARY}]}]}, "messages.0.content",
     "text and image_url parts"),
    ({"stop": [""]}, "stop", "non-empty"),
    # JSON types as OpenAI checks them, and what this provider cannot honour
    ({"temperature": "0.5"}, "temperature", "must be a number between 0 and 2"),
    ({"max_tokens": "5"}, "max_tokens", "must be an integer >= 1"),
    ({"max_tokens": True}, "max_tokens", "must be an integer >= 1"),
    ({"stream": "yes"}, "stream", "must be a boolean"),
    ({"presence_penalty": 0.5}, "presence_penalty", "only 0"),
    ({"frequency_penalty": -1}, "frequency_penalty", "only 0"),
    ({"logit_bias": {"5": 10}}, "logit_bias", "only an empty object"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of text, json_object, json_schema"),
    ({"extra_body": {"top_k": 5}}, "top_k", "not supported"),
    ({"extra_body": {"reasoning_effort": "high"}}, "reasoning_effort", "not supported"),
    # a misspelt parameter is named with the one meant, as OpenAI names an unrecognized argument
    ({"extra_body": {"max_token": 3}}, "max_token", "did you mean 'max_tokens'?"),
    ({"extra_body": {"response_fromat": {"type": "json_object", "x": CANARY}}}, "response_fromat",
     "did you mean 'response_format'?"),
]


@pytest.mark.parametrize("extra, param, rule", BAD_BODIES, ids=[p for _, p, _ in BAD_BODIES])
def test_a_bad_parameter_is_a_400_naming_it_and_its_rule_through_the_openai_sdk(server, extra, param, rule):
    kwargs = {"model": GOOD, "messages": [{"role": "user", "content": CANARY}], **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(**kwargs)
    err = caught.value
    assert err.status_code == 400 and err.param == param
    assert err.body["type"] == "invalid_request_error" and err.body["code"] == "invalid_request"
    assert f"'{param}'" in err.body["message"] and rule in err.body["message"]
    assert CANARY not in err.body["message"] and "1e+30" not in err.body["message"]  # never the value


def test_what_is_ignored_is_what_does_not_change_the_answer(server):
    """`user`, `metadata`... (provider/request/params.py IGNORED): accepted, and the greedy answer is
    the same with them as without."""
    client = server.client()
    # "hello": no near-tie in its first 8 greedy tokens (test_local_server checks), so a prefix-cache hit
    # on the repeat cannot change them.
    kwargs = {"model": GOOD, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
    plain = client.chat.completions.create(**kwargs)
    tagged = client.chat.completions.create(**kwargs, user="u-1", metadata={"k": "v"}, service_tier="auto",
                                            presence_penalty=0, n=1, logit_bias={}, store=False)
    assert tagged.choices[0].message.content == plain.choices[0].message.content


def test_another_vendors_field_is_accepted_and_named_in_the_request_log(server):
    reply = server.client().chat.completions.create(
        model=GOOD, messages=[{"role": "user", "content": "hello"}], max_tokens=2,
        extra_body={"cache_prompt": CANARY, "max_new_tokens": 7})
    assert reply.choices[0].finish_reason in ("stop", "length")
    warnings = [json.loads(line) for line in server.log_path.read_text().splitlines()
                if '"request_unknown_fields"' in line]
    assert warnings and warnings[-1]["kind"] == ["cache_prompt", "max_new_tokens"]
    assert warnings[-1]["level"] == "warning" and warnings[-1]["request_id"] == reply.id
    assert CANARY not in server.log_path.read_text()


def test_by_default_the_pages_of_this_machine_may_call_it_and_no_others(server):
    """local_allowed_origins defaults to http://localhost:* and http://127.0.0.1:* (as Ollama allows): a
    local dev server's page gets CORS headers on any port; any other origin's preflight is an OpenAI
    400 naming the setting (it was a 405 "use POST", which sent a browser developer nowhere), and
    its requests a 403."""
    for origin in ("http://localhost:3000", "http://127.0.0.1:5173", "http://localhost"):
        preflight = httpx.options(server.base_url + "/v1/chat/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == origin
        models = httpx.get(server.base_url + "/v1/models", headers={"Origin": origin}, timeout=10)
        assert models.status_code == 200 and models.headers["access-control-allow-origin"] == origin
    for other in ("http://evil.example", "https://localhost:3000", "http://localhost.evil.example",
                  "http://127.0.0.1.nip.io:8080"):
        models = httpx.get(server.base_url + "/v1/models", headers={"Origin": other}, timeout=10)
        assert models.status_code == 403 and "access-control-allow-origin" not in models.headers
        preflight = httpx.options(server.base_url + "/v1/chat/completions", timeout=10,
                                  headers={"Origin": other, "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers, other
        error = preflight.json()["error"]
        assert error["code"] == "cors_origin_not_allowed" and "local_allowed_origins" in error["message"]


def test_nan_temperature_and_malformed_json_are_named_too(server):
    raw = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}' % GOOD
    resp = httpx.post(server.base_url + "/v1/chat/completions", content=raw,
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"
    resp = httpx.post(server.base_url + "/v1/chat/completions", content=b'{"model": "x", "messa',
                      headers={"content-type": "application/json"}, timeout=30)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] is None and error["type"] == "invalid_request_error"
    assert error["message"] == "The request body is not valid JSON."
    assert resp.headers["content-type"] == "application/json"


def test_what_this_machine_can_never_serve_is_explained_in_numbers():
    """The three kinds of "never here" the local server answers with a 400 (the first is
    also driven end to end in test_local_server): the model alone, one request's KV over what a request
    may take, and the model with this request's KV over the cap."""
    from memory import compute_figures
    from memory.fit import FitResult, FitVerdict
    from protocol.errors import Failure, RejectionReason
    from provider.local.backend import too_large

    gib = 2**30
    figures = compute_figures(16 * gib)
    cap = figures.effective_cap_bytes

    def fit(required: int) -> FitResult:
        return FitResult(FitVerdict.TOO_LARGE if required > cap else FitVerdict.FITS_NOW, required, required, cap,
                         cap, cap, required <= cap)

    model = too_large(Failure.exceeds_node(RejectionReason.MEMORY_CAP), "org/big", fit(cap + gib), 0, figures)
    assert (model.code, model.param) == ("model_too_large", "model")
    assert "'org/big'" in model.message and f"{(cap + gib) / gib:.2f} GiB" in model.message
    assert f"{cap / gib:.2f} GiB" in model.message

    kv = figures.single_request_limit_bytes + gib
    request = too_large(Failure.exceeds_node(RejectionReason.TOKEN_BUDGET), "org/m", fit(gib), kv, figures)
    assert (request.code, request.param) == ("request_too_large", "max_tokens")
    assert f"{kv / gib:.2f} GiB" in request.message
    assert f"{figures.single_request_limit_bytes / gib:.2f} GiB" in request.message

    both = too_large(Failure.exceeds_node(RejectionReason.MEMORY_CAP), "org/m", fit(cap - gib), 2 * gib, figures)
    assert (both.code, both.param) == ("request_too_large", "max_tokens")
    assert f"{(cap + gib) / gib:.2f} GiB" in both.message and f"{cap / gib:.2f} GiB" in both.message
