"""The chat messages rules of the one body validator (provider/request/body.py), shared by the coordinator's
jobs and the local server: a known role, and content wherever OpenAI requires it."""

from __future__ import annotations

import pytest

from provider.request.body import InvalidBody, parse_chat_body


def body(*messages: dict) -> dict:
    return {"model": "m", "messages": list(messages)}


@pytest.mark.parametrize("message, field, rule", [
    ({"role": "wizard", "content": "hi"}, "messages.0.role", "must be one of"),
    ({"role": "User", "content": "hi"}, "messages.0.role", "must be one of"),
    ({"role": "user"}, "messages.0.content", "is required"),
    ({"role": "user", "content": None}, "messages.0.content", "is required"),
    ({"role": "system"}, "messages.0.content", "is required"),
    ({"role": "tool", "tool_call_id": "c1"}, "messages.0.content", "is required"),
    ({"role": "assistant"}, "messages.0.content", "is required"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "messages.0.content", "is required"),
])
def test_an_unknown_role_or_missing_content_is_a_client_error(message, field, rule):
    with pytest.raises(InvalidBody) as caught:
        parse_chat_body(body(message))
    assert caught.value.field == field and rule in caught.value.rule


def test_the_second_message_is_named_by_its_index():
    with pytest.raises(InvalidBody) as caught:
        parse_chat_body(body({"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}))
    assert caught.value.field == "messages.1.role"


@pytest.mark.parametrize("message", [
    {"role": "system", "content": "be brief"},
    {"role": "developer", "content": "be brief"},
    {"role": "user", "content": ""},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": "sure"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "content": "42", "tool_call_id": "c1"},
])
def test_every_openai_role_with_its_content_is_accepted(message):
    parsed = parse_chat_body(body(message))
    assert parsed.messages[0]["role"] == message["role"]
