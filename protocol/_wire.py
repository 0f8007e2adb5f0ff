"""Building blocks shared by every frame: the base model, Go-compatible field types and raw JSON.

Presence rules mirror Go's encoding/json, which is what the coordinator speaks:

* a plain field is always emitted (Go: no ``omitempty``);
* a field annotated with ``OMIT_EMPTY`` is left out when it holds its zero value
  (``""``, ``0``, ``0.0``, ``False``, empty list/dict), like Go ``omitempty``;
* a field whose default is ``None`` is a Go pointer: left out when ``None``, emitted otherwise, so an explicit
  ``false`` or ``0`` survives; with ``NULLABLE`` it is emitted as ``null`` instead (``active_model``).

Integer fields only accept real ``int`` values (never a float, never a bool) and floats must be finite, so a
frame we build can always be decoded by Go.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, ClassVar, TypeAlias

from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    PlainSerializer,
    PlainValidator,
    Strict,
    StrictBool,
    StrictStr,
    model_serializer,
)


class _Presence(Enum):
    OMIT_EMPTY = "omit_empty"
    NULLABLE = "nullable"


OMIT_EMPTY = _Presence.OMIT_EMPTY
NULLABLE = _Presence.NULLABLE

Int64: TypeAlias = Annotated[int, Strict(), Field(ge=-(2**63), le=2**63 - 1)]
UInt64: TypeAlias = Annotated[int, Strict(), Field(ge=0, le=2**64 - 1)]
# Strict float still takes a JSON integer (Go float64 does too); NaN/inf have no JSON spelling.
Float: TypeAlias = Annotated[float, Strict(), AllowInfNan(False)]
Str: TypeAlias = StrictStr
Bool: TypeAlias = StrictBool

_JSON_WS = " \t\n\r"


@dataclass(frozen=True, slots=True)
class RawJSON:
    """One JSON value kept as its exact text, because someone signs those bytes (register.attestation)."""

    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text or self.text.strip(_JSON_WS) != self.text:
            raise ValueError("raw JSON must be one JSON value without surrounding whitespace")
        json.loads(self.text)  # raises ValueError (JSONDecodeError) when it is not JSON

    @classmethod
    def of(cls, value: Any) -> RawJSON:
        """Compact encoding of a Python JSON value."""
        return cls(json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False))

    def value(self) -> Any:
        return json.loads(self.text)

    def encoded(self) -> bytes:
        return self.text.encode("utf-8")


def _to_raw(value: Any) -> RawJSON:
    if isinstance(value, RawJSON):
        return value
    if value is None:
        raise ValueError("null is not a raw JSON value here")
    try:
        return RawJSON.of(value)
    except (TypeError, ValueError) as exc:
        raise ValueError("not a JSON value") from exc


class _RawMarker:
    """Metadata tag: encode() splices this field's text into the frame verbatim."""


RAW = _RawMarker()
Raw: TypeAlias = Annotated[RawJSON, PlainValidator(_to_raw), PlainSerializer(RawJSON.value), RAW]


def _null_as_empty(value: Any) -> Any:
    # Go marshals a nil slice as null; read it as an empty list.
    return () if value is None else value


NullAsEmpty = BeforeValidator(_null_as_empty)

JsonObject: TypeAlias = dict[str, JsonValue]


class WireModel(BaseModel):
    """Base of every frame and frame part: frozen, unknown fields ignored, Go presence rules on output."""

    model_config = ConfigDict(frozen=True, extra="ignore", protected_namespaces=())

    _omit_zero: ClassVar[tuple[str, ...]] = ()
    _omit_none: ClassVar[tuple[str, ...]] = ()
    _raw_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        zero: list[str] = []
        none: list[str] = []
        raw: list[str] = []
        for name, info in cls.model_fields.items():
            marks = _metadata(info.annotation, info.metadata)
            if RAW in marks:
                raw.append(name)
            if OMIT_EMPTY in marks:
                zero.append(name)
            elif NULLABLE not in marks and info.default is None:
                none.append(name)
        cls._omit_zero, cls._omit_none, cls._raw_fields = tuple(zero), tuple(none), tuple(raw)

    @model_serializer(mode="wrap")
    def _apply_presence(self, handler: Any) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self._omit_none:
            if name in data and data[name] is None:
                del data[name]
        for name in self._omit_zero:
            if name in data and not data[name]:
                del data[name]
        return data


def _metadata(annotation: Any, metadata: list[Any]) -> list[Any]:
    """Field metadata including tags on Annotated types nested in ``X | None``."""
    found = list(metadata)
    for arg in getattr(annotation, "__args__", ()):
        found.extend(getattr(arg, "__metadata__", ()))
    return found


class Opaque(WireModel):
    """A capability-gated frame whose fields the contract does not list: extra fields are kept verbatim."""

    model_config = ConfigDict(extra="allow")


class EncryptedPayload(WireModel):
    """A NaCl box on the wire: ``ciphertext`` = base64(nonce ‖ tag ‖ box). Used in both directions."""

    ephemeral_public_key: Str = ""
    ciphertext: Str = ""
