"""Engine events -> OpenAI `chat.completion.chunk` / `chat.completion` objects of `protocol.sse`.

A thin adapter: a stream starts with a role-only delta, then one content chunk per
`TextDelta`, and ends with an empty delta carrying `finish_reason` and `usage`
(protocol.md §7.3). `protocol.sse.event(obj)` frames each one as a single SSE event.

Log-probabilities (issue 31 item 3): a `TextDelta`'s entries become its chunk's `choices[].logprobs`
(and, collected, the completion's), each token spelled by `token_bytes` (the model's vocabulary,
`provider.grammar.TokenTable.token_bytes`): `token` its text (a partial character as U+FFFD),
`bytes` its bytes, `top_logprobs` the alternatives, best first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from protocol import sse
from provider.engine.types import Event, Failed, Finished, FinishReason, TextDelta, TokenLogprob, Usage

TokenBytes = Callable[[int], bytes]
FLOOR_LOGPROB = -9999.0  # OpenAI's value for a probability too small to write

_FINISH = {FinishReason.STOP: sse.FinishReason.STOP, FinishReason.LENGTH: sse.FinishReason.LENGTH}


def completion_usage(usage: Usage) -> sse.CompletionUsage:
    return sse.CompletionUsage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                               total_tokens=usage.total_tokens)


def choice_logprobs(entries: Iterable[TokenLogprob], token_bytes: TokenBytes) -> sse.ChoiceLogprobs:
    """OpenAI's `choices[].logprobs` for these tokens."""
    def spelled(token: int) -> tuple[str, tuple[int, ...]]:
        raw = token_bytes(token)
        return raw.decode("utf-8", errors="replace"), tuple(raw)

    content = []
    for entry in entries:
        text, raw = spelled(entry.token)
        top = []
        for token, logprob in entry.top:
            alt_text, alt_raw = spelled(token)
            top.append(sse.TopLogprob(token=alt_text, logprob=max(FLOOR_LOGPROB, logprob), bytes=alt_raw))
        content.append(sse.LogprobEntry(token=text, logprob=max(FLOOR_LOGPROB, entry.logprob), bytes=raw,
                                        top_logprobs=tuple(top)))
    return sse.ChoiceLogprobs(content=tuple(content))


class ChatChunks:
    """Builds the chunks of one streamed chat completion. `token_bytes`: the request asked for
    log-probabilities (every content chunk then carries its tokens')."""

    __slots__ = ("_factory", "_token_bytes")

    def __init__(self, completion_id: str, model: str, created: int | None = None,
                 token_bytes: TokenBytes | None = None):
        created = int(time.time()) if created is None else created
        self._factory = sse.ChunkFactory(id=completion_id, created=created, model=model)
        self._token_bytes = token_bytes

    def role(self) -> sse.ChatCompletionChunk:
        return self._factory.role()

    def for_event(self, event: Event) -> sse.ChatCompletionChunk | None:
        """The chunk for one engine event; None for `Failed`, which becomes an error frame instead."""
        match event:
            case TextDelta(text, logprobs):
                if self._token_bytes is None:
                    return self._factory.content(text)
                return self._factory.content(text, choice_logprobs(logprobs, self._token_bytes))
            case Finished(reason, usage):
                return self._factory.finish(_FINISH[reason], completion_usage(usage))
            case Failed():
                return None


def chat_completion(completion_id: str, model: str, text: str, finished: Finished,
                    created: int | None = None, logprobs: sse.ChoiceLogprobs | None = None) -> sse.ChatCompletion:
    """The non-streaming `chat.completion` object for a finished request (`logprobs`: `choice_logprobs`
    of every delta's entries, for a request that asked)."""
    return sse.ChatCompletion(
        id=completion_id,
        created=int(time.time()) if created is None else created,
        model=model,
        choices=(sse.CompletionChoice(message=sse.ChatMessage(content=text), logprobs=logprobs,
                                      finish_reason=_FINISH[finished.reason]),),
        usage=completion_usage(finished.usage),
    )
