"""An OpenAI chat-completions (or legacy completions) request body -> the engine's `ChatRequest` inputs.

One parser for every front door (the local HTTP server and the coordinator's decrypted job bodies),
so both read `max_tokens`, `stop`, `seed`... the same way. A bad body raises `InvalidBody` carrying
the *name* of the offending parameter (`max_tokens`, `messages.0.role`) and the rule it breaks, in
fixed words (`must be an integer >= 1`), never its value (it may be prompt text).

Types are JSON's, strictly, as OpenAI checks them: `"stream": "yes"`, `"temperature": "0.5"`,
`"max_tokens": 5.0` or `true` for a number are 400s naming the parameter, never coerced. A parameter
this provider cannot honour (`n: 2`, `top_k`, a non-zero `presence_penalty`...) is a 400 naming it
too: `provider.request.params` holds that table, with the parameters accepted and ignored. Keys that
are in neither (another vendor's, the coordinator's own like `endpoint`) are accepted and kept by
name in `unknown_fields`, for the front doors' warning (`log_unknown_fields`); one that looks like a
misspelt parameter (`max_token`) is a 400 naming it and the parameter meant.

Messages: `role` is one of OpenAI's (system, developer, user, assistant, tool); `content` is required
(null counts as missing) except on an assistant message that carries `tool_calls`. Anything else is a
client error (400), never silently run as an empty message.

Tools: `tools` are OpenAI function tools (`{"type": "function", "function": {"name",
"description", "parameters"}}`), kept as sent for the chat template; `tool_choice` is `none`, `auto`
(the default when tools are given), `required` or `{"type": "function", "function": {"name": ...}}`
naming one of them; `parallel_tool_calls` a boolean (null: not sent). With `none` the tools are not
offered to the model at all (`offered_tools`): it must not call, and its output is not read for
calls. An assistant turn's `tool_calls` reach the template with each call's `arguments` as an object
(what templates render with `tojson`; a string that is not a JSON object stays as sent), a `tool` turn with its
`tool_call_id` (required, as OpenAI requires it). Whether the model can call tools at all is the
intake's question (`provider.request.intake`), not the parser's.

Output: `response_format` becomes the grammar the output must follow, checked here
(`response_format.py`: a schema the grammar engine cannot handle is an `InvalidBody` naming
`response_format`); `logprobs` / `top_logprobs` (0-20) become `ChatBody.top_logprobs`.

Content parts: `text` and `image_url` (`{"image_url": {"url": ...}}`). A message with only text
parts becomes one string (what a text model's template expects). A message with images keeps its
parts in order, each image as a bare `{"type": "image_url"}` marker; the URLs go to
`ChatBody.images` in order of appearance, for `provider.request.media` to check (bounds before
allocation) and decode. Whether the model can take images is admission's call, not the parser's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from provider.engine import SamplingParams, ToolCallConstraint
from provider.models.tools import ToolFormat
from provider.request.bounds import countable_chars
from provider.request.errors import InvalidBody
from provider.request.params import Endpoint, misspelt, unknown_names, unsupported
from provider.request.response_format import ResponseFormat, parse_response_format
from provider.telemetry import get_logger

log = get_logger("provider.request")


_TOOL_CHOICE_RULE = ('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}} '
                     "naming one of the tools")
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
    "tools": "must be an array of function tools",
    "tool_choice": _TOOL_CHOICE_RULE,
    "parallel_tool_calls": "must be a boolean",
    "prompt": "must be a string or an array of token ids (one prompt per request)",
    "response_format": "must be an object whose type is text, json_object or json_schema",
    "logprobs": "must be a boolean",
    "top_logprobs": "must be an integer from 0 to 20",
}
# Nested tool parameters, by their path of names (indexes left out).
_PATH_RULES: dict[tuple[str, ...], str] = {
    ("tools",): "must be an object",
    ("tools", "type"): 'must be "function"',
    ("tools", "function"): "must be an object",
    ("tools", "function", "name"): "must be 1 to 64 letters, digits, underscores or dashes",
    ("tools", "function", "description"): "must be a string",
    ("tools", "function", "parameters"): "must be a JSON Schema object",
    ("tools", "function", "strict"): "must be a boolean",
    ("messages", "tool_calls"): "must be an array of function tool calls",
    ("messages", "tool_calls", "id"): "must be a string",
    ("messages", "tool_calls", "type"): 'must be "function"',
    ("messages", "tool_calls", "function"): "must be an object",
    ("messages", "tool_calls", "function", "name"): "must be a non-empty string",
    ("messages", "tool_calls", "function", "arguments"): "must be a string of JSON",
    ("messages", "tool_call_id"): "must be a string",
    ("messages", "name"): "must be a string",
}
# Nested parameters, by their own name (messages.N.content), else by pydantic's error type.
_NESTED_RULES: dict[str, str] = {
    "role": "must be one of system, developer, user, assistant, tool",
    "content": "must be a string or an array of text and image_url parts",
    "include_usage": "must be a boolean",
    "type": "must be one of text, json_object, json_schema",
    "json_schema": "must be an object",
}
_UNKNOWN_KEY_RULES = {"stream_options": "takes only include_usage and include_obfuscation"}
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


class _FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"  # a JSON string (OpenAI); an object from some clients


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: _FunctionCall

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates render it: `arguments` an object where it is one."""
        arguments: Any = self.function.arguments
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except (ValueError, RecursionError):
                decoded = None
            arguments = decoded if isinstance(decoded, dict) else arguments
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[_ToolCall] | None = None  # declared before content: its validator reads it
    content: str | list[Any] | None = Field(None, validate_default=True)
    tool_call_id: str | None = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("tool_call_id")
    @classmethod
    def _tool_turns_name_their_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("role") == "tool":
            raise PydanticCustomError("missing", "tool_call_id is required")
        return value

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


def _message(m: _Message, images: list[str]) -> dict[str, Any]:
    """One message as the chat template gets it."""
    message: dict[str, Any] = {"role": m.role, "content": _content(m.content, images)}
    if m.tool_calls:
        message["tool_calls"] = [call.for_template() for call in m.tool_calls]
    if m.role == "tool":
        message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
    return message


class _Function(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, strict=True)


class _Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: _Function


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """`tool_choice`: `none`, `auto`, `required`, or `function` with the function's `name`."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None

    @property
    def forces_a_call(self) -> bool:
        """The output must be a call (`required`, or a named function): its grammar enforces it
        (`provider.request.output`)."""
        return self.mode in ("required", "function")


def _tool_choice(value: Any, tools: Sequence[_Tool]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto") or (value == "required" and tools):
        return ToolChoice(value)
    if isinstance(value, Mapping) and value.get("type") == "function" and isinstance(value.get("function"), Mapping):
        name = value["function"].get("name")
        if isinstance(name, str) and any(t.function.name == name for t in tools):
            return ToolChoice("function", name)
    raise InvalidBody("tool_choice", _TOOL_CHOICE_RULE)


class _StreamOptions(BaseModel):
    # A misspelt option is refused, as OpenAI does: `include_usge` would otherwise drop the usage chunk
    # without a word. include_obfuscation asks for padding only: accepted, ignored.
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    include_obfuscation: bool = True


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
    tools: list[_Tool] | None = None
    tool_choice: Any = None  # read by _tool_choice, which knows the tools
    parallel_tool_calls: bool | None = None  # null: not sent (true, OpenAI's default)
    # the output's grammar (read by response_format.py, whose errors name the part
    # at fault) and its log-probabilities (OpenAI: 0-20 alternatives).
    response_format: Any = None
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
    tools: tuple[Mapping[str, Any], ...] = ()  # function tools, as sent (never logged)
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    # None = plain text; the log-probabilities asked for (`top_logprobs` None
    # unless `logprobs`: then the alternatives per token, 0-20).
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    unknown_fields: tuple[str, ...] = ()  # top-level keys no table knows, accepted (names only, for the log)

    @property
    def offered_tools(self) -> tuple[Mapping[str, Any], ...]:
        """The tools the chat template renders and the output is read for: none with `tool_choice: none`."""
        return () if self.tool_choice.mode == "none" else self.tools

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, stop=self.stop)

    def tool_call(self, fmt: ToolFormat | None) -> ToolCallConstraint | None:
        """The call the output must be (`required`, or the named function), in the model's family's
        format `fmt`; None when the model may answer freely."""
        if fmt is None or not self.tool_choice.forces_a_call:
            return None
        functions = tuple(t["function"] for t in self.tools
                          if self.tool_choice.mode == "required" or t["function"]["name"] == self.tool_choice.name)
        return ToolCallConstraint(fmt.name, fmt.start, fmt.end, functions, self.parallel_tool_calls)


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
    unknown_fields: tuple[str, ...] = ()  # as ChatBody's

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=min(self.max_tokens, default_max_tokens), temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, stop=self.stop)


def _invalid(error: Mapping[str, Any]) -> InvalidBody:
    """The first validation error as a parameter path and a rule; the input is never read."""
    loc = [p for p in error["loc"] if isinstance(p, int) or p in _PATH_NAMES]  # drop union-member tags
    field = ".".join(str(p) for p in loc) or "body"
    if error["type"] == "missing":
        return InvalidBody(field, "is required")
    if error["type"] == "extra_forbidden":  # the key is the client's text: not repeated
        return InvalidBody(field, _UNKNOWN_KEY_RULES.get(field, "has a key this server does not know"))
    if len(loc) == 1 and field in _FIELD_RULES:
        return InvalidBody(field, _FIELD_RULES[field])
    names = tuple(str(p) for p in loc if not isinstance(p, int))
    if names in _PATH_RULES:
        return InvalidBody(field, _PATH_RULES[names])
    if loc and loc[-1] in _NESTED_RULES:
        return InvalidBody(field, _NESTED_RULES[str(loc[-1])])
    return InvalidBody(field, _TYPE_RULES.get(error["type"], "is not valid"))


# Every name a validation error's location can hold: our own field names (safe to show).
_PATH_NAMES = frozenset().union(*(m.model_fields for m in (_Body, _CompletionBody, _Message, _StreamOptions,
                                                             _ToolCall, _FunctionCall, _Tool,
                                                             _Function)))


def _validated(model: type[_Sampled], data: Any, endpoint: Endpoint) -> tuple[Any, tuple[str, ...]]:
    """The validated body and its unknown top-level keys."""
    if not isinstance(data, Mapping):
        raise InvalidBody("body", "must be a JSON object")
    refused = unsupported(data, endpoint)
    if refused is not None:
        raise InvalidBody(*refused)
    read = frozenset(model.model_fields)
    unknown = unknown_names(data, endpoint, read)
    for name in unknown:
        meant = misspelt(name, endpoint, read)
        if meant is not None:  # the name is within a letter or two of one of ours: safe to show
            raise InvalidBody(name, f"is not a parameter of this endpoint: did you mean '{meant}'?")
    try:
        return model.model_validate(data), unknown
    except ValidationError as exc:
        raise _invalid(exc.errors(include_url=False, include_input=False)[0]) from None


_PARAMETER_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_NAMED = 16  # unknown fields named in one warning


def log_unknown_fields(body: ChatBody | CompletionBody, **context: str) -> None:
    """The request log's warning for a body with top-level fields no table knows (accepted): their
    names, those spelled like a parameter name (`count`: all of them), never their values."""
    if body.unknown_fields:
        named = [n for n in body.unknown_fields if _PARAMETER_NAME.fullmatch(n)][:MAX_NAMED]
        log.warning("request_unknown_fields", kind=named, count=len(body.unknown_fields), **context)


MAX_STOPS = 4


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    stops: Sequence[str] = [stop] if isinstance(stop, str) else (stop or [])
    if any(not s for s in stops):
        raise InvalidBody("stop", _FIELD_RULES["stop"])
    if len(stops) > MAX_STOPS:  # OpenAI's limit, refused as OpenAI does rather than cut
        raise InvalidBody("stop", f"must have at most {MAX_STOPS} sequences")
    return tuple(stops)


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
    body, unknown = _validated(_CompletionBody, data, Endpoint.COMPLETIONS)
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
        unknown_fields=unknown,
    )


def parse_chat_body(data: Any) -> ChatBody:
    """Validate a decoded JSON body; `InvalidBody(field, rule)` on anything we cannot run."""
    body, unknown = _validated(_Body, data, Endpoint.CHAT)
    stop = _stop(body.stop)
    tools = body.tools or []
    if len({t.function.name for t in tools}) < len(tools):
        raise InvalidBody("tools", "must name each function once")
    tool_choice = _tool_choice(body.tool_choice, tools)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidBody("top_logprobs", "requires logprobs to be true")
    response_format = parse_response_format(body.response_format)
    images: list[str] = []
    messages = tuple(_message(m, images) for m in body.messages)
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
        tools=tuple(t.model_dump(exclude_unset=True) for t in tools),
        tool_choice=tool_choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=response_format,
        logprobs=bool(body.logprobs),
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        unknown_fields=unknown,
    )
