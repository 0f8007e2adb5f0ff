"""What an OpenAI consumer must receive from a streaming chat completion, byte for byte."""

from __future__ import annotations

from protocol import sse
from protocol.sse import ChatCompletionChunk


def openai_stream_bytes(raw: bytes) -> bytes:
    """``raw`` rebuilt the way OpenAI frames a chat stream: each event's object as ``data: {json}\\n\\n``, then
    one ``data: [DONE]\\n\\n``. Equal to ``raw`` only if ``raw`` has exactly that shape."""
    events = raw.split(b"\n\n")
    assert events[-1] == b"", "the stream must end with a blank line"
    body = [sse.event(ChatCompletionChunk.model_validate_json(e.removeprefix(b"data: "))) for e in events[:-2]]
    return b"".join(body) + sse.DONE


def assert_openai_stream(raw: bytes) -> None:
    """One ``[DONE]`` at the very end, one blank line after every event, every event one JSON chunk."""
    assert raw.count(b"data: [DONE]") == 1 and raw.endswith(b"\n\ndata: [DONE]\n\n")
    assert b"\n\n\n" not in raw
    assert raw == openai_stream_bytes(raw)
