"""`response_format` and `logprobs` in the one body parser (provider/request/body.py, response_format.py)."""

from __future__ import annotations

import pytest

from provider.request.body import InvalidBody, parse_chat_body

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def body(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def refused(**extra) -> InvalidBody:
    with pytest.raises(InvalidBody) as caught:
        parse_chat_body(body(**extra))
    return caught.value


def test_text_or_nothing_is_no_constraint():
    assert parse_chat_body(body()).response_format is None
    assert parse_chat_body(body(response_format={"type": "text"})).response_format is None


def test_json_object_and_json_schema_become_grammars():
    plain = parse_chat_body(body(response_format={"type": "json_object"})).response_format
    schema = parse_chat_body(body(response_format={"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True}})).response_format
    assert plain.kind == "json_object" and schema.kind == "json_schema" and plain.grammar != schema.grammar
    no_schema = parse_chat_body(body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}))
    assert no_schema.response_format.grammar == plain.grammar  # no schema: any object


@pytest.mark.parametrize(("response_format", "field"), [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [SCHEMA]}}, "response_format.json_schema.schema"),
])
def test_a_malformed_response_format_names_its_part(response_format, field):
    assert refused(response_format=response_format).field == field


def test_a_schema_the_engine_cannot_handle_is_a_400_naming_response_format_and_never_quoting_it():
    secret = "CANARY-schema-7f3a"
    caught = refused(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {secret: {"type": "strin"}}}}})
    assert caught.field == "response_format" and secret not in caught.message and "strin" not in caught.message
    assert caught.message == ("Invalid parameter 'response_format': must be a JSON schema the grammar engine "
                              "supports (json_schema.schema).")


def test_logprobs_and_top_logprobs():
    assert parse_chat_body(body()).top_logprobs is None
    assert parse_chat_body(body(logprobs=False)).top_logprobs is None
    assert parse_chat_body(body(logprobs=True)).top_logprobs == 0
    assert parse_chat_body(body(logprobs=True, top_logprobs=20)).top_logprobs == 20
    assert refused(top_logprobs=3).field == "top_logprobs"  # OpenAI: logprobs must be true with it
    assert refused(logprobs=True, top_logprobs=21).message == \
        "Invalid parameter 'top_logprobs': must be an integer between 0 and 20."
    assert refused(logprobs="yes").field == "logprobs"
    assert refused(logprobs=True, top_logprobs=2.0).field == "top_logprobs"
