"""`tools`, `tool_choice` and tool turns in the one body validator (provider/request/body.py),
shared by the coordinator's jobs and the local server: a malformed one is a 400 naming it, a
valid one reaches the chat template as the template expects it (arguments as an object)."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_tokenizer

from intake_fakes import Manager, ledger_of
from provider.engine import ToolCallConstraint
from provider.models.tools import ToolFormat
from provider.request import PromptCounter
from provider.request.body import InvalidBody, ToolChoice, parse_chat_body
from provider.request.tokens import INLINE_CHARS, ToolsUnsupported

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


# --- the prompt: tools reach the chat template (provider/request/tokens.py, intake.py) --------------


@pytest.fixture
def counter(tiny_tools_model_path, tiny_model_path):
    c = PromptCounter({"tools": tiny_tools_model_path, "plain": tiny_model_path})
    yield c
    c.lane.close()


def mlx_lm_ids(path, messages, tools=None) -> list[int]:
    """What mlx-lm's own `apply_chat_template` makes of them (in this process: a test, not the agent)."""
    return list(load_tokenizer(path).apply_chat_template(list(messages), tools=tools, add_generation_prompt=True))


TURNS = [USER, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "7 C"}]


@pytest.mark.parametrize("words", [1, INLINE_CHARS])  # on the loop, and in the bulk lane
async def test_the_prompt_counts_the_tools_as_the_template_renders_them(counter, tiny_tools_model_path, words):
    messages = parse_chat_body(body(messages=[{"role": "user", "content": "hi " * words}])).messages
    bare = await counter.prompt_ids("tools", messages)
    ids = await counter.prompt_ids("tools", messages, tools=(WEATHER, TIME))
    assert ids == mlx_lm_ids(tiny_tools_model_path, messages, [WEATHER, TIME])
    assert len(ids) > len(bare)
    text = load_tokenizer(tiny_tools_model_path).decode(ids)
    assert '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city"' in text


async def test_a_tool_turn_round_trips_through_the_template(counter, tiny_tools_model_path):
    parsed = parse_chat_body(body(messages=TURNS, tools=[WEATHER]))
    ids = await counter.prompt_ids("tools", parsed.messages, tools=parsed.offered_tools)
    assert ids == mlx_lm_ids(tiny_tools_model_path, parsed.messages, [WEATHER])
    text = load_tokenizer(tiny_tools_model_path).decode(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n7 C\n</tool_response>" in text


async def test_a_model_without_tool_calling_refuses_tools_and_says_so(counter):
    assert (await counter.tool_format("tools")).name == "json_tools"
    assert await counter.tool_format("plain") is None
    with pytest.raises(ToolsUnsupported):
        await counter.prompt_ids("plain", [USER], tools=(WEATHER,))
    assert await counter.prompt_ids("plain", [USER])  # without tools it is served as before


async def test_the_intake_names_tools_for_a_model_without_tool_calling(counter):
    from provider.request.intake import Intake

    intake = Intake(counter, ledger_of(64), Manager())
    async with intake.ticket("r", 100) as ticket:
        with pytest.raises(InvalidBody) as caught:
            await intake.prompt_ids(ticket, parse_chat_body({"model": "plain", "messages": [USER], "tools": [WEATHER]}))
        assert caught.value.field == "tools" and "tool calling" in caught.value.rule
        # tool_choice none: the tools are not offered, so nothing is refused
        none = parse_chat_body({"model": "plain", "messages": [USER], "tools": [WEATHER], "tool_choice": "none"})
        assert await intake.prompt_ids(ticket, none) == await counter.prompt_ids("plain", [USER])
        tools = parse_chat_body({"model": "tools", "messages": [USER], "tools": [WEATHER]})
        assert await intake.prompt_ids(ticket, tools) == await counter.prompt_ids("tools", [USER], tools=(WEATHER,))


# --- the hook constrained decoding fills in (ChatRequest.tool_call) --------------------------------


def test_a_forced_call_names_the_functions_it_may_call_in_the_models_format():
    fmt = ToolFormat("json_tools", "<tool_call>", "</tool_call>", lambda text, tools: None)
    required = parse_chat_body(body(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    assert required.tool_call(fmt) == ToolCallConstraint("json_tools", "<tool_call>", "</tool_call>",
                                                         (WEATHER["function"], TIME["function"]), parallel=False)
    named = parse_chat_body(body(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.tool_call(fmt).functions == (TIME["function"],) and named.tool_call(fmt).parallel
    assert parse_chat_body(body(tools=[WEATHER])).tool_call(fmt) is None  # auto: the model answers freely
    assert required.tool_call(None) is None  # no tool calling: refused before it gets here
