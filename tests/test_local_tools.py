"""Tools through `serve --local` with the `openai` SDK: `/v1/models` says which
model calls tools, a request's tools reach the chat template (its prompt is what the renderer makes
of the messages with the tools: counted, and containing the schema), a conversation with tool
results round-trips through the template, malformed tools and tools to a model without tool
calling are 400s naming them, and no tool text reaches the log.

The tiny models' random weights call no tool by themselves: what the answer side does with a call is
tested on real token ids in test_engine_toolcalls.py."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from mlx_lm.utils import load_tokenizer

from local_server import CANARY, Server, running_server, start_server
from provider.models.template import render_ids

TOOLS_MODEL, PLAIN_MODEL = "demo/tools", "demo/tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": f"The weather in a city {CANARY}",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
USER = {"role": "user", "content": "what is the weather in Oslo?"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path, tiny_tools_model_path) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("tools"), tiny_model_path,
                        "--model-aliases", f"{TOOLS_MODEL}={tiny_tools_model_path}") as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(tiny_tools_model_path):
    return load_tokenizer(tiny_tools_model_path)


def rendered(tokenizer, messages, tools=()) -> list[int]:
    """The prompt the chat template makes of these messages and tools (the bounded renderer)."""
    return render_ids(tokenizer, messages, add_generation_prompt=True, tools=tools)


def test_models_say_which_model_calls_tools(server):
    listed = server.client().models.list().data
    assert {m.id: m.model_extra["capabilities"] for m in listed} == {
        TOOLS_MODEL: {"tools": True}, PLAIN_MODEL: {"tools": False}}
    assert [server.client().models.retrieve(m.id).model_dump() for m in listed] == [m.model_dump() for m in listed]


@pytest.mark.parametrize("stream", [False, True])
def test_the_tools_reach_the_template(server, tokenizer, stream):
    client = server.client()

    def prompt_tokens(**extra) -> int:
        if not stream:
            return client.chat.completions.create(model=TOOLS_MODEL, messages=[USER], max_tokens=2, temperature=0,
                                                  **extra).usage.prompt_tokens
        chunks = list(client.chat.completions.create(model=TOOLS_MODEL, messages=[USER], max_tokens=2, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}, **extra))
        return chunks[-1].usage.prompt_tokens

    expected = rendered(tokenizer, [USER], [WEATHER, TIME])
    assert prompt_tokens(tools=[WEATHER, TIME]) == len(expected) > prompt_tokens()
    text = tokenizer.decode(expected)
    assert '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city' in text
    assert '"enum": ["Oslo", "Paris"]' in text
    # tool_choice none: the model must not call, so the tools are not offered to it
    assert prompt_tokens(tools=[WEATHER, TIME], tool_choice="none") == len(rendered(tokenizer, [USER]))


def test_a_conversation_with_tool_results_round_trips_through_the_template(server, tokenizer):
    client = server.client()
    first = client.chat.completions.create(model=TOOLS_MODEL, messages=[USER], tools=[WEATHER], max_tokens=3,
                                           temperature=0)
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The client sends the call back as the SDK types it (arguments a JSON string), then the result.
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_abc", "content": f"7 C and windy {CANARY}"}]
    second = client.chat.completions.create(model=TOOLS_MODEL, messages=history, tools=[WEATHER], max_tokens=3,
                                            temperature=0)
    as_template = [USER, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}, history[2]]
    expected = rendered(tokenizer, as_template, [WEATHER])
    assert second.usage.prompt_tokens == len(expected)
    assert expected == list(tokenizer.apply_chat_template(as_template, tools=[WEATHER], add_generation_prompt=True))
    text = tokenizer.decode(expected)
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
           '<|im_end|>\n<|im_start|>user\n<tool_response>\n7 C and windy' in text
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_is_accepted_and_answered(server, choice):
    """Served with the tools offered; the forced call's grammar and its answer are tested in
    test_local_forced_calls.py (three tokens cut it at its start)."""
    reply = server.client().chat.completions.create(model=TOOLS_MODEL, messages=[USER], tools=[WEATHER, TIME],
                                                    tool_choice=choice, max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_malformed_tools_are_400s_naming_them(server, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=TOOLS_MODEL, messages=[USER], max_tokens=2, **extra)
    assert caught.value.body["param"] == param and caught.value.body["code"] == "invalid_request"
    assert param in caught.value.body["message"] and CANARY not in caught.value.body["message"]


def test_tools_to_a_model_without_tool_calling_are_a_400_naming_tools(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=PLAIN_MODEL, messages=[USER], tools=[WEATHER], max_tokens=2)
    assert caught.value.body["param"] == "tools" and "tool calling" in caught.value.body["message"]
    reply = server.client().chat.completions.create(model=PLAIN_MODEL, messages=[USER], tools=[WEATHER],
                                                    tool_choice="none", max_tokens=2)
    assert reply.choices[0].message.content is not None  # nothing offered, nothing refused


def test_no_tool_text_in_the_log(tmp_path, tiny_model_path, tiny_tools_model_path):
    """A server of its own, stopped to read its whole log (the module's is shared by tests that may run
    after this one on the same worker of a parallel run)."""
    srv = start_server(tmp_path, tiny_model_path, "--model-aliases", f"{TOOLS_MODEL}={tiny_tools_model_path}")
    try:
        srv.client().chat.completions.create(model=TOOLS_MODEL, messages=[USER], tools=[WEATHER], max_tokens=2)
    finally:
        code, log = srv.stop()
    assert code == 0 and "request_completed" in log and CANARY not in log
