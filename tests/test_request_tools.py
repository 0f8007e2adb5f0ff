"""`tools`, `tool_choice` and tool turns in the one body validator (provider/request/body.py, issue 31
item 1), shared by the coordinator's jobs and the local server: a malformed one is a 400 naming it, a
valid one reaches the chat template as the template expects it (arguments as an object)."""

from __future__ import annotations

import pytest

from provider.request.body import InvalidBody, ToolChoice, parse_chat_body

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = {"role": "user", "content": "hi"}


def body(**extra) -> dict:
    return {"model": "m", "messages": [USER], **extra}


def invalid(data: dict) -> InvalidBody:
    with pytest.raises(InvalidBody) as caught:
        parse_chat_body(data)
    return caught.value


def test_tools_are_kept_as_openai_sends_them_and_auto_is_the_default():
    parsed = parse_chat_body(body(tools=[WEATHER, TIME]))
    assert parsed.tools == (WEATHER, TIME)
    assert parsed.tool_choice == ToolChoice("auto") and parsed.parallel_tool_calls
    assert parsed.offered_tools == (WEATHER, TIME)


@pytest.mark.parametrize("tools", [None, []])
def test_no_tools_means_tool_choice_none(tools):
    parsed = parse_chat_body(body(tools=tools))
    assert parsed.tools == () and parsed.tool_choice == ToolChoice("none") and parsed.offered_tools == ()


@pytest.mark.parametrize("choice, expected", [
    ("none", ToolChoice("none")), ("auto", ToolChoice("auto")), ("required", ToolChoice("required")),
    ({"type": "function", "function": {"name": "get_time"}}, ToolChoice("function", "get_time")),
])
def test_every_tool_choice_is_read(choice, expected):
    parsed = parse_chat_body(body(tools=[WEATHER, TIME], tool_choice=choice))
    assert parsed.tool_choice == expected
    # `none`: the model must not call, so the tools are not offered to it (nor its output parsed)
    assert parsed.offered_tools == (() if expected.mode == "none" else (WEATHER, TIME))


@pytest.mark.parametrize("tools, field", [
    ("get_weather", "tools"),
    ({"type": "function"}, "tools"),
    (["get_weather"], "tools.0"),
    ([{"type": "web_search"}], "tools.0.type"),
    ([{"type": "function"}], "tools.0.function"),
    ([{"type": "function", "function": {}}], "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "get weather"}}], "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 7}}], "tools.0.function.description"),
    ([TIME, {"type": "function", "function": {"name": 3}}], "tools.1.function.name"),
    ([TIME, TIME], "tools"),
])
def test_a_malformed_tool_is_a_400_naming_tools(tools, field):
    caught = invalid(body(tools=tools))
    assert caught.field == field
    assert caught.field.startswith("tools") and "get_weather" not in caught.message


@pytest.mark.parametrize("tools, choice", [
    ([WEATHER], "sometimes"),
    ([WEATHER], 1),
    ([WEATHER], {"type": "function"}),
    ([WEATHER], {"type": "function", "function": {}}),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}),  # not one of the tools
    ([WEATHER], {"type": "custom", "function": {"name": "get_weather"}}),
    (None, "required"),  # nothing to call
    (None, {"type": "function", "function": {"name": "get_weather"}}),
])
def test_a_malformed_tool_choice_is_a_400_naming_tool_choice(tools, choice):
    caught = invalid(body(tools=tools, tool_choice=choice))
    assert caught.field == "tool_choice" and "must be" in caught.rule


def test_parallel_tool_calls_must_be_a_boolean():
    assert not parse_chat_body(body(tools=[WEATHER], parallel_tool_calls=False)).parallel_tool_calls
    assert invalid(body(tools=[WEATHER], parallel_tool_calls="no")).field == "parallel_tool_calls"


def test_an_assistant_tool_call_reaches_the_template_with_its_arguments_as_an_object():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    parsed = parse_chat_body(body(messages=[USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                                            {"role": "tool", "tool_call_id": "call_1", "content": "7 C"}]))
    assistant, tool = parsed.messages[1], parsed.messages[2]
    assert assistant["tool_calls"] == [{"id": "call_1", "type": "function",
                                        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    assert tool == {"role": "tool", "content": "7 C", "tool_call_id": "call_1"}


def test_arguments_that_are_not_a_json_object_reach_the_template_as_sent():
    call = {"id": "c", "function": {"name": "f", "arguments": "not json"}}
    parsed = parse_chat_body(body(messages=[USER, {"role": "assistant", "content": "", "tool_calls": [call]}]))
    assert parsed.messages[1]["tool_calls"][0] == {"id": "c", "type": "function",
                                                   "function": {"name": "f", "arguments": "not json"}}


@pytest.mark.parametrize("message, field", [
    ({"role": "tool", "content": "7"}, "messages.1.tool_call_id"),
    ({"role": "tool", "content": "7", "tool_call_id": 3}, "messages.1.tool_call_id"),
    ({"role": "assistant", "content": None, "tool_calls": "f"}, "messages.1.tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}, "messages.1.tool_calls.0.function"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]},
     "messages.1.tool_calls.0.function.name"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
     "messages.1.tool_calls.0.id"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "x",
                                                            "function": {"name": "f", "arguments": "{}"}}]},
     "messages.1.tool_calls.0.type"),
])
def test_a_malformed_tool_turn_is_a_400_naming_it(message, field):
    assert invalid(body(messages=[USER, message])).field == field
