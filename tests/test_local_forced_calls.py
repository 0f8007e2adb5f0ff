"""Forced tool calls through `serve --local` with the openai SDK.

`tool_choice: "required"` or a named function is a grammar in the continuous batch: the tiny tools
model's weights are random, yet every forced answer is a call to an offered function whose arguments
validate against its schema, read back by the family's parser (mlx-lm's json_tools) into OpenAI's
`tool_calls` with finish_reason "tool_calls"; plain requests in the same batch get exactly the tokens
they get alone; a streamed call reassembles to the non-streamed one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from local_server import CANARY, Server, running_server
from mixed_batch import beside_plain

MODEL = "demo/tools"
ROOM = 400  # tokens: more than one call to any function below takes at its longest


def _function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} {CANARY}", "parameters": parameters}}


BOOK = _function("book_trip", {
    "type": "object", "properties": {
        "city": {"enum": ["Oslo", "Paris", "Lima"]},
        "nights": {"type": "integer", "minimum": 1, "maximum": 14},
        "guests": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
        CANARY: {"type": "boolean"}},
    "required": ["city", "nights", "guests"], "additionalProperties": False})
MOVE = _function("move_arm", {
    "type": "object", "properties": {
        "to": {"type": "object", "properties": {
            "x": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
            "y": {"type": "number", "minimum": 0, "maximum": 2, "multipleOf": 0.5}},
            "required": ["x", "y"], "additionalProperties": False},
        "speed": {"enum": ["slow", "fast"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["to", "speed"], "additionalProperties": False})
TIME = _function("get_time", {"type": "object", "properties": {}, "additionalProperties": False})
WEATHER = _function("get_weather", {  # a free string: random weights may write it past any max_tokens
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TOOLS = [BOOK, MOVE, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in [*TOOLS, WEATHER]}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path, tiny_tools_model_path) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("forced"), tiny_model_path,
                        "--model-aliases", f"{MODEL}={tiny_tools_model_path}") as srv:
        yield srv


def choice_of(i: int) -> str | dict:
    """Every third request `required`, the others a named function in turn."""
    if i % 3 == 0:
        return "required"
    return {"type": "function", "function": {"name": TOOLS[i % len(TOOLS)]["function"]["name"]}}


def forced_request(client: openai.OpenAI, i: int):
    choice = choice_of(i)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"task {i}: {CANARY}"}], tools=TOOLS, tool_choice=choice,
        parallel_tool_calls=False, max_tokens=ROOM, temperature=1.0, seed=i)
    return choice, reply


def test_forty_forced_calls_validate_at_concurrency_8_beside_plain_requests(server):
    client = server.client()
    results = beside_plain(client, MODEL, forced_request)
    valid = 0
    for choice, reply in results:
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1
        call = answer.message.tool_calls[0]
        if choice != "required":
            assert call.function.name == choice["function"]["name"]
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        valid += 1
    assert valid == 40
    status = httpx.get(server.base_url + "/status").json()
    assert status["ledger"]["bytes_by_kind"]["grammar"] == 0 and status["in_flight"] == 0
    assert CANARY not in server.log_path.read_text()  # neither the prompt nor a schema's property name


def test_required_with_parallel_calls_gives_calls_that_each_validate(server):
    for seed in range(3):
        reply = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "what time is it?"}], tools=[TIME, MOVE],
            tool_choice="required", max_tokens=1500, temperature=1.0, seed=seed)
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls" and 1 <= len(answer.message.tool_calls) <= 8
        assert len({c.id for c in answer.message.tool_calls}) == len(answer.message.tool_calls)
        for call in answer.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_forced_answer_cut_by_max_tokens_keeps_its_whole_calls_and_never_returns_the_rest_as_content(server):
    """`required` with parallel calls (the default): a call that max_tokens cut is dropped (the first
    one, or one after whole calls, which stay, with finish_reason length), streamed or not."""
    client = server.client()
    shapes = set()
    for seed in range(12):
        asked = dict(model=MODEL, messages=[{"role": "user", "content": "the weather?"}], tools=[TIME, WEATHER],
                     tool_choice="required", max_tokens=60, temperature=1.0, seed=seed)
        answer = client.chat.completions.create(**asked).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in answer.message.tool_calls or ()]
        assert not answer.message.content, seed
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert answer.finish_reason in ("tool_calls", "length") and (calls or answer.finish_reason == "length")
        shapes.add((len(calls) > 0, answer.finish_reason))
        streamed: dict[int, list[str]] = {}
        finish = None
        for chunk in client.chat.completions.create(**asked, stream=True):
            delta = chunk.choices[0].delta
            assert not delta.content, seed
            for part in delta.tool_calls or ():
                call = streamed.setdefault(part.index, ["", ""])
                call[0] += part.function.name or ""
                call[1] += part.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert ([tuple(c) for c in streamed.values()], finish) == (calls, answer.finish_reason), seed
    # Both cuts happen among these seeds: of the first call, and of one after a whole call.
    assert {(False, "length"), (True, "length")} <= shapes


def test_a_forced_calls_numbers_without_bounds_close_within_max_tokens(server):
    place = _function("go_to", {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                                "required": ["lat", "lon"], "additionalProperties": False})
    client = server.client()
    for seed in range(12):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go"}], tools=[place], max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "go_to"}}, temperature=1.0, seed=seed)
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls", (seed, reply.usage.completion_tokens)
        [call] = answer.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), place["function"]["parameters"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "move_arm"}}])
def test_a_streamed_forced_call_reassembles_to_the_non_streamed_one(server, choice):
    client = server.client()
    asked = dict(model=MODEL, messages=[{"role": "user", "content": "move it"}], tools=TOOLS, tool_choice=choice,
                 parallel_tool_calls=False, max_tokens=ROOM, temperature=0)
    whole = client.chat.completions.create(**asked).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**asked, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content  # a forced answer is the call and nothing else
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            if part.function is not None:
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"] for c in calls.values())


def test_refusals_name_tool_choice_or_response_format(server):
    client = server.client()
    bad = _function("f", {"not": {"type": "string"}})
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[bad],
                                       tool_choice="required", max_tokens=4)
    assert caught.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                       tool_choice="required", response_format={"type": "json_object"}, max_tokens=4)
    assert caught.value.body["param"] == "response_format"
    assert CANARY not in caught.value.response.text
    status = httpx.get(server.base_url + "/status").json()
    assert status["ledger"]["bytes_by_kind"]["grammar"] == 0
