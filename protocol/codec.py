"""``decode`` (one text frame in, one typed message out) and ``encode`` (one message out, compact JSON).

Decoding never raises anything but ``ProtocolError`` and never returns a raw dict: unknown types become
``UnknownMessage``. When an ``inference_request`` does not decode (a field of the wrong type, a value
that is not JSON), ``readable_request_id`` still reads its id, so the request can be answered. Encoding is strict: a value that does not fit its field's type (a float in an int field,
however it got there) raises ``EncodeError`` instead of reaching the wire.
"""

from __future__ import annotations

import json
from json.decoder import scanstring

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from protocol._wire import RawJSON, WireModel
from protocol.messages import PROVIDER_FRAMES, Message, TaggedMessage, UnknownMessage
from protocol.to_provider import answerable_request_id

MAX_INBOUND_FRAME_BYTES = 32 * 1024 * 1024
"""Largest coordinator frame we accept ([N] seals bodies up to 16 MiB ≈ 21.3 MiB of base64; Swift: 32 MiB).
The WebSocket client's ``max_size`` must be at least this."""

MAX_OUTBOUND_FRAME_BYTES = 10 * 1024 * 1024
"""The coordinator's read limit: a larger frame makes it close the socket (1009)."""

_OUTBOUND_TYPES = frozenset(PROVIDER_FRAMES)
_ADAPTER: TypeAdapter[Message] = TypeAdapter(TaggedMessage)
_DECODER = json.JSONDecoder()


class ProtocolError(ValueError):
    """A frame from the peer could not be decoded. The text names the problem, never the frame's content."""


class EncodeError(ValueError):
    """A message of ours cannot go on the wire (wrong field type, unknown type, frame too large)."""


def decode(data: str | bytes) -> Message:
    """Decode one text frame into its typed message, or ``UnknownMessage`` for a type we do not know."""
    if not isinstance(data, (str, bytes, bytearray)):
        raise ProtocolError(f"frame must be str or bytes, not {type(data).__name__}")
    # For str, characters ≤ UTF-8 bytes, so this never refuses a frame within the limit.
    if len(data) > MAX_INBOUND_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds {MAX_INBOUND_FRAME_BYTES}")
    try:
        message = _ADAPTER.validate_json(data)
    except ValidationError as exc:
        raise ProtocolError(_describe(exc)) from None
    except (ValueError, RecursionError):  # defensive: the parser reports through ValidationError
        raise ProtocolError("frame is not valid JSON") from None
    raws = [name for name in type(message)._raw_fields if getattr(message, name) is not None]
    if raws:
        message = _restore_raw(message, data, raws)
    return message


def readable_request_id(data: str | bytes) -> str | None:
    """The ``request_id`` of an ``inference_request`` frame that ``decode`` refused, when it can still be
    read and echoed (UTF-8 JSON object, string id within the size rule); ``None`` otherwise. Python's
    parser is more lenient than ``decode``'s (NaN, lone surrogates), and like it the last duplicate key
    wins, so a frame refused for its other fields still yields the id ``decode`` would have read."""
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        value = json.loads(text)
    except (ValueError, RecursionError, TypeError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(value, dict) or value.get("type") != "inference_request":
        return None
    request_id = value.get("request_id")
    return request_id if answerable_request_id(request_id) else None


def encode(message: WireModel) -> str:
    """Encode one message as one compact JSON object (the text of one WebSocket frame)."""
    if not isinstance(message, WireModel) or isinstance(message, UnknownMessage):
        raise EncodeError(f"{type(message).__name__} is not an encodable frame")
    raws = [(name, value) for name in message._raw_fields if (value := getattr(message, name)) is not None]
    try:
        text = message.model_dump_json(exclude={name for name, _ in raws}, warnings="error")
    except PydanticSerializationError:
        raise EncodeError(f"{message.type} frame has a field value of the wrong type") from None
    if raws:
        # The raw value's bytes are someone's signature input: splice them in untouched.
        text = text[:-1] + "".join(f',"{name}":{value.text}' for name, value in raws) + "}"
    if type(message) in _OUTBOUND_TYPES and _utf8_len_exceeds(text, MAX_OUTBOUND_FRAME_BYTES):
        raise EncodeError(f"{message.type} frame exceeds {MAX_OUTBOUND_FRAME_BYTES} bytes")
    return text


def _utf8_len_exceeds(text: str, limit: int) -> bool:
    if len(text) * 4 <= limit:  # cheap: no character is longer than 4 bytes
        return False
    return len(text.encode("utf-8")) > limit


def _describe(exc: ValidationError) -> str:
    """Error locations and kinds only: pydantic's own text quotes the input, which may be private."""
    problems = [
        f"{'.'.join(str(part) for part in err['loc']) or '<frame>'}: {err['type']}"
        for err in exc.errors(include_input=False, include_url=False, include_context=False)[:5]
    ]
    return "invalid frame (" + "; ".join(problems) + ")"


def _restore_raw(message: Message, data: str | bytes, names: list[str]) -> Message:
    text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    try:
        spans = _top_level_members(text, frozenset(names))
        update = {name: RawJSON(spans[name]) for name in names}
    except (ValueError, KeyError, IndexError, RecursionError):
        raise ProtocolError("raw JSON member could not be recovered") from None
    return message.model_copy(update=update)


def _top_level_members(text: str, wanted: frozenset[str]) -> dict[str, str]:
    """The exact source text of the wanted top-level members' values (the last one wins, as in decoding)."""
    found: dict[str, str] = {}
    i = _skip_ws(text, 0)
    if text[i] != "{":
        raise ValueError("not an object")
    i = _skip_ws(text, i + 1)
    if text[i] == "}":
        return found
    while True:
        if text[i] != '"':
            raise ValueError("expected a key")
        key, i = scanstring(text, i + 1)
        i = _skip_ws(text, i)
        if text[i] != ":":
            raise ValueError("expected ':'")
        start = _skip_ws(text, i + 1)
        _, end = _DECODER.raw_decode(text, start)
        if key in wanted:
            found[key] = text[start:end]
        i = _skip_ws(text, end)
        if text[i] == "}":
            return found
        if text[i] != ",":
            raise ValueError("expected ',' or '}'")
        i = _skip_ws(text, i + 1)


def _skip_ws(text: str, i: int) -> int:
    while text[i] in " \t\n\r":
        i += 1
    return i


__all__ = [
    "MAX_INBOUND_FRAME_BYTES",
    "MAX_OUTBOUND_FRAME_BYTES",
    "EncodeError",
    "ProtocolError",
    "decode",
    "encode",
    "readable_request_id",
]

