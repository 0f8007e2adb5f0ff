"""Engine events -> OpenAI `chat.completion.chunk` / `chat.completion` objects of `protocol.sse`, and
the legacy `text_completion` ones.

A thin adapter: a chat stream starts with a role-only delta, then one content chunk per
`TextDelta`, and ends with an empty delta carrying `finish_reason` and `usage`
(protocol.md §7.3). A legacy stream has one text chunk per `TextDelta`, an empty one carrying
`finish_reason`, then, as OpenAI sends it when asked, one usage chunk without choices.
`protocol.sse.event(obj)` frames each one as a single SSE event.

Both stream builders answer `start()` (what goes out before any text), `delta(text)` (the chunks for
a piece of text, maybe none) and `end(finished, include_usage)` (what ends a stream), so one server
loop writes either; the coordinator's job stream reads a chat stream's `for_event`.

With tools offered (`toolcalls.ToolCallStream`), a chat stream's text goes through the reader of
the model's calls first: content streams as content, each call as OpenAI streams one — a first chunk
with its `index`, `id`, `type` and `function.name` (arguments ``""``), then its `function.arguments`
— and an answer that made a call and stopped by itself finishes with ``tool_calls``. The whole
answer (`chat_completion`) reads the same calls: `message.tool_calls`, `content` null unless there
is text besides them. The legacy completions endpoint takes no tools.
"""

from __future__ import annotations

import time

from protocol import sse
from provider.engine.toolcalls import Piece, ToolCall, ToolCallStream
from provider.engine.types import Event, Finished, FinishReason, TextDelta, Usage

_FINISH = {FinishReason.STOP: sse.FinishReason.STOP, FinishReason.LENGTH: sse.FinishReason.LENGTH}


def completion_usage(usage: Usage) -> sse.CompletionUsage:
    return sse.CompletionUsage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                               total_tokens=usage.total_tokens)


def finish_reason(reason: FinishReason, tools: ToolCallStream | None) -> sse.FinishReason:
    """OpenAI's finish reason: ``tool_calls`` for an answer that called and stopped by itself."""
    if tools is not None and tools.calls and reason is FinishReason.STOP:
        return sse.FinishReason.TOOL_CALLS
    return _FINISH[reason]


class ChatChunks:
    """Builds the chunks of one streamed chat completion; `tools`: the reader of its tool calls."""

    __slots__ = ("_factory", "_tools")

    def __init__(self, completion_id: str, model: str, created: int | None = None,
                 tools: ToolCallStream | None = None):
        created = int(time.time()) if created is None else created
        self._factory = sse.ChunkFactory(id=completion_id, created=created, model=model)
        self._tools = tools

    def role(self) -> sse.ChatCompletionChunk:
        return self._factory.role()

    def start(self) -> list[sse.ChatCompletionChunk]:
        return [self._factory.role()]

    def delta(self, text: str) -> list[sse.ChatCompletionChunk]:
        """The chunks for a piece of text: none while it is held back inside a tool call."""
        if self._tools is None:
            return [self._factory.content(text)]
        return self._pieces(self._tools.feed(text))

    def end(self, finished: Finished, include_usage: bool) -> list[sse.ChatCompletionChunk]:
        """Anything held back (a call the end closed), then the chunk with `finish_reason`."""
        held = self._pieces(self._tools.finish()) if self._tools is not None else []
        usage = completion_usage(finished.usage) if include_usage else None
        return [*held, self._factory.finish(finish_reason(finished.reason, self._tools), usage)]

    def for_event(self, event: Event) -> list[sse.ChatCompletionChunk]:
        """The chunks for one engine event, the last one with usage; none for `Failed`, which
        becomes an error frame instead."""
        match event:
            case TextDelta(text):
                return self.delta(text)
            case Finished() as finished:
                return self.end(finished, include_usage=True)
        return []

    def _pieces(self, pieces: list[Piece]) -> list[sse.ChatCompletionChunk]:
        chunks = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                chunks += [self._factory.chunk(sse.Delta(tool_calls=(delta,))) for delta in call_deltas(piece)]
            else:
                chunks.append(self._factory.content(piece))
        return chunks


def call_deltas(call: ToolCall) -> tuple[sse.ToolCallDelta, sse.ToolCallDelta]:
    """A call as OpenAI streams it: index, id, type and name first (arguments empty), then the arguments."""
    return (sse.ToolCallDelta(index=call.index, id=call.id, type="function",
                              function=sse.FunctionCallDelta(name=call.name, arguments="")),
            sse.ToolCallDelta(index=call.index, function=sse.FunctionCallDelta(arguments=call.arguments)))


def chat_completion(completion_id: str, model: str, text: str, finished: Finished,
                    created: int | None = None, tools: ToolCallStream | None = None) -> sse.ChatCompletion:
    """The non-streaming `chat.completion` object for a finished request (`tools`: a fresh reader of
    its tool calls, when it offered tools)."""
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
        choices=(sse.CompletionChoice(message=message, finish_reason=finish_reason(finished.reason, tools)),),
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

    def delta(self, text: str) -> list[sse.TextCompletion]:
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
