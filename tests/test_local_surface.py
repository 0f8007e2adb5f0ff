"""The rest of the OpenAI surface a client meets on `serve --local`: the legacy
`/v1/completions`, `GET /v1/models/{id}`, OpenAI-shaped errors for unknown routes and methods, the
CORS setting, the unknown-model and context errors with their ids and numbers. Driven with the openai
SDK (and httpx where the bytes matter) against a real server in a subprocess."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from local_server import CANARY, MODEL, Server, running_server, start_server
from provider.local.errors import Cors

ORIGIN = "https://chat.example:8443"  # the owner's list replaces the default (the pages of this machine)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("surface"), tiny_model_path, "--local-allowed-origins", ORIGIN) as srv:
        yield srv


def openai_error(response: httpx.Response) -> dict:
    """The response's error object, after checking it has OpenAI's shape and nothing of FastAPI's."""
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    assert isinstance(error["message"], str) and error["message"]
    return error


# --- routes and methods

@pytest.mark.parametrize("method, path", [("GET", "/v1/nope"), ("POST", "/v1/engines/x/completions"),
                                          ("GET", "/"), ("POST", "/v1/chat/completion")])
def test_an_unknown_route_is_an_openai_404_naming_the_routes_served(server, method, path):
    response = httpx.request(method, server.base_url + path, timeout=10)
    assert response.status_code == 404
    error = openai_error(response)
    assert error["type"] == "invalid_request_error" and error["code"] == "unknown_route"
    assert "POST /v1/chat/completions" in error["message"] and "GET /v1/models" in error["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().get("/nope", cast_to=object)
    assert caught.value.body["code"] == "unknown_route"


@pytest.mark.parametrize("method, path, allowed", [("GET", "/v1/chat/completions", "POST"),
                                                   ("GET", "/v1/completions", "POST"),
                                                   ("DELETE", "/v1/models", "GET"), ("POST", "/healthz", "GET, HEAD")])
def test_a_wrong_method_is_an_openai_405_with_allow(server, method, path, allowed):
    response = httpx.request(method, server.base_url + path, timeout=10)
    assert response.status_code == 405 and response.headers["allow"] == allowed
    error = openai_error(response)
    assert error["code"] == "method_not_allowed" and f"use {allowed}" in error["message"]


def test_a_model_is_retrieved_by_its_id(server):
    model = server.client().models.retrieve(MODEL)  # the SDK sends demo%2Ftiny
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "darkbloom-provider")
    listed = server.client().models.list().data
    assert [m.model_dump() for m in listed] == [model.model_dump()]


def test_an_unknown_model_id_is_a_404_naming_it_and_what_is_served(server):
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().models.retrieve("no/such-model")
    error = caught.value.body
    assert (error["code"], error["param"], error["type"]) == ("model_unavailable", "model", "invalid_request_error")
    assert "'no/such-model'" in error["message"] and MODEL in error["message"]


# --- CORS (local_allowed_origins)

def test_an_allowed_origin_gets_cors_headers_and_its_preflight_passes(server):
    preflight = httpx.options(server.base_url + "/v1/chat/completions", timeout=10, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    models = httpx.get(server.base_url + "/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert models.headers["access-control-allow-origin"] == ORIGIN
    error = httpx.get(server.base_url + "/v1/nope", headers={"Origin": ORIGIN}, timeout=10)
    assert error.status_code == 404 and error.headers["access-control-allow-origin"] == ORIGIN  # errors readable too


@pytest.mark.parametrize("other", ["http://evil.example", "http://localhost:3000"])
def test_another_origin_gets_no_cors_headers_and_its_preflight_an_openai_400(server, other):
    models = httpx.get(server.base_url + "/v1/models", headers={"Origin": other}, timeout=10)
    assert models.status_code == 403 and "access-control-allow-origin" not in models.headers
    preflight = httpx.options(server.base_url + "/v1/chat/completions", timeout=10, headers={
        "Origin": other, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers
    error = openai_error(preflight)
    assert error["code"] == "cors_origin_not_allowed" and "local_allowed_origins" in error["message"]


def _cors_app(origins: tuple[str, ...]) -> TestClient:
    app = FastAPI()
    app.add_middleware(Cors, origins=origins)

    @app.post("/v1/chat/completions")
    async def chat() -> dict:
        return {}

    return TestClient(app)


def test_with_no_origin_allowed_a_preflight_still_gets_the_setting_not_a_405(tmp_path, tiny_model_path):
    config = tmp_path / "provider.toml"
    config.write_text("local_allowed_origins = []\n")
    srv = start_server(tmp_path, tiny_model_path, env_extra={"DARKBLOOM_CONFIG": str(config)})
    try:
        origin = "http://localhost:3000"
        preflight = httpx.options(srv.base_url + "/v1/chat/completions", timeout=10,
                                  headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers
        assert "local_allowed_origins" in openai_error(preflight)["message"]
        models = httpx.get(srv.base_url + "/v1/models", headers={"Origin": origin}, timeout=10)
        assert models.status_code == 403 and "access-control-allow-origin" not in models.headers
    finally:
        srv.stop()


def test_any_port_is_the_host_on_any_port_or_none_and_nothing_else():
    client = _cors_app(("http://localhost:*", "https://chat.example:8443"))
    allowed = ["http://localhost", "http://localhost:1", "http://localhost:65535", "https://chat.example:8443"]
    refused = ["https://localhost:3000", "http://localhost:", "http://localhost:3000/", "http://localhostx:3000",
               "http://xlocalhost:3000", "https://chat.example", "http://localhost:3000.evil.example"]
    for origin in allowed + refused:
        preflight = client.options("/v1/chat/completions", headers={"Origin": origin,
                                                                    "Access-Control-Request-Method": "POST"})
        assert (preflight.status_code == 200) is (origin in allowed), origin


# --- privacy: a bad body's values are never echoed nor logged

BAD_VALUES = [  # each carries the canary where a careless error message or log line would repeat it
    ("/v1/chat/completions", {"stream": CANARY}, "stream"),
    ("/v1/chat/completions", {"temperature": CANARY}, "temperature"),
    ("/v1/chat/completions", {"top_k": CANARY}, "top_k"),
    ("/v1/chat/completions", {"presence_penalty": CANARY}, "presence_penalty"),
    ("/v1/chat/completions", {"logit_bias": {CANARY: 5}}, "logit_bias"),
    ("/v1/chat/completions", {"response_format": {"type": CANARY}}, "response_format.type"),
    ("/v1/chat/completions", {"tool_choice": CANARY}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": CANARY, "content": CANARY}]}, "messages.0.role"),
    ("/v1/completions", {"prompt": [CANARY, CANARY]}, "prompt"),
    ("/v1/completions", {"prompt": CANARY, "suffix": CANARY}, "suffix"),
    ("/v1/completions", {"prompt": CANARY, "echo": CANARY}, "echo"),
]


def test_a_bad_bodys_values_never_reach_the_response_or_the_log(server):
    for path, extra, param in BAD_VALUES:
        base = ({"messages": [{"role": "user", "content": CANARY}]} if path.endswith("chat/completions")
                else {"prompt": CANARY})
        response = httpx.post(server.base_url + path, json={"model": MODEL, **base, **extra}, timeout=30)
        assert response.status_code == 400, (path, param)
        error = openai_error(response)
        assert error["param"] == param and f"'{param}'" in error["message"]
        assert CANARY not in response.text
    log = server.log_path.read_text()
    invalid = [json.loads(line) for line in log.splitlines() if '"request_invalid"' in line]
    assert len(invalid) >= len(BAD_VALUES)
    assert CANARY not in log


# --- /v1/completions: the legacy prompt API, no chat template, same engine and admission

PROMPT = "the river model token batch stream is"


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """mlx-lm's own greedy continuation of the raw prompt (no template), and its prompt ids."""
    import mlx_lm
    from mlx_lm.generate import stream_generate

    from engine_arithmetic import StepLogits, assert_decisive

    model, tok = mlx_lm.load(str(tiny_model_path))
    ids = tok.encode(PROMPT)  # with the tokenizer's special tokens, as the server encodes a prompt
    logits = StepLogits()
    tokens = [r.token for r in stream_generate(model, tok, ids, max_tokens=8, logits_processors=[logits])]
    assert_decisive(logits.scores(), tokens, "mlx-lm on the raw prompt")
    return ids, mlx_lm.generate(model, tok, ids, max_tokens=8)


def test_a_completion_continues_the_raw_prompt_as_mlx_lm_does(server, reference):
    ids, text = reference
    reply = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert reply.object == "text_completion" and reply.model == MODEL and reply.id.startswith("cmpl-")
    (choice,) = reply.choices
    assert choice.text == text and choice.index == 0 and choice.logprobs is None
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(ids)  # the prompt alone: no chat template around it
    assert reply.usage.total_tokens == len(ids) + reply.usage.completion_tokens


def test_a_streamed_completion_is_the_same_text_in_text_completion_chunks(server, reference):
    ids, text = reference
    stream = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "text_completion" and c.model == MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1
    *body, finish, usage = chunks
    assert "".join(c.choices[0].text for c in body) == text
    assert finish.choices[0].finish_reason in ("stop", "length") and finish.choices[0].text == ""
    assert usage.choices == [] and usage.usage.prompt_tokens == len(ids)  # as OpenAI ends such a stream
    assert all(c.choices[0].finish_reason is None for c in body)


def test_a_streamed_completion_without_usage_ends_with_its_finish_reason_and_done(server):
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}) as response:
        raw = response.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    last = json.loads(events[-3].removeprefix(b"data: "))
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and "usage" not in last


@pytest.mark.parametrize("as_batch", [False, True])
def test_a_prompt_of_token_ids_is_the_same_request(server, reference, as_batch):
    ids, text = reference
    prompt = [ids] if as_batch else ids
    reply = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.choices[0].text == text and reply.usage.prompt_tokens == len(ids)


def test_a_completion_gets_openais_16_tokens_unless_it_asks(server):
    reply = server.client().completions.create(model=MODEL, prompt=PROMPT, temperature=0)
    assert 1 <= reply.usage.completion_tokens <= 16


def test_what_a_completion_cannot_do_is_a_400_naming_it(server):
    client = server.client()
    for kwargs, param in (({"prompt": ["a", "b"]}, "prompt"), ({"prompt": PROMPT, "echo": True}, "echo"),
                          ({"prompt": PROMPT, "suffix": "end"}, "suffix"), ({"prompt": PROMPT, "n": 2}, "n"),
                          ({"prompt": PROMPT, "best_of": 3}, "best_of"), ({"prompt": PROMPT, "logprobs": 2}, "logprobs"),
                          ({"prompt": [5, 999_999]}, "prompt"), ({"prompt": ""}, "prompt"),
                          # chat's output controls: refused here rather than ignored
                          ({"prompt": PROMPT, "extra_body": {"tools": [{"type": "function", "function": {"name": "f"}}]}},
                           "tools"),
                          ({"prompt": PROMPT, "extra_body": {"tool_choice": "required"}}, "tool_choice"),
                          ({"prompt": PROMPT, "extra_body": {"response_format": {"type": "json_object"}}},
                           "response_format")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, max_tokens=2, **kwargs)
        assert caught.value.body["param"] == param, kwargs
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[5, 999_999], max_tokens=2)
    assert "below 2048" in caught.value.body["message"]  # the tiny model's vocabulary


def test_a_completion_for_an_unknown_model_names_it_and_what_is_served(server):
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().completions.create(model="no/such-model", prompt=PROMPT, max_tokens=2)
    error = caught.value.body
    assert (error["code"], error["param"]) == ("model_unavailable", "model")
    assert "'no/such-model'" in error["message"] and f"Models served: {MODEL}." in error["message"]


# --- the unknown-model and context errors of a chat, with their ids and numbers

def test_a_chat_for_an_unknown_model_names_it_and_what_is_served(server):
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().chat.completions.create(model="no/such-model", messages=[{"role": "user", "content": "x"}])
    error = caught.value.body
    assert (error["code"], error["param"]) == ("model_unavailable", "model")
    assert error["message"] == f"The model 'no/such-model' is not served here. Models served: {MODEL}."
    assert "retry-after" not in caught.value.response.headers


@pytest.mark.parametrize("words", [1500, 600])  # refused by the size bound alone, then by the exact count
def test_a_prompt_over_the_context_gives_its_tokens_max_tokens_and_the_window(server, words):
    too_long = f"{CANARY} " * words
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": too_long}],
                                                max_tokens=100)
    error = caught.value.body
    assert (error["code"], error["reason"], error["param"]) == ("invalid_request", "request_exceeds_context", "messages")
    message = error["message"]
    assert f"model '{MODEL}' has a context window of 2048 tokens" in message and "(max_tokens 100)" in message
    tokens = int(message.split(" tokens but ")[0].split()[-1])
    assert tokens >= 2048 and CANARY not in message


def test_a_completion_over_the_context_says_so_in_numbers(server, reference):
    ids, _ = reference
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().completions.create(model=MODEL, prompt=ids * (2048 // len(ids) + 1), max_tokens=5)
    error = caught.value.body
    assert (error["reason"], error["param"]) == ("request_exceeds_context", "prompt")
    exact = len(ids) * (2048 // len(ids) + 1)
    assert error["message"].startswith(f"This prompt has {exact} tokens but model '{MODEL}'")


async def test_a_request_that_misses_a_routes_declared_parameters_is_an_openai_400():
    """FastAPI's own validation errors (a route's typed query or path parameter) in OpenAI's shape: the
    handlers every local app installs, on a route that declares one."""
    from fastapi import FastAPI

    from provider.local.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/v1/things")
    async def things(limit: int) -> dict:
        return {"limit": limit}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://local") as client:
        bad = await client.get("/v1/things", params={"limit": CANARY})
        missing = await client.get("/v1/things")
        assert (await client.get("/v1/things", params={"limit": 3})).json() == {"limit": 3}
    for response in (bad, missing):
        assert response.status_code == 400
        error = openai_error(response)
        assert (error["param"], error["code"]) == ("limit", "invalid_request") and "detail" not in response.text
    assert CANARY not in bad.text
