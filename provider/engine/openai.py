"""Engine events -> OpenAI `chat.completion.chunk` / `chat.completion` objects of `protocol.sse`, and
the legacy `text_completion` ones.

A thin adapter: a chat stream starts with a role-only delta, then one content chunk per
`TextDelta`, and ends with an empty delta carrying `finish_reason` and `usage`
(protocol.md §7.3). A legacy stream has one text chunk per `TextDelta`, an empty one carrying
`finish_reason`, then, as OpenAI sends it when asked, one usage chunk without choices.
`protocol.sse.event(obj)` frames each one as a single SSE event.

Both stream builders answer `start()` (what goes out before any text), `delta(text)` and
`end(finished, include_usage)` (what ends a stream), so one server loop writes either.
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

    def start(self) -> list[sse.ChatCompletionChunk]:
        return [self._factory.role()]

    def delta(self, text: str) -> sse.ChatCompletionChunk:
        return self._factory.content(text)

    def end(self, finished: Finished, include_usage: bool) -> list[sse.ChatCompletionChunk]:
        usage = completion_usage(finished.usage) if include_usage else None
        return [self._factory.finish(_FINISH[finished.reason], usage)]

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


class TextChunks:
    """Builds the chunks of one streamed legacy completion (`text_completion` objects)."""

    __slots__ = ("_created", "_id", "_model")

    def __init__(self, completion_id: str, model: str, created: int | None = None):
        self._id, self._model = completion_id, model
        self._created = int(time.time()) if created is None else created

    def _chunk(self, choices: tuple[sse.TextChoice, ...], usage: sse.CompletionUsage | None = None) -> sse.TextCompletion:
        return sse.TextCompletion(id=self._id, created=self._created, model=self._model, choices=choices, usage=usage)

    def start(self) -> list[sse.TextCompletion]:
        return []  # no role here: the first chunk carries text

    def delta(self, text: str) -> sse.TextCompletion:
        return self._chunk((sse.TextChoice(text=text),))

    def end(self, finished: Finished, include_usage: bool) -> list[sse.TextCompletion]:
        chunks = [self._chunk((sse.TextChoice(text="", finish_reason=_FINISH[finished.reason]),))]
        if include_usage:
            chunks.append(self._chunk((), completion_usage(finished.usage)))
        return chunks


def text_completion(completion_id: str, model: str, text: str, finished: Finished,
                    created: int | None = None) -> sse.TextCompletion:
    """The non-streaming `text_completion` object for a finished legacy request."""
    return sse.TextCompletion(
        id=completion_id,
        created=int(time.time()) if created is None else created,
        model=model,
        choices=(sse.TextChoice(text=text, finish_reason=_FINISH[finished.reason]),),
        usage=completion_usage(finished.usage),
    )
