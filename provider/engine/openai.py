"""Engine events -> OpenAI `chat.completion.chunk` / `chat.completion` objects of `protocol.sse`.

A thin adapter: a stream starts with a role-only delta, then one content chunk per
`TextDelta`, and ends with an empty delta carrying `finish_reason` and `usage`
(protocol.md §7.3). `protocol.sse.event(obj)` frames each one as a single SSE event.

With tools offered (`toolcalls.ToolCallStream`), the text goes through the reader of the model's
calls first: content streams as content, each call as OpenAI streams one — a first chunk with its
`index`, `id`, `type` and `function.name` (arguments ``""``), then its `function.arguments` — and an
answer that made a call and stopped by itself finishes with ``tool_calls``. The whole answer
(`chat_completion`) reads the same calls: `message.tool_calls`, `content` null unless there is
text besides them.
"""

from __future__ import annotations

import time

from protocol import sse
from provider.engine.toolcalls import Piece, ToolCall, ToolCallStream
from provider.engine.types import Event, Failed, Finished, FinishReason, TextDelta, Usage

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

    def for_event(self, event: Event) -> list[sse.ChatCompletionChunk]:
        """The chunks for one engine event (none for text held back inside a call); none for
        `Failed`, which becomes an error frame instead."""
        match event:
            case TextDelta(text):
                if self._tools is None:
                    return [self._factory.content(text)]
                return self._pieces(self._tools.feed(text))
            case Finished(reason, usage):
                held = self._pieces(self._tools.finish()) if self._tools is not None else []
                return [*held, self._factory.finish(finish_reason(reason, self._tools), completion_usage(usage))]
            case Failed():
                return []
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
