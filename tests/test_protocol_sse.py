"""protocol.sse: OpenAI chat-completion objects; one ``data: …`` line per coordinator-bound chunk, and
``data: …\\n\\n`` events plus one ``[DONE]`` for an HTTP stream."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from protocol.sse import (
    DONE,
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessage,
    ChunkFactory,
    CompletionChoice,
    CompletionUsage,
    Delta,
    FinishReason,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    data_line,
    event,
)

MODEL = "mlx-community/Qwen3.5-9B-Instruct-4bit"
STREAM = ChunkFactory("chatcmpl-9f2", 1777777777, MODEL)


def _payload(data: bytes) -> dict:
    assert data.startswith(b"data: ") and data.endswith(b"\n\n")
    assert data.count(b"\n\n") == 1 and data.count(b"data: ") == 1  # exactly one event
    return json.loads(data[len(b"data: ") : -2])


def test_protocol_md_7_3_chunk_plaintexts_byte_for_byte():
    """Each chunk is one ``data: {json}`` line, no trailing blank line, no [DONE] chunk: the [A]
    coordinator appends ``\\n\\n`` to every chunk and its own ``data: [DONE]\\n\\n`` after inference_complete."""
    usage = CompletionUsage(prompt_tokens=21, completion_tokens=2)
    produced = [data_line(STREAM.role()), data_line(STREAM.content("4")),
                data_line(STREAM.finish(FinishReason.STOP, usage))]
    expected = [
        b'data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1777777777,"model":"' + MODEL.encode()
        + b'","choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}',
        b'data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1777777777,"model":"' + MODEL.encode()
        + b'","choices":[{"index":0,"delta":{"content":"4"},"finish_reason":null}]}',
        b'data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1777777777,"model":"' + MODEL.encode()
        + b'","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":21,"completion_tokens":2,"total_tokens":23}}',
    ]
    assert produced == expected
    # What the [A] coordinator then writes to the consumer is exactly OpenAI's stream shape.
    assert b"".join(line + b"\n\n" for line in produced) + b"data: [DONE]\n\n" == b"".join(
        event(obj) for obj in (STREAM.role(), STREAM.content("4"), STREAM.finish(FinishReason.STOP, usage))) + DONE


def test_http_stream_events_byte_for_byte():
    expected = [
        b'data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1777777777,"model":"' + MODEL.encode()
        + b'","choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}\n\n',
        b'data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1777777777,"model":"' + MODEL.encode()
        + b'","choices":[{"index":0,"delta":{"content":"4"},"finish_reason":null}]}\n\n',
        b'data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1777777777,"model":"' + MODEL.encode()
        + b'","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":21,"completion_tokens":2,"total_tokens":23}}\n\n',
        b"data: [DONE]\n\n",
    ]
    usage = CompletionUsage(prompt_tokens=21, completion_tokens=2)
    produced = [
        event(STREAM.role()),
        event(STREAM.content("4")),
        event(STREAM.finish(FinishReason.STOP, usage)),
        DONE,
    ]
    assert produced == expected


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200))
def test_any_content_is_exactly_one_event_and_round_trips(text):
    data = event(STREAM.content(text))
    payload = _payload(data)
    line = data_line(STREAM.content(text))
    assert data == line + b"\n\n" and b"\n" not in line  # JSON escapes newlines: one line, always
    assert payload["object"] == "chat.completion.chunk" and payload["model"] == MODEL
    assert payload["choices"][0]["delta"]["content"] == text
    assert ChatCompletionChunk.model_validate(payload) == STREAM.content(text)


def test_reasoning_and_tool_call_deltas():
    assert _payload(event(STREAM.reasoning("hmm")))["choices"][0]["delta"] == {"reasoning_content": "hmm"}
    call = ToolCallDelta(index=0, id="call_1", type="function", function=FunctionCallDelta(name="f", arguments="{"))
    payload = _payload(event(STREAM.chunk(Delta(tool_calls=[call]))))
    assert payload["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{"}}]
    }
    finish = _payload(event(STREAM.finish(FinishReason.TOOL_CALLS)))
    assert finish["choices"][0]["finish_reason"] == "tool_calls" and "usage" not in finish


def test_non_streaming_completion_is_one_event():
    completion = ChatCompletion(
        id="chatcmpl-1",
        created=1,
        model=MODEL,
        choices=[CompletionChoice(message=ChatMessage(content="4"), finish_reason=FinishReason.STOP)],
        usage=CompletionUsage(prompt_tokens=3, completion_tokens=1),
    )
    payload = _payload(event(completion))
    assert payload["object"] == "chat.completion"
    assert payload["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}]
    assert payload["usage"]["total_tokens"] == 4
    tool_only = ChatMessage(tool_calls=[ToolCall(id="c", function=FunctionCall(name="f", arguments="{}"))])
    assert tool_only.model_dump(mode="json")["content"] is None  # OpenAI: content null beside tool calls


def test_done_marker():
    assert DONE == b"data: [DONE]\n\n"


def test_usage_counts_are_ints():
    with pytest.raises(ValidationError):
        CompletionUsage(prompt_tokens=1.0, completion_tokens=2)
    assert CompletionUsage(prompt_tokens=1, completion_tokens=2, total_tokens=5).total_tokens == 5
