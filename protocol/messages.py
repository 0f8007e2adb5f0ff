"""Every v1 frame of both directions, and the tagged union ``Message`` that ``decode`` produces.

``UnknownMessage`` is what a frame of a type we do not know decodes to: the coordinator adds types over
time, and an unknown one must be logged and skipped, never treated as an error.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeAlias, Union, get_args

from pydantic import Discriminator, Tag

from protocol._wire import Str, WireModel
from protocol.to_coordinator import (
    AppAttestShadow,
    AttestationResponse,
    CapacityQuote,
    CodeAttestationResponse,
    Heartbeat,
    InferenceAccepted,
    InferenceComplete,
    InferenceError,
    InferenceResponseChunk,
    LoadModelStatus,
    ModelsReplace,
    ModelsReplaceReady,
    ModelsUpdate,
    PrefetchModelStatus,
    PrefixCacheLookup,
    PrefixCacheLookupV2,
    PrefixCacheReady,
    PrefixCacheReadyV2,
    ProviderDrain,
    Register,
)
from protocol.to_provider import (
    AttestationChallenge,
    Cancel,
    CapacityProbe,
    CodeAttestationResumeChallenge,
    DesiredModels,
    InferenceRequest,
    LoadModel,
    ModelsReplaceAck,
    ModelsReplaceResumed,
    PrefetchModel,
    ProviderDrainAck,
    RuntimeStatus,
    TrustStatus,
)


class UnknownMessage(WireModel):
    """A frame whose ``type`` this build does not know. Only the type is kept: the rest is unread."""

    type: Str


_UNKNOWN_TAG = "\x00unknown"

ProviderMessage: TypeAlias = Union[
    Register,
    Heartbeat,
    InferenceAccepted,
    InferenceResponseChunk,
    InferenceComplete,
    InferenceError,
    AttestationResponse,
    CodeAttestationResponse,
    LoadModelStatus,
    PrefetchModelStatus,
    ModelsUpdate,
    CapacityQuote,
    ProviderDrain,
    PrefixCacheLookup,
    PrefixCacheReady,
    PrefixCacheLookupV2,
    PrefixCacheReadyV2,
    ModelsReplace,
    ModelsReplaceReady,
    AppAttestShadow,
]
CoordinatorMessage: TypeAlias = Union[
    InferenceRequest,
    Cancel,
    AttestationChallenge,
    RuntimeStatus,
    LoadModel,
    PrefetchModel,
    DesiredModels,
    TrustStatus,
    CapacityProbe,
    CodeAttestationResumeChallenge,
    ProviderDrainAck,
    ModelsReplaceAck,
    ModelsReplaceResumed,
    AppAttestShadow,
]
Message: TypeAlias = Union[ProviderMessage, CoordinatorMessage, UnknownMessage]

PROVIDER_FRAMES: tuple[type[WireModel], ...] = get_args(ProviderMessage)
"""Frame classes the provider sends (app_attest_shadow travels both ways)."""
COORDINATOR_FRAMES: tuple[type[WireModel], ...] = get_args(CoordinatorMessage)
"""Frame classes the coordinator sends."""


def _type_name(cls: type[WireModel]) -> str:
    (name,) = cls.model_fields["type"].annotation.__args__  # Literal["..."]
    return name


FRAME_TYPES: dict[str, type[WireModel]] = {
    _type_name(cls): cls for cls in PROVIDER_FRAMES + COORDINATOR_FRAMES
}
"""Wire ``type`` string -> frame class."""


def _tag(value: Any) -> str | None:
    name = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(name, str):
        return None
    return name if name in FRAME_TYPES else _UNKNOWN_TAG


TaggedMessage = Annotated[
    Union[
        tuple(Annotated[cls, Tag(name)] for name, cls in FRAME_TYPES.items())  # type: ignore[misc]
        + (Annotated[UnknownMessage, Tag(_UNKNOWN_TAG)],)
    ],
    Discriminator(_tag),
]
"""The pydantic union ``decode`` validates against: dispatch on ``type``, unknown types to UnknownMessage."""

__all__ = [
    "COORDINATOR_FRAMES",
    "FRAME_TYPES",
    "PROVIDER_FRAMES",
    "CoordinatorMessage",
    "Message",
    "ProviderMessage",
    "TaggedMessage",
    "UnknownMessage",
]
