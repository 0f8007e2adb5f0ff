"""An OpenAI chat-completions request body -> the engine's `ChatRequest` inputs.

One parser for every front door (the local HTTP server here; the coordinator's decrypted job
bodies can use it too), so both read `max_tokens`, `stop`, `seed`... the same way. Unknown fields
are ignored, as OpenAI-compatible servers do. A bad body raises `InvalidBody` carrying only the
*name* of the offending field, never its value (it may be prompt text).

Content parts: `text` and `image_url` (`{"image_url": {"url": ...}}`). A message with only text
parts becomes one string (what a text model's template expects). A message with images keeps its
parts in order, each image as a bare `{"type": "image_url"}` marker; the URLs go to
`ChatBody.images` in order of appearance, for `provider.request.media` to check (bounds before
allocation) and decode. Whether the model can take images is admission's call, not the parser's.
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
    def _known_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for part in content:
                if _image_url(part) is None and _text(part) is None:
                    raise ValueError("only text and image_url content parts are supported")
        return content


def _text(part: Any) -> str | None:
    if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    return None


def _image_url(part: Any) -> str | None:
    if not isinstance(part, Mapping) or part.get("type") != "image_url":
        return None
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref  # some clients send the bare string
    return url if isinstance(url, str) and url else None


IMAGE_MARKER: Mapping[str, str] = {"type": "image_url"}  # an image's place in a message, payload removed


def _content(content: str | list[Any] | None, images: list[str]) -> str | tuple[Mapping[str, str], ...]:
    if not isinstance(content, list):
        return content or ""
    if all(_image_url(p) is None for p in content):
        return "".join(_text(p) or "" for p in content)
    parts: list[Mapping[str, str]] = []
    for part in content:
        url = _image_url(part)
        if url is not None:
            images.append(url)
            parts.append(IMAGE_MARKER)
        else:
            parts.append({"type": "text", "text": _text(part) or ""})
    return tuple(parts)


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
    images: tuple[str, ...] = ()  # image URLs in order of appearance (never logged)

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
    images: list[str] = []
    messages = tuple({"role": m.role, "content": _content(m.content, images)} for m in body.messages)
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
        images=tuple(images),
    )
