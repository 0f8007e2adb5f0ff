"""An OpenAI chat-completions (or legacy completions) request body -> the engine's `ChatRequest` inputs.

One parser for every front door (the local HTTP server and the coordinator's decrypted job bodies),
so both read `max_tokens`, `stop`, `seed`... the same way. A bad body raises `InvalidBody` carrying
the *name* of the offending parameter (`max_tokens`, `messages.0.role`) and the rule it breaks, in
fixed words (`must be an integer >= 1`), never its value (it may be prompt text).

Types are JSON's, strictly, as OpenAI checks them: `"stream": "yes"`, `"temperature": "0.5"`,
`"max_tokens": 5.0` or `true` for a number are 400s naming the parameter, never coerced. A parameter
this provider cannot honour (`n: 2`, `top_k`, a non-zero `presence_penalty`...) is a 400 naming it
too: `provider.request.params` holds that table, with the parameters accepted and ignored. Keys that
are in neither (the coordinator's own, like `endpoint`) are ignored.

Messages: `role` is one of OpenAI's (system, developer, user, assistant, tool); `content` is required
(null counts as missing) except on an assistant message that carries `tool_calls`. Anything else is a
client error (400), never silently run as an empty message.

Content parts: `text` and `image_url` (`{"image_url": {"url": ...}}`). A message with only text
parts becomes one string (what a text model's template expects). A message with images keeps its
parts in order, each image as a bare `{"type": "image_url"}` marker; the URLs go to
`ChatBody.images` in order of appearance, for `provider.request.media` to check (bounds before
allocation) and decode. Whether the model can take images is admission's call, not the parser's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from provider.engine import SamplingParams
from provider.request.bounds import countable_chars
from provider.request.params import Endpoint, unsupported


class InvalidBody(ValueError):
    """The body is not a chat-completions request we can run. ``field`` (the parameter's path) and
    ``rule`` (fixed text) are safe to show; the value is never kept."""

    def __init__(self, field: str, rule: str = "is not valid") -> None:
        super().__init__(field)
        self.field = field
        self.rule = rule

    @property
    def message(self) -> str:
        """What a client is told: the parameter and the rule, e.g. ``'max_tokens' must be an integer >= 1``."""
        if self.field == "body":
            return f"The request body {self.rule}."
        return f"Invalid parameter '{self.field}': {self.rule}."


# The whole rule of each top-level parameter, so the message says what is allowed, not only what broke.
_FIELD_RULES: dict[str, str] = {
    "model": "must be a non-empty string",
    "messages": "must be a non-empty array of messages",
    "stream": "must be a boolean",
    "stream_options": "must be an object",
    "max_tokens": "must be an integer >= 1",
    "max_completion_tokens": "must be an integer >= 1",
    "temperature": "must be a number between 0 and 2",
    "top_p": "must be a number greater than 0 and at most 1",
    "seed": "must be an integer",
    "stop": "must be a non-empty string or an array of non-empty strings",
    "prompt": "must be a string or an array of token ids (one prompt per request)",
    "tools": "must be an array of tool objects",
    "tool_choice": "must be none, auto, required or an object naming a function",
    "parallel_tool_calls": "must be a boolean",
    "response_format": "must be an object whose type is text, json_object or json_schema",
    "logprobs": "must be a boolean",
    "top_logprobs": "must be an integer from 0 to 20",
}
# Nested parameters, by their own name (messages.N.content), else by pydantic's error type.
_NESTED_RULES: dict[str, str] = {
    "role": "must be one of system, developer, user, assistant, tool",
    "content": "must be a string or an array of text and image_url parts",
    "include_usage": "must be a boolean",
    "type": "must be one of text, json_object, json_schema",
    "json_schema": "must be an object",
}
_TYPE_RULES: dict[str, str] = {
    "missing": "is required",
    "string_type": "must be a string",
    "string_too_short": "must not be empty",
    "bool_type": "must be a boolean",
    "bool_parsing": "must be a boolean",
    "model_type": "must be an object",
    "dict_type": "must be an object",
    "list_type": "must be an array",
}


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[Any] | None = None  # declared before content: its validator reads it
    content: str | list[Any] | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _known_parts_only(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None:
            if info.data.get("role") == "assistant" and info.data.get("tool_calls"):
                return content  # an assistant turn that only called tools
            raise PydanticCustomError("missing", "content is required")
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
    model_config = ConfigDict(extra="ignore", strict=True)  # include_obfuscation: padding only, ignored

    include_usage: bool = False


class _ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Sampled(BaseModel):
    """What both endpoints share: the model, streaming and sampling. Strict: JSON types, no coercion."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None


class _Body(_Sampled):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # Issue 31 items 1-3 (tools, constrained decoding, logprobs) are built on other branches: these are
    # type-checked here and carried on ChatBody for them; nothing reads them yet.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: _ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class _CompletionBody(_Sampled):
    prompt: Any = None  # str or token ids: `_prompt` reads it (a union's errors would not name one rule)


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
    chars: int = 0  # message text every template keeps (bounds.countable_chars): the size bound reads it
    # Parsed for issue 31 items 1-3 and not yet honoured (see _Body); None / False / () = not sent.
    tools: tuple[Mapping[str, Any], ...] = ()
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: Mapping[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, stop=self.stop)


COMPLETION_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


@dataclass(frozen=True, slots=True)
class CompletionBody:
    """A legacy `/v1/completions` body: one prompt, as text (tokenized without any chat template) or ids."""

    model: str
    prompt: str | tuple[int, ...]
    stream: bool
    include_usage: bool
    max_tokens: int  # OpenAI's default (16) when the request did not set it
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=min(self.max_tokens, default_max_tokens), temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, stop=self.stop)


def _invalid(error: Mapping[str, Any]) -> InvalidBody:
    """The first validation error as a parameter path and a rule; the input is never read."""
    loc = [p for p in error["loc"] if isinstance(p, int) or p in _PATH_NAMES]  # drop union-member tags
    field = ".".join(str(p) for p in loc) or "body"
    if error["type"] == "missing":
        return InvalidBody(field, "is required")
    if len(loc) == 1 and field in _FIELD_RULES:
        return InvalidBody(field, _FIELD_RULES[field])
    if loc and loc[-1] in _NESTED_RULES:
        return InvalidBody(field, _NESTED_RULES[str(loc[-1])])
    return InvalidBody(field, _TYPE_RULES.get(error["type"], "is not valid"))


# Every name a validation error's location can hold: our own field names (safe to show).
_PATH_NAMES = (frozenset(_Body.model_fields) | frozenset(_CompletionBody.model_fields) | frozenset(_Message.model_fields)
               | frozenset(_StreamOptions.model_fields) | frozenset(_ResponseFormat.model_fields))


def _validated(model: type[_Sampled], data: Any, endpoint: Endpoint) -> Any:
    if not isinstance(data, Mapping):
        raise InvalidBody("body", "must be a JSON object")
    refused = unsupported(data, endpoint)
    if refused is not None:
        raise InvalidBody(*refused)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc.errors(include_url=False, include_input=False)[0]) from None


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    stops: Sequence[str] = [stop] if isinstance(stop, str) else (stop or [])
    if any(not s for s in stops):
        raise InvalidBody("stop", _FIELD_RULES["stop"])
    return tuple(stops[:4])


def _ids(value: list[Any]) -> tuple[int, ...] | None:
    if value and all(type(i) is int for i in value):
        if any(i < 0 for i in value):
            raise InvalidBody("prompt", "token ids must be integers >= 0")
        return tuple(value)
    return None


def _prompt(prompt: Any) -> str | tuple[int, ...]:
    """One prompt: a string, an array of token ids, or an array holding one of these (OpenAI's batch
    form, which this provider answers only for a batch of one)."""
    if prompt is None:
        raise InvalidBody("prompt", "is required")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        ids = _ids(prompt)
        if ids is not None:
            return ids
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            if len(prompt) > 1:
                raise InvalidBody("prompt", "must be one prompt: arrays of several prompts are not supported")
            one = prompt[0]
            if isinstance(one, str):
                return one
            ids = _ids(one)
            if ids is not None:
                return ids
    raise InvalidBody("prompt", _FIELD_RULES["prompt"])


def parse_completion_body(data: Any) -> CompletionBody:
    """Validate a decoded legacy completions body; `InvalidBody(field, rule)` on anything we cannot run."""
    body = _validated(_CompletionBody, data, Endpoint.COMPLETIONS)
    return CompletionBody(
        model=body.model,
        prompt=_prompt(body.prompt),
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        max_tokens=body.max_tokens or COMPLETION_MAX_TOKENS,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=_stop(body.stop),
    )


def parse_chat_body(data: Any) -> ChatBody:
    """Validate a decoded JSON body; `InvalidBody(field, rule)` on anything we cannot run."""
    body = _validated(_Body, data, Endpoint.CHAT)
    stop = _stop(body.stop)
    images: list[str] = []
    messages = tuple({"role": m.role, "content": _content(m.content, images)} for m in body.messages)
    chars = countable_chars(messages)
    return ChatBody(
        model=body.model,
        messages=messages,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        max_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=stop,
        images=tuple(images),
        chars=chars,
        tools=tuple(body.tools or ()),
        tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=body.response_format.model_dump(exclude_none=True) if body.response_format else None,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs,
    )
