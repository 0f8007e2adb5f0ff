"""Structured output and log-probabilities through `serve --local`, driven with the openai SDK.

The tiny model's weights are random: every JSON answer below validates because the grammar forces
it, in the same continuous batch as plain requests, which get exactly the tokens they get alone.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import mlx_lm
import openai
import pytest

from engine_reference import reference_greedy
from local_server import CANARY, MODEL, running_server
from mixed_batch import PLAIN, beside_plain

ROOM = 300  # tokens: more than any schema below needs at its longest


def _schemas() -> list[dict]:
    """Nested objects, arrays, enums, numbers with bounds, required fields: every language finite."""
    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                              "y": {"type": "number", "minimum": 0, "maximum": 4, "multipleOf": 0.5}},
             "required": ["x", "y"], "additionalProperties": False}
    return [
        {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "role": {"enum": ["admin", "user", "guest"]},
            "home": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 1000, "maximum": 9999},
                                                      "city": {"type": "string", "maxLength": 6}},
                     "required": ["zip"], "additionalProperties": False}},
         "required": ["name", "age", "role", "home"], "additionalProperties": False},
        {"type": "object", "properties": {
            "points": {"type": "array", "items": point, "minItems": 1, "maxItems": 3},
            "closed": {"type": "boolean"}},
         "required": ["points", "closed"], "additionalProperties": False},
        {"type": "object", "properties": {
            "score": {"type": "number", "minimum": -2.5, "maximum": 2.5, "multipleOf": 0.25},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
            "note": {"type": ["string", "null"], "maxLength": 5},
            CANARY: {"type": "integer", "minimum": 0, "maximum": 3}},
         "required": ["score", "tags", CANARY], "additionalProperties": False},
        {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["a", "b"]},
                                                                     "v": {"type": "integer", "minimum": 0, "maximum": 99}},
                                    "required": ["k", "v"], "additionalProperties": False},
         "minItems": 1, "maxItems": 3},
    ]


SCHEMAS = _schemas()


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path):
    with running_server(tmp_path_factory.mktemp("structured"), tiny_model_path) as srv:
        yield srv


def schema_request(client: openai.OpenAI, i: int):
    schema = SCHEMAS[i % len(SCHEMAS)]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"record {i}: {CANARY}"}], max_tokens=ROOM,
        temperature=1.0, seed=i, response_format={"type": "json_schema", "json_schema": {
            "name": f"record_{i % len(SCHEMAS)}", "schema": schema, "strict": True}})
    return schema, reply


def test_forty_json_schema_answers_validate_at_concurrency_8_beside_plain_requests(server, tiny_model_path):
    client = server.client()
    results = beside_plain(client, MODEL, schema_request)
    valid = 0
    for schema, reply in results:
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        valid += 1
    assert valid == 40
    reference = mlx_lm.load(str(tiny_model_path))
    for p in PLAIN:  # the comparison above is exact only where no greedy choice is a near-tie
        reference_greedy(reference, p, 16)
    status = httpx.get(server.base_url + "/status").json()
    assert status["ledger"]["bytes_by_kind"]["grammar"] == 0 and status["in_flight"] == 0
    assert CANARY not in server.log_path.read_text()  # neither the prompt nor the schema's property name


PLACE = {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
         "required": ["lat", "lon"], "additionalProperties": False}


def test_numbers_without_bounds_still_close_within_max_tokens(server):
    """A number may take only the digits a double carries (17, and 3 in an exponent): random weights no
    longer run to max_tokens inside `lat`."""
    client = server.client()
    for seed in range(12):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "where?"}], max_tokens=200, temperature=1.0,
            seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (seed, reply.usage.completion_tokens)
        jsonschema.validate(json.loads(choice.message.content), PLACE)


def test_json_object_answers_parse(server):
    client = server.client()
    for seed in range(6):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "give me an object"}], max_tokens=ROOM,
            temperature=1.0, seed=seed, response_format={"type": "json_object"})
        choice = reply.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # any object is an unbounded language: cut at max_tokens, as OpenAI reports it
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_streamed_structured_output_validates(server):
    schema = SCHEMAS[1]
    stream = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream it"}], max_tokens=ROOM, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "points", "schema": schema}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_max_tokens_cuts_structured_output_with_length(server):
    reply = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "short"}], max_tokens=3, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {
        CANARY: {"type": "string", "pattern": "(?<=a)b"}}}}},
    {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"not": {"type": "string"}}}},
])
def test_a_schema_the_grammar_engine_rejects_is_a_400_naming_response_format(server, response_format):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=4, response_format=response_format)
    body = err.value.response.json()["error"]
    assert body["param"] == "response_format" and "response_format" in body["message"]
    assert CANARY not in err.value.response.text and CANARY not in server.log_path.read_text()
    assert "retry-after" not in err.value.response.headers


def test_log_probabilities_in_openais_shape_streamed_and_not(server):
    client = server.client()
    asked = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0,
                 logprobs=True, top_logprobs=3)
    reply = client.chat.completions.create(**asked)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens - (reply.choices[0].finish_reason == "stop")
    spelled = b"".join(bytes(e.bytes) for e in content).decode()
    assert spelled.removeprefix(" ") == reply.choices[0].message.content  # mlx-lm's BPE detokenizer drops a leading space
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best is the one chosen
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    chunks = list(client.chat.completions.create(**asked, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == reply.choices[0].message.content
    no_top = client.chat.completions.create(**{**asked, "top_logprobs": 0})
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)


def test_logprobs_parameters_are_checked(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert err.value.response.json()["error"]["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True,
                                       top_logprobs=21)
    assert err.value.response.json()["error"]["param"] == "top_logprobs"
