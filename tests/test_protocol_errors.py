"""protocol.errors: closed vocabularies and the one mapping from a Failure to an inference_error frame."""

from __future__ import annotations

import json
import re

import pytest

from protocol import InferenceError, decode, encode
from protocol.errors import (
    ErrorReason,
    Failover,
    Failure,
    FailureCode,
    RejectionReason,
    TerminalCause,
    inference_error_frame,
)
from vectors import load


def _documented(field: str) -> set[str]:
    """The contract's closed vocabulary for ``field`` (tests/vectors/vocabularies.json)."""
    return set(load("vocabularies.json")["vocabularies"][field])


@pytest.mark.parametrize(
    ("enum", "field"),
    [
        (FailureCode, "failure_code"),
        (ErrorReason, "error_reason"),
        (TerminalCause, "terminal_cause"),
        (RejectionReason, "rejection_reason"),
    ],
)
def test_vocabularies_match_the_contract(enum, field):
    assert {member.value for member in enum} == _documented(field)


CASES = [
    # failure, status, failure_code, error_reason, rejection_reason, failover
    (Failure.capacity(RejectionReason.MEMORY_CAP), 503, "capacity", "capacity_busy", "memory_cap", Failover.CAPACITY),
    (Failure.capacity(RejectionReason.SLOT_STATE), 503, "capacity", "capacity_busy", "slot_state", Failover.CAPACITY),
    (Failure.capacity(RejectionReason.TOKEN_BUDGET), 503, "capacity", "capacity_busy", "token_budget", Failover.CAPACITY),
    (Failure.capacity(RejectionReason.KV_HEADROOM), 503, "capacity", "capacity_busy", "kv_headroom", Failover.CAPACITY),
    (Failure.exceeds_node(), 503, "capacity", "request_exceeds_node", "memory_cap", Failover.CAPACITY),
    (Failure.exceeds_node(RejectionReason.TOKEN_BUDGET), 503, "capacity", "request_exceeds_node_budget", "token_budget", Failover.CAPACITY),
    (Failure.draining(), 503, "capacity", "draining", None, Failover.DRAIN),
    (Failure.deadline_unreachable(), 503, "capacity", "deadline_unreachable", "deadline", Failover.DEADLINE),
    (Failure.admission_timeout(), 503, "capacity", "capacity_timeout", None, Failover.CAPACITY),
    (Failure.model_unavailable(), 404, "model_unavailable", None, None, Failover.CAPACITY),
    (Failure.model_unloaded(), 503, "model_unavailable", "model_load", None, Failover.CAPACITY),
    # A failed load, remembered: the same answer until the folder changes, so not a 503; rerouted.
    (Failure.model_load_failed(), 404, "model_unavailable", "model_load", None, Failover.CAPACITY),
    (Failure.invalid_request(), 400, "invalid_request", "client_error", None, Failover.STOP),
    (Failure.request_exceeds_context(), 400, "invalid_request", "request_exceeds_context", None, Failover.STOP),
    (Failure.template_render(), 422, "template_render", "jinja_template", None, Failover.STOP),
    (Failure.invalid_media(), 400, "invalid_media", None, None, Failover.STOP),
    (Failure.media_too_large(), 413, "media_too_large", None, None, Failover.STOP),
    (Failure.unsupported_media(), 415, "unsupported_media", None, None, Failover.STOP),
    (Failure.cancelled(), 499, "cancelled", "cancelled", None, Failover.NEUTRAL),
    (Failure.generation_failed(), 500, "generation_failure", None, None, Failover.FAULT),
    (Failure.generation_failed(TerminalCause.SAFETY_DEADLINE), 504, "generation_failure", None, None, Failover.FAULT),
    (Failure.encryption_failed(), 502, "encryption_failure", None, None, Failover.FAULT),
    (Failure.internal(), 500, "internal_failure", None, None, Failover.FAULT),
]


@pytest.mark.parametrize(("failure", "status", "code", "reason", "rejection", "failover"), CASES)
def test_failure_maps_to_its_frame(failure, status, code, reason, rejection, failover):
    frame = inference_error_frame("req-9", failure)
    wire = json.loads(encode(frame))
    assert wire["type"] == "inference_error" and wire["request_id"] == "req-9"
    assert wire["status_code"] == status and type(wire["status_code"]) is int
    assert wire["failure_code"] == code
    assert wire.get("error_reason") == reason
    assert wire.get("rejection_reason") == rejection
    assert failure.failover is failover
    assert decode(encode(frame)) == frame


def test_capacity_reject_carries_budget_and_forecast():
    failure = Failure.capacity(RejectionReason.TOKEN_BUDGET, available_token_budget=0, feasible_after_ms=750)
    wire = json.loads(encode(inference_error_frame("r", failure)))
    assert wire["available_token_budget"] == 0 and wire["feasible_after_ms"] == 750
    assert wire["error"] == "Provider capacity is temporarily unavailable."


def test_error_text_is_fixed_per_failure_and_never_dynamic():
    texts = {failure.message for failure, *_ in CASES}
    assert all(re.fullmatch(r"[A-Z][a-z' ]+\.", text) for text in texts), texts  # plain fixed sentences
    assert len(texts) == 17  # one per distinct code/reason, none shared by unrelated failures
    # Nothing about a Failure can carry caller text: its fields are enums, ints and a flag.
    assert set(Failure.__dataclass_fields__) == {
        "code", "reason", "rejection", "terminal_cause", "available_token_budget", "feasible_after_ms", "remembered"
    }
    assert inference_error_frame("a", Failure.internal()).error == inference_error_frame("b", Failure.internal()).error


@pytest.mark.parametrize(
    "build",
    [
        lambda: Failure(FailureCode.CAPACITY, ErrorReason.JINJA_TEMPLATE),
        lambda: Failure(FailureCode.INTERNAL_FAILURE, rejection=RejectionReason.MEMORY_CAP),
        lambda: Failure.capacity(RejectionReason.TOKEN_BUDGET, available_token_budget=-1),
        lambda: Failure.capacity(RejectionReason.TOKEN_BUDGET, feasible_after_ms=1.5),
        lambda: Failure(FailureCode.CAPACITY, ErrorReason.CAPACITY_BUSY, remembered=True),
    ],
)
def test_inconsistent_failures_cannot_be_built(build):
    with pytest.raises(ValueError):
        build()


def test_frame_is_the_typed_message():
    assert isinstance(inference_error_frame("r", Failure.draining()), InferenceError)
