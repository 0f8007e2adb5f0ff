"""An OpenAI chat-completions request body -> the engine's `ChatRequest` inputs.

One parser for every front door (the local HTTP server here; the coordinator's decrypted job
bodies can use it too), so both read `max_tokens`, `stop`, `seed`... the same way. Unknown fields
are ignored, as OpenAI-compatible servers do. A bad body raises `InvalidBody` carrying only the
*name* of the offending field, never its value (it may be prompt text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from provider.engine import SamplingParams


class InvalidBody(ValueError):
    """The body is not a chat-completions request we can run. ``field`` is safe to show."""

    def __init__(self, field: str) -> None:
        super().__init__(field)
        self.field = field


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[Any] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Multi-part content: only text parts are understood by a text model.
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                texts.append(part["text"])
            return "".join(texts)
        return content


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    messages: list[_Message] = Field(min_length=1)
    stream: bool = False
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request


@dataclass(frozen=True, slots=True)
class ChatBody:
    model: str
    messages: tuple[Mapping[str, object], ...]
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: the request did not set it (the model's default applies)
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, stop=self.stop)


def parse_chat_body(data: Any) -> ChatBody:
    """Validate a decoded JSON body; `InvalidBody(field)` on anything we cannot run."""
    if not isinstance(data, Mapping):
        raise InvalidBody("body")
    try:
        body = _Body.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        raise InvalidBody(".".join(str(p) for p in first["loc"]) or "body") from None
    stop: Sequence[str] = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if any(not s for s in stop):
        raise InvalidBody("stop")
    messages = tuple(
        {"role": m.role, "content": m.content or ""} for m in body.messages
    )
    return ChatBody(
        model=body.model,
        messages=messages,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        max_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=tuple(stop[:4]),
    )
