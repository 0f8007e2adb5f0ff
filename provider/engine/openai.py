"""Engine events -> OpenAI `chat.completion.chunk` / `chat.completion` objects of `protocol.sse`.

A thin adapter: a stream starts with a role-only delta, then one content chunk per
`TextDelta`, and ends with an empty delta carrying `finish_reason` and `usage`
(protocol.md §7.3). `protocol.sse.event(obj)` frames each one as a single SSE event.
"""

from __future__ import annotations

import time

from protocol import sse
from provider.engine.types import Event, Failed, Finished, FinishReason, TextDelta, Usage

_FINISH = {FinishReason.STOP: sse.FinishReason.STOP, FinishReason.LENGTH: sse.FinishReason.LENGTH}


def completion_usage(usage: Usage) -> sse.CompletionUsage:
    return sse.CompletionUsage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                               total_tokens=usage.total_tokens)


class ChatChunks:
    """Builds the chunks of one streamed chat completion."""

    __slots__ = ("_factory",)

    def __init__(self, completion_id: str, model: str, created: int | None = None):
        created = int(time.time()) if created is None else created
        self._factory = sse.ChunkFactory(id=completion_id, created=created, model=model)

    def role(self) -> sse.ChatCompletionChunk:
        return self._factory.role()

    def for_event(self, event: Event) -> sse.ChatCompletionChunk | None:
        """The chunk for one engine event; None for `Failed`, which becomes an error frame instead."""
        match event:
            case TextDelta(text):
                return self._factory.content(text)
            case Finished(reason, usage):
                return self._factory.finish(_FINISH[reason], completion_usage(usage))
            case Failed():
                return None


def chat_completion(completion_id: str, model: str, text: str, finished: Finished,
                    created: int | None = None) -> sse.ChatCompletion:
    """The non-streaming `chat.completion` object for a finished request."""
    return sse.ChatCompletion(
        id=completion_id,
        created=int(time.time()) if created is None else created,
        model=model,
        choices=(sse.CompletionChoice(message=sse.ChatMessage(content=text),
                                      finish_reason=_FINISH[finished.reason]),),
        usage=completion_usage(finished.usage),
    )
