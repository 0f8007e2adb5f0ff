"""Engine events -> OpenAI `chat.completion.chunk` / `chat.completion` objects (plain dicts).

A thin adapter: the stream starts with a role-only delta, then one chunk per `TextDelta`, and
ends with an empty delta carrying `finish_reason` and `usage` (protocol.md §7.3). SSE framing
(`data: …\\n\\n`, `[DONE]`) belongs to `protocol/sse`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from provider.engine.types import Event, Failed, Finished, TextDelta, Usage


def usage_dict(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


@dataclass(slots=True)
class ChatChunks:
    """Builds the chunks of one streamed chat completion."""

    completion_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, delta: dict, finish_reason: str | None, usage: Usage | None = None) -> dict:
        chunk = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
        if usage is not None:
            chunk["usage"] = usage_dict(usage)
        return chunk

    def role(self) -> dict:
        return self._chunk({"role": "assistant"}, None)

    def for_event(self, event: Event) -> dict | None:
        """The chunk for one engine event; None for `Failed`, which becomes an error frame."""
        match event:
            case TextDelta(text):
                return self._chunk({"content": text}, None)
            case Finished(reason, usage):
                return self._chunk({}, reason.value, usage)
            case Failed():
                return None


def chat_completion(completion_id: str, model: str, text: str, finished: Finished,
                    created: int | None = None) -> dict:
    """The non-streaming `chat.completion` object for a finished request."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finished.reason.value,
        }],
        "usage": usage_dict(finished.usage),
    }
