"""Frames the coordinator sends to the provider. Tolerant: every field has Go's zero value
as its default, so a missing field reads the way Go would have written it, and unknown fields are ignored.

A missing ``encrypted_body`` stays ``None`` instead of failing the frame: the request id is still known, so
the job can answer with a 400 ``invalid_request``.

Size rule: every field we echo back (``request_id`` in every answer, the challenge ``nonce``) has a length
bound, so an answer can always be encoded and stays small; a frame that breaks it does not decode and is
refused before any work. Real values are far below: a Go UUID is 36 characters, [N] barrier ids are ≤ 64
bytes, an [A] nonce is 44 characters of base64.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, JsonValue

from protocol._wire import (
    OMIT_EMPTY,
    Bool,
    EncryptedPayload,
    Int64,
    NullAsEmpty,
    Opaque,
    Str,
    WireModel,
)
from protocol.to_coordinator import AppAttestShadow

__all__ = [
    "MAX_NONCE_CHARS",
    "MAX_REQUEST_ID_CHARS",
    "MAX_TIMESTAMP_CHARS",
    "AppAttestShadow",
    "AttestationChallenge",
    "Cancel",
    "CapacityProbe",
    "CodeAttestationResumeChallenge",
    "DesiredModel",
    "DesiredModels",
    "InferenceRequest",
    "LoadModel",
    "ModelsReplaceAck",
    "ModelsReplaceResumed",
    "PrefetchModel",
    "ProviderDrainAck",
    "RuntimeMismatch",
    "RuntimeStatus",
    "TrustStatus",
]


MAX_REQUEST_ID_CHARS = 256
MAX_NONCE_CHARS = 512
MAX_TIMESTAMP_CHARS = 64

RequestId = Annotated[Str, Field(max_length=MAX_REQUEST_ID_CHARS)]


def answerable_request_id(value: object) -> bool:
    """Whether ``value`` can be echoed in an answer: a non-empty string within the size rule that encodes as
    UTF-8 (no lone surrogate)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REQUEST_ID_CHARS:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class InferenceRequest(WireModel):
    """Run one request. ``body`` is [N]'s zero-value struct (or a plaintext decoder fixture): never trust it;
    the real request is ``encrypted_body``. ``first_content_budget_ms`` 0 means no deadline was set."""

    type: Literal["inference_request"] = "inference_request"
    request_id: RequestId = ""
    body: JsonValue = None
    encrypted_body: EncryptedPayload | None = None
    first_content_budget_ms: Annotated[Int64, OMIT_EMPTY] = 0
    # [N] prefix-cache fields: shapes are not in the contract, so any JSON is accepted and they are unused.
    cache_receipt_nonce: JsonValue = None
    cache_scope: JsonValue = None
    prefix_cache_protocol: JsonValue = None
    cache_receipt_boundary_mode: JsonValue = None
    tool_schema_metadata_protocol: Annotated[Int64, OMIT_EMPTY] = 0


class Cancel(WireModel):
    """Stop a request. Routinely names finished or unknown ids; those are ignored."""

    type: Literal["cancel"] = "cancel"
    request_id: RequestId = ""


class AttestationChallenge(WireModel):
    """Answer within 30 s. ``nonce`` is echoed exactly; ``timestamp`` is RFC 3339 UTC."""

    type: Literal["attestation_challenge"] = "attestation_challenge"
    nonce: Annotated[Str, Field(max_length=MAX_NONCE_CHARS)] = ""
    timestamp: Annotated[Str, Field(max_length=MAX_TIMESTAMP_CHARS)] = ""


class RuntimeMismatch(WireModel):
    component: Str = ""
    expected: Str = ""
    got: Str = ""


class RuntimeStatus(WireModel):
    type: Literal["runtime_status"] = "runtime_status"
    verified: Bool = False
    mismatches: Annotated[tuple[RuntimeMismatch, ...], OMIT_EMPTY, NullAsEmpty] = ()


class LoadModel(WireModel):
    type: Literal["load_model"] = "load_model"
    model_id: Str = ""


class PrefetchModel(WireModel):
    type: Literal["prefetch_model"] = "prefetch_model"
    model_id: Str = ""
    priority: Annotated[Int64, OMIT_EMPTY] = 0


class DesiredModel(WireModel):
    model_name: Str = ""
    desired_build: Str = ""
    previous_build: Annotated[Str, OMIT_EMPTY] = ""


class DesiredModels(WireModel):
    type: Literal["desired_models"] = "desired_models"
    models: Annotated[tuple[DesiredModel, ...], NullAsEmpty] = ()


class TrustStatus(WireModel):
    """Diagnostics only."""

    type: Literal["trust_status"] = "trust_status"
    trust_level: Str = ""
    status: Str = ""
    reason: Annotated[Str, OMIT_EMPTY] = ""
    authorization: JsonValue = None


class CapacityProbe(WireModel):
    """Only sent after we report ``capacity_seq > 0``. ``quote_id`` is echoed in the quote: bounded."""

    type: Literal["capacity_probe"] = "capacity_probe"
    quote_id: RequestId = ""
    model: Str = ""
    prompt_tokens_bucket: Int64 = 0
    max_output_tokens: Int64 = 0
    requires_vision: Annotated[Bool, OMIT_EMPTY] = False
    vision_image_count: Annotated[Int64, OMIT_EMPTY] = 0
    deadline_remaining_ms: Int64 = 0


class CodeAttestationResumeChallenge(WireModel):
    type: Literal["code_attestation_resume_challenge"] = "code_attestation_resume_challenge"
    code_challenge: EncryptedPayload | None = None


class ProviderDrainAck(WireModel):
    type: Literal["provider_drain_ack"] = "provider_drain_ack"
    request_id: RequestId = ""


class ModelsReplaceAck(Opaque):
    type: Literal["models_replace_ack"] = "models_replace_ack"


class ModelsReplaceResumed(Opaque):
    type: Literal["models_replace_resumed"] = "models_replace_resumed"
