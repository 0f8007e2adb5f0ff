"""Engine events -> OpenAI `chat.completion.chunk` / `chat.completion` objects of `protocol.sse`, and
the legacy `text_completion` ones.

A thin adapter: a chat stream starts with a role-only delta, then one content chunk per
`TextDelta`, and ends with an empty delta carrying `finish_reason` and `usage` (the coordinator
reads the usage there). A legacy stream has one text chunk per `TextDelta`, an empty one carrying
`finish_reason`, then, as OpenAI sends it when asked, one usage chunk without choices.
`protocol.sse.event(obj)` frames each one as a single SSE event.

Both stream builders answer `start()` (what goes out before any text), `delta(text, logprobs)` (the chunks for
a piece of text, maybe none) and `end(finished, include_usage)` (what ends a stream), so one server
loop writes either; the coordinator's job stream reads a chat stream's `for_event`.

With tools offered (`toolcalls.ToolCallStream`), a chat stream's text goes through the reader of
the model's calls first: content streams as content, each call as OpenAI streams one — a first chunk
with its `index`, `id`, `type` and `function.name` (arguments ``""``), then its `function.arguments`
— and an answer that made a call and stopped by itself finishes with ``tool_calls``. The whole
answer (`chat_completion`) reads the same calls: `message.tool_calls`, `content` null unless there
is text besides them. The legacy completions endpoint takes no tools.

Log-probabilities: a `TextDelta`'s entries become its chunk's `choices[].logprobs`
(and, collected, the completion's), each token spelled by `token_bytes` (the model's vocabulary,
`provider.grammar.TokenTable.token_bytes`): `token` its text (a partial character as U+FFFD),
`bytes` its bytes, `top_logprobs` the alternatives, best first. Text held back inside a tool call
keeps its tokens' entries for the next chunk that goes out (a call's, or the finish chunk).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from protocol import sse
from provider.engine.types import (
    Event,
    Finished,
    FinishReason,
    TextDelta,
    TokenLogprob,
    Usage,
)
from provider.response.toolcalls import Piece, ToolCall, ToolCallStream

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


def finish_reason(reason: FinishReason, tools: ToolCallStream | None) -> sse.FinishReason:
    """OpenAI's finish reason: ``tool_calls`` for an answer that called and stopped by itself."""
    if tools is not None and tools.calls and reason is FinishReason.STOP:
        return sse.FinishReason.TOOL_CALLS
    return _FINISH[reason]


class ChatChunks:
    """Builds the chunks of one streamed chat completion; `tools`: the reader of its tool calls;
    `token_bytes`: the request asked for log-probabilities (each chunk then carries its tokens')."""

    __slots__ = ("_factory", "_held", "_token_bytes", "_tools")

    def __init__(self, completion_id: str, model: str, created: int | None = None,
                 tools: ToolCallStream | None = None, token_bytes: TokenBytes | None = None):
        created = int(time.time()) if created is None else created
        self._factory = sse.ChunkFactory(id=completion_id, created=created, model=model)
        self._tools = tools
        self._token_bytes = token_bytes
        self._held: list[TokenLogprob] = []  # entries of text held back inside a tool call

    def role(self) -> sse.ChatCompletionChunk:
        return self._factory.role()

    def start(self) -> list[sse.ChatCompletionChunk]:
        return [self._factory.role()]

    def delta(self, text: str, logprobs: Iterable[TokenLogprob] = ()) -> list[sse.ChatCompletionChunk]:
        """The chunks for a piece of text (and its tokens' `logprobs`): none while it is held back
        inside a tool call."""
        if self._tools is None:
            return [self._factory.content(text, self._logprobs(logprobs))]
        if self._token_bytes is not None:
            self._held.extend(logprobs)
        return self._pieces(self._tools.feed(text))

    def end(self, finished: Finished, include_usage: bool) -> list[sse.ChatCompletionChunk]:
        """Anything held back (a call the end closed), then the chunk with `finish_reason` (and the
        entries of text no chunk carried)."""
        held = self._pieces(self._tools.finish()) if self._tools is not None else []
        usage = completion_usage(finished.usage) if include_usage else None
        logprobs = self._logprobs() if self._held else None
        return [*held, self._factory.chunk(sse.Delta(), finish_reason(finished.reason, self._tools), usage, logprobs)]

    def for_event(self, event: Event) -> list[sse.ChatCompletionChunk]:
        """The chunks for one engine event, the last one with usage; none for `Failed`, which
        becomes an error frame instead."""
        match event:
            case TextDelta(text, logprobs):
                return self.delta(text, logprobs)
            case Finished() as finished:
                return self.end(finished, include_usage=True)
        return []

    def _logprobs(self, entries: Iterable[TokenLogprob] = ()) -> sse.ChoiceLogprobs | None:
        """The entries held back and `entries`, for the next chunk out (None: not asked)."""
        if self._token_bytes is None:
            return None
        spelled = choice_logprobs([*self._held, *entries], self._token_bytes)
        self._held.clear()
        return spelled

    def _pieces(self, pieces: list[Piece]) -> list[sse.ChatCompletionChunk]:
        chunks = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                chunks += [self._factory.chunk(sse.Delta(tool_calls=(delta,))) for delta in call_deltas(piece)]
            else:
                chunks.append(self._factory.content(piece))
        if chunks and self._token_bytes is not None and self._held:
            first = chunks[0]
            chunks[0] = first.model_copy(update={"choices": (
                first.choices[0].model_copy(update={"logprobs": self._logprobs()}),)})
        return chunks


def call_deltas(call: ToolCall) -> tuple[sse.ToolCallDelta, sse.ToolCallDelta]:
    """A call as OpenAI streams it: index, id, type and name first (arguments empty), then the arguments."""
    return (sse.ToolCallDelta(index=call.index, id=call.id, type="function",
                              function=sse.FunctionCallDelta(name=call.name, arguments="")),
            sse.ToolCallDelta(index=call.index, function=sse.FunctionCallDelta(arguments=call.arguments)))


def chat_completion(completion_id: str, model: str, text: str, finished: Finished,
                    created: int | None = None, tools: ToolCallStream | None = None,
                    logprobs: sse.ChoiceLogprobs | None = None) -> sse.ChatCompletion:
    """The non-streaming `chat.completion` object for a finished request (`tools`: a fresh reader of
    its tool calls, when it offered tools; `logprobs`: `choice_logprobs` of every delta's entries, for
    a request that asked)."""
    calls: list[ToolCall] = []
    if tools is not None:
        pieces = [*tools.feed(text), *tools.finish()]
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        text = "".join(p for p in pieces if isinstance(p, str))
    message = sse.ChatMessage(content=text if text or not calls else None, tool_calls=tuple(
        sse.ToolCall(id=c.id, function=sse.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls))
    return sse.ChatCompletion(
        id=completion_id,
        created=int(time.time()) if created is None else created,
        model=model,
        choices=(sse.CompletionChoice(message=message, logprobs=logprobs,
                                      finish_reason=finish_reason(finished.reason, tools)),),
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

    def delta(self, text: str, logprobs: Iterable[TokenLogprob] = ()) -> list[sse.TextCompletion]:
        return [self._chunk((sse.TextChoice(text=text),))]

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
