"""Tool calls read out of a completion (provider/response/toolcalls.py, openai.py).

Random weights call no tool by themselves, so the output side is driven with known answers: their
real token ids (the tiny tool-calling model's tokenizer, `<tool_call>` = 3) go one at a time through
the engine's own text path (`textstream.CompletionText`, mlx-lm's streaming detokenizer and the stop
filter), then through the chunk builder both front doors use; the chunks are read back with the
`openai` SDK's own stream accumulator, and must give what the whole answer gives."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from protocol import sse
from provider.engine import Finished, FinishReason, TextDelta, TokenLogprob, Usage
from provider.engine.textstream import CompletionText
from provider.models.tools import ToolFormat
from provider.response.openai import ChatChunks, chat_completion
from provider.response.toolcalls import ToolCall, ToolCallStream, tool_calls_for

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = (WEATHER, TIME)

CALL_1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris 日本"}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
TWO_CALLS = "Let me look.\n" + CALL_1 + "\n" + CALL_2


@pytest.fixture(scope="module")
def tokenizer(tiny_tools_model_path):
    return load_tokenizer(tiny_tools_model_path)


@pytest.fixture(scope="module")
def fmt(tokenizer) -> ToolFormat:
    found = ToolFormat.of(tokenizer)
    assert found is not None and (found.name, found.start, found.end) == ("json_tools", "<tool_call>", "</tool_call>")
    return found


def engine_deltas(tokenizer, text: str, stops=()) -> list[str]:
    """`text`'s token ids through the engine's text path, one token at a time, as the worker emits them."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    completion = CompletionText(tokenizer.detokenizer, stops)
    deltas = []
    for token in ids:
        out = completion.add(token)
        deltas += [out.text] if out.text else []
        if out.stopped:  # the worker finishes the request here
            return deltas, len(ids)
    tail = completion.finish().text
    return deltas + ([tail] if tail else []), len(ids)


def streamed(fmt, deltas, reason=FinishReason.STOP, tokens=10, parallel=True):
    """The chunks the front doors send for these deltas, parsed by the openai SDK and accumulated by it."""
    chunks = ChatChunks("chatcmpl-1", "m", created=1, tools=tool_calls_for(fmt, TOOLS, parallel=parallel))
    sent = [chunks.role()]
    for text in deltas:
        sent += chunks.for_event(TextDelta(text))
    sent += chunks.for_event(Finished(reason, Usage(5, tokens), ()))
    parsed = [ChatCompletionChunk.model_validate_json(sse.event(c)[len(b"data: "):]) for c in sent]
    state = ChatCompletionStreamState()
    for chunk in parsed:
        state.handle_chunk(chunk)
    return parsed, state.get_final_completion()


def whole(fmt, text, reason=FinishReason.STOP, parallel=True, forced=False) -> ChatCompletion:
    done = Finished(reason, Usage(5, 10), ())
    obj = chat_completion("chatcmpl-1", "m", text, done, created=1,
                          tools=tool_calls_for(fmt, TOOLS, parallel=parallel, forced=forced))
    return ChatCompletion.model_validate_json(sse.event(obj)[len(b"data: "):])


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_parallel_calls_stream_as_openai_streams_them_and_reassemble_to_the_whole_answer(tokenizer, fmt):
    deltas, n = engine_deltas(tokenizer, TWO_CALLS)
    assert tokenizer.encode(CALL_1, add_special_tokens=False)[0] == 3 and len(deltas) > 20  # token by token
    chunks, final = streamed(fmt, deltas)
    content = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(content) == "Let me look." and not any("<tool" in t or "tool_call" in t for t in content)
    firsts = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in firsts if d.id] == [
        (0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    assert all(d.id.startswith("call_") for d in firsts if d.id)
    assert [d.function.name for d in firsts if not d.id] == [None, None]  # the arguments come after the name
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    message = final.choices[0].message
    assert calls_of(message) == [("get_weather", {"city": "Paris 日本"}), ("get_time", {})]
    reply = whole(fmt, "".join(deltas))
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content == "Let me look."
    assert calls_of(reply.choices[0].message) == calls_of(message) and message.content == "Let me look."
    assert all(c.id.startswith("call_") and c.type == "function" for c in reply.choices[0].message.tool_calls)


def test_a_call_alone_has_null_content(tokenizer, fmt):
    deltas, _ = engine_deltas(tokenizer, CALL_1 + "\n")
    reply = whole(fmt, "".join(deltas))
    assert reply.choices[0].message.content is None and calls_of(reply.choices[0].message) == [
        ("get_weather", {"city": "Paris 日本"})]
    chunks, final = streamed(fmt, deltas)
    assert not any(c.choices[0].delta.content for c in chunks) and final.choices[0].message.content is None


def test_an_answer_without_calls_is_content_as_it_was_written(tokenizer, fmt):
    text = "No tool needed: 42 < 43 and <tool is not a call.\n\n"
    deltas, _ = engine_deltas(tokenizer, text)
    reply = whole(fmt, "".join(deltas))
    assert reply.choices[0].message.content == text and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    _, final = streamed(fmt, deltas)
    assert final.choices[0].message.content == text and final.choices[0].finish_reason == "stop"


def test_a_call_the_parser_cannot_read_is_content_markers_and_all(tokenizer, fmt):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    deltas, _ = engine_deltas(tokenizer, "Hm. " + broken)
    reply = whole(fmt, "".join(deltas))
    assert reply.choices[0].message.content == "Hm. " + broken and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    _, final = streamed(fmt, deltas)
    assert final.choices[0].message.content == "Hm. " + broken


def test_a_call_cut_short_by_max_tokens_finishes_with_length(tokenizer, fmt):
    deltas, _ = engine_deltas(tokenizer, CALL_1 + "\n" + CALL_2[:30])
    reply = whole(fmt, "".join(deltas), FinishReason.LENGTH)
    assert reply.choices[0].finish_reason == "length"
    assert calls_of(reply.choices[0].message) == [("get_weather", {"city": "Paris 日本"})]
    assert reply.choices[0].message.content == "\n" + CALL_2[:30]  # the unreadable rest, as written


@pytest.mark.parametrize("cut", [len(CALL_2) - 1, 30, len("<tool_call>"), 3])
def test_a_forced_answer_cut_short_keeps_its_whole_calls_and_drops_the_unfinished_one(tokenizer, fmt, cut):
    """`tool_choice` required / a named function: the grammar allows calls and nothing else, so the
    text of a call that did not close (max_tokens) is never content, streamed or whole."""
    deltas, _ = engine_deltas(tokenizer, CALL_1 + "\n" + CALL_2[:cut])
    reply = whole(fmt, "".join(deltas), FinishReason.LENGTH, forced=True)
    assert reply.choices[0].finish_reason == "length"
    assert calls_of(reply.choices[0].message) == [("get_weather", {"city": "Paris 日本"})]
    assert reply.choices[0].message.content is None
    chunks = forced_chunks(fmt, deltas)
    assert not any(c.choices[0].delta.content for c in chunks)
    assert [(d.function.name, json.loads(d.function.arguments)) for d in streamed_calls(chunks)] == calls_of(
        reply.choices[0].message)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_forced_answer_whose_first_call_is_cut_has_no_calls_and_no_content(tokenizer, fmt):
    deltas, _ = engine_deltas(tokenizer, CALL_1[:40])
    reply = whole(fmt, "".join(deltas), FinishReason.LENGTH, forced=True)
    message = reply.choices[0].message
    assert not message.tool_calls and not message.content and reply.choices[0].finish_reason == "length"
    chunks = forced_chunks(fmt, deltas)
    assert not any(c.choices[0].delta.content for c in chunks) and not streamed_calls(chunks)


def forced_chunks(fmt, deltas) -> list[ChatCompletionChunk]:
    """The chunks of a forced answer cut by max_tokens (the SDK's accumulator refuses a `length` one)."""
    chunks = ChatChunks("chatcmpl-1", "m", created=1, tools=tool_calls_for(fmt, TOOLS, forced=True))
    sent = [chunks.role(), *(c for text in deltas for c in chunks.for_event(TextDelta(text))),
            *chunks.for_event(Finished(FinishReason.LENGTH, Usage(5, 10), ()))]
    return [ChatCompletionChunk.model_validate_json(sse.event(c)[len(b"data: "):]) for c in sent]


def streamed_calls(chunks: list[ChatCompletionChunk]) -> list:
    """Each streamed call, its name and arguments joined (a call's deltas: name first, then arguments)."""
    calls: dict[int, object] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or ():
            if delta.id:
                calls[delta.index] = delta.model_copy(deep=True)
            else:
                calls[delta.index].function.arguments += delta.function.arguments
    return list(calls.values())


def test_a_forced_answer_that_closes_is_read_as_any_other(tokenizer, fmt):
    deltas, _ = engine_deltas(tokenizer, CALL_1 + "\n" + CALL_2)
    reply = whole(fmt, "".join(deltas), forced=True)
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    assert calls_of(reply.choices[0].message) == [("get_weather", {"city": "Paris 日本"}), ("get_time", {})]


def test_parallel_tool_calls_false_keeps_the_first_call_only(tokenizer, fmt):
    deltas, _ = engine_deltas(tokenizer, TWO_CALLS)
    reply = whole(fmt, "".join(deltas), parallel=False)
    assert calls_of(reply.choices[0].message) == [("get_weather", {"city": "Paris 日本"})]
    _, final = streamed(fmt, deltas, parallel=False)
    assert calls_of(final.choices[0].message) == calls_of(reply.choices[0].message)


def test_a_stop_string_inside_a_call_leaves_it_content(tokenizer, fmt):
    deltas, _ = engine_deltas(tokenizer, TWO_CALLS, stops=("Paris",))
    reply = whole(fmt, "".join(deltas))
    assert reply.choices[0].message.content == 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "'


def test_without_tools_the_text_is_not_read_for_calls(tokenizer, fmt):
    deltas, _ = engine_deltas(tokenizer, CALL_1)
    assert tool_calls_for(fmt, ()) is None and tool_calls_for(None, TOOLS) is None
    reply = whole(None, "".join(deltas))
    assert reply.choices[0].message.content == CALL_1 and reply.choices[0].finish_reason == "stop"


def test_the_model_own_call_id_is_kept(fmt):
    own = ToolFormat("mistral", "[TOOL_CALLS]", "", lambda text, tools: [
        {"name": "get_time", "arguments": {}, "id": "a1B2c3D4e"}])
    stream = ToolCallStream(own, TOOLS)
    assert stream.feed("[TOOL_CALLS]get_time[ARGS]{}") == []
    assert stream.finish() == [ToolCall(0, "a1B2c3D4e", "get_time", "{}")]  # runs to the end: read at the finish


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(TWO_CALLS)), max_size=12))
def test_however_the_text_is_cut_the_stream_gives_the_whole_answer(fmt, cuts):
    bounds = sorted({0, len(TWO_CALLS), *cuts})
    deltas = [TWO_CALLS[a:b] for a, b in zip(bounds, bounds[1:])]
    chunks, final = streamed(fmt, deltas)
    reply = whole(fmt, TWO_CALLS)
    assert final.choices[0].message.content == reply.choices[0].message.content == "Let me look."
    assert calls_of(final.choices[0].message) == calls_of(reply.choices[0].message)
    assert not any("tool_call>" in (c.choices[0].delta.content or "") for c in chunks)


def test_log_probabilities_of_text_held_inside_a_call_go_out_with_the_next_chunk(fmt):
    """Log-probabilities beside tools: every token's entry reaches the client once, in order, whether
    its text went out as content, inside a call, or not at all (the finish chunk carries the rest)."""
    pieces = ["Let me look.\n", *CALL_1, "\n", *CALL_2]
    entries = [TokenLogprob(i, -0.5, ()) for i in range(len(pieces))]
    chunks = ChatChunks("c", "m", tools=tool_calls_for(fmt, TOOLS), token_bytes=lambda token: bytes([65 + token % 26]))
    out = [*chunks.start()]
    for piece, entry in zip(pieces, entries):
        out += chunks.delta(piece, (entry,))
    out += chunks.end(Finished(FinishReason.STOP, Usage(3, len(pieces)), ()), include_usage=True)
    spelled = [e.token for c in out if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert spelled == [chr(65 + i % 26) for i in range(len(pieces))]
    assert [d.function.name for c in out for d in c.choices[0].delta.tool_calls if d.function.name] == [
        "get_weather", "get_time"]
    assert out[-1].choices[0].finish_reason == "tool_calls"
