"""OpenAI chat-completion objects and their Server-Sent-Events framing; the
legacy ``text_completion`` object too (``/v1/completions``: one shape for a whole answer and a chunk).

Two framings of the same objects (a ``ChatCompletionChunk`` streaming delta, or one ``ChatCompletion``):

* to the coordinator, ``data_line(obj)``: the plaintext of one ``inference_response_chunk`` is exactly one
  ``data: {json}`` line with no blank line after it, and no ``[DONE]`` chunk is ever sent. The [A]
  coordinator writes each chunk followed by ``\\n\\n`` and appends its own ``data: [DONE]\\n\\n`` after
  ``inference_complete``, so its consumer receives exactly OpenAI's stream. It parses one JSON object per
  chunk, so events are never batched.
* to an HTTP client directly (the local server), ``event(obj)`` = ``data: {json}\\n\\n`` per event and
  one ``DONE`` at the end: OpenAI's own stream shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import model_validator

from protocol._wire import NULLABLE, OMIT_EMPTY, Float, Int64, Str, WireModel

__all__ = [
    "DONE",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatMessage",
    "ChoiceLogprobs",
    "ChunkChoice",
    "ChunkFactory",
    "CompletionChoice",
    "CompletionUsage",
    "Delta",
    "FinishReason",
    "FunctionCall",
    "FunctionCallDelta",
    "LogprobEntry",
    "TextChoice",
    "TextCompletion",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "data_line",
    "event",
]

DONE = b"data: [DONE]\n\n"
"""The end of an HTTP event stream. Never sent to the coordinator: it adds its own."""


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CONTENT_FILTER = "content_filter"


class CompletionUsage(WireModel):
    """``total_tokens`` defaults to prompt + completion."""

    prompt_tokens: Int64
    completion_tokens: Int64
    total_tokens: Int64

    @model_validator(mode="before")
    @classmethod
    def _default_total(cls, data: Any) -> Any:
        if isinstance(data, dict) and "total_tokens" not in data:
            prompt, completion = data.get("prompt_tokens"), data.get("completion_tokens")
            if type(prompt) is int and type(completion) is int:
                return {**data, "total_tokens": prompt + completion}
        return data


class FunctionCallDelta(WireModel):
    name: Str | None = None
    arguments: Str | None = None


class ToolCallDelta(WireModel):
    index: Int64
    id: Str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class Delta(WireModel):
    """What one chunk adds. ``None`` fields are left out; ``{}`` is the empty final delta."""

    role: Literal["assistant"] | None = None
    content: Str | None = None
    reasoning_content: Str | None = None
    tool_calls: Annotated[tuple[ToolCallDelta, ...], OMIT_EMPTY] = ()


class TopLogprob(WireModel):
    """One alternative token: its text, log-probability and UTF-8 bytes (a token may hold part of a character)."""

    token: Str
    logprob: Float
    bytes: tuple[Int64, ...]


class LogprobEntry(WireModel):
    """One output token's log-probability, with its `top_logprobs` alternatives (best first)."""

    token: Str
    logprob: Float
    bytes: tuple[Int64, ...]
    top_logprobs: tuple[TopLogprob, ...] = ()


class ChoiceLogprobs(WireModel):
    """``choices[].logprobs``: one entry per output token of the chunk (or of the whole completion)."""

    content: tuple[LogprobEntry, ...] = ()


class ChunkChoice(WireModel):
    index: Int64 = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None  # left out unless the request asked for them
    finish_reason: Annotated[FinishReason | None, NULLABLE] = None


class ChatCompletionChunk(WireModel):
    id: Str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: Int64
    model: Str
    choices: tuple[ChunkChoice, ...]
    usage: CompletionUsage | None = None


class FunctionCall(WireModel):
    name: Str
    arguments: Str


class ToolCall(WireModel):
    id: Str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(WireModel):
    role: Literal["assistant"] = "assistant"
    content: Annotated[Str | None, NULLABLE] = None
    reasoning_content: Str | None = None
    tool_calls: Annotated[tuple[ToolCall, ...], OMIT_EMPTY] = ()


class CompletionChoice(WireModel):
    index: Int64 = 0
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None  # left out unless the request asked for them
    finish_reason: Annotated[FinishReason | None, NULLABLE] = None


class ChatCompletion(WireModel):
    id: Str
    object: Literal["chat.completion"] = "chat.completion"
    created: Int64
    model: Str
    choices: tuple[CompletionChoice, ...]
    usage: CompletionUsage | None = None


class TextChoice(WireModel):
    text: Str
    index: Int64 = 0
    logprobs: Annotated[None, NULLABLE] = None  # logprobs are not offered on /v1/completions
    finish_reason: Annotated[FinishReason | None, NULLABLE] = None


class TextCompletion(WireModel):
    """A legacy completion, whole or one streamed chunk (OpenAI uses the one object for both); the
    usage-only chunk that ends a stream asked for with ``include_usage`` has no choices."""

    id: Str
    object: Literal["text_completion"] = "text_completion"
    created: Int64
    model: Str
    choices: tuple[TextChoice, ...]
    usage: CompletionUsage | None = None


def data_line(obj: ChatCompletionChunk | ChatCompletion | TextCompletion) -> bytes:
    """One coordinator-bound chunk's plaintext: ``data: {compact json}``, one line (JSON escapes every
    newline), no blank line after it."""
    return b"data: " + obj.__pydantic_serializer__.to_json(obj, warnings="error")


def event(obj: ChatCompletionChunk | ChatCompletion | TextCompletion) -> bytes:
    """Exactly one SSE event of an HTTP stream: ``data: {compact json}\\n\\n``."""
    return data_line(obj) + b"\n\n"


@dataclass(frozen=True, slots=True)
class ChunkFactory:
    """Chunks of one streamed completion: same ``id``, ``created`` and ``model`` on every one."""

    id: str
    created: int
    model: str

    def chunk(
        self,
        delta: Delta,
        finish_reason: FinishReason | None = None,
        usage: CompletionUsage | None = None,
        logprobs: ChoiceLogprobs | None = None,
    ) -> ChatCompletionChunk:
        choice = ChunkChoice(delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=(choice,), usage=usage)

    def role(self) -> ChatCompletionChunk:
        return self.chunk(Delta(role="assistant"))

    def content(self, text: str, logprobs: ChoiceLogprobs | None = None) -> ChatCompletionChunk:
        return self.chunk(Delta(content=text), logprobs=logprobs)

    def reasoning(self, text: str) -> ChatCompletionChunk:
        return self.chunk(Delta(reasoning_content=text))

    def finish(self, reason: FinishReason, usage: CompletionUsage | None = None) -> ChatCompletionChunk:
        return self.chunk(Delta(), finish_reason=reason, usage=usage)
