"""Turning a failure into the one ``inference_error`` frame that reports it.

Callers describe *what* went wrong with a typed ``Failure`` (``Failure.capacity(RejectionReason.MEMORY_CAP)``,
``Failure.draining()``, ``Failure.invalid_request()``…); the status code, ``failure_code``/``error_reason``
pair and the ``error`` text all follow from it. The text is a fixed sentence per failure, so no prompt
fragment or exception string can reach the wire: [A] shows it to consumers, [N] replaces it anyway.

How the coordinator reacts is summarised by ``Failure.failover``: every pre-first-chunk
error is rerouted on [A]; [N] fails over on capacity/drain/deadline/fault and stops on client errors.
Send a capacity reject *without* a prior ``inference_accepted`` so the reroute is immediate.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from protocol.to_coordinator import InferenceError
from protocol.vocab import ErrorReason, FailureCode, RejectionReason, TerminalCause

__all__ = [
    "ErrorReason",
    "Failover",
    "Failure",
    "FailureCode",
    "RejectionReason",
    "TerminalCause",
    "inference_error_frame",
]


class Failover(Enum):
    """What an [N] coordinator does with this failure before the first chunk."""

    CAPACITY = "capacity"  # fail over, at most 3 times; no health penalty
    DRAIN = "drain"  # fail over without using the capacity allowance; provider skipped while draining
    DEADLINE = "deadline"  # fail over without using the capacity allowance; health-neutral
    STOP = "stop"  # deterministic: the consumer gets the answer at once (client error, prompt too long)
    NEUTRAL = "neutral"  # cancelled
    FAULT = "fault"  # genuine fault: fail over, counts against the provider's health


_STATUS: dict[FailureCode, int] = {
    FailureCode.INVALID_REQUEST: 400,
    FailureCode.INVALID_MEDIA: 400,
    FailureCode.MEDIA_TOO_LARGE: 413,
    FailureCode.UNSUPPORTED_MEDIA: 415,
    FailureCode.TEMPLATE_RENDER: 422,
    FailureCode.MODEL_UNAVAILABLE: 404,
    FailureCode.CAPACITY: 503,
    FailureCode.CANCELLED: 499,
    FailureCode.ENCRYPTION_FAILURE: 502,
    FailureCode.GENERATION_FAILURE: 500,
    FailureCode.INTERNAL_FAILURE: 500,
}

_TEXT: dict[FailureCode, str] = {
    FailureCode.INVALID_REQUEST: "Invalid request.",
    FailureCode.INVALID_MEDIA: "Invalid media in request.",
    FailureCode.MEDIA_TOO_LARGE: "Media in request is too large.",
    FailureCode.UNSUPPORTED_MEDIA: "Unsupported media type in request.",
    FailureCode.TEMPLATE_RENDER: "The model's chat template could not render this request.",
    FailureCode.MODEL_UNAVAILABLE: "Requested model is not available on this provider.",
    FailureCode.CAPACITY: "Provider capacity is temporarily unavailable.",
    FailureCode.CANCELLED: "Request was cancelled.",
    FailureCode.ENCRYPTION_FAILURE: "Response encryption failed.",
    FailureCode.GENERATION_FAILURE: "Generation failed.",
    FailureCode.INTERNAL_FAILURE: "Internal provider error.",
}

_REASON_TEXT: dict[ErrorReason, str] = {
    ErrorReason.DRAINING: "Provider is draining and accepts no new requests.",
    ErrorReason.DEADLINE_UNREACHABLE: "Provider cannot produce output before the request deadline.",
    ErrorReason.MODEL_LOAD: "Requested model could not be loaded on this provider.",
    ErrorReason.REQUEST_EXCEEDS_CONTEXT: "Request exceeds the model's context window.",
    ErrorReason.REQUEST_EXCEEDS_NODE: "Request needs more memory than this provider has.",
    ErrorReason.REQUEST_EXCEEDS_NODE_BUDGET: "Request exceeds this provider's token budget.",
}

# error_reason values that keep a capacity failure in the transient class.
_CAPACITY_REASONS = frozenset(
    {
        ErrorReason.CAPACITY_BUSY,
        ErrorReason.CAPACITY_TIMEOUT,
        ErrorReason.QUEUE_FULL,
        ErrorReason.TOKEN_BUDGET_EXHAUSTED,
        ErrorReason.REQUEST_EXCEEDS_NODE,
        ErrorReason.REQUEST_EXCEEDS_NODE_BUDGET,
        ErrorReason.DRAINING,
        ErrorReason.DEADLINE_UNREACHABLE,
    }
)
_CLIENT_CODES = frozenset(
    {
        FailureCode.INVALID_REQUEST,
        FailureCode.INVALID_MEDIA,
        FailureCode.MEDIA_TOO_LARGE,
        FailureCode.UNSUPPORTED_MEDIA,
        FailureCode.TEMPLATE_RENDER,
    }
)
# [N] canonicalises these causes to 504 (safeInferenceFailureStatus).
_GATEWAY_TIMEOUT_CAUSES = frozenset({TerminalCause.SAFETY_DEADLINE, TerminalCause.BACKPRESSURE_TIMEOUT})


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a request failed, in the coordinator's vocabulary. Build it with the class methods."""

    code: FailureCode
    reason: ErrorReason | None = None
    rejection: RejectionReason | None = None
    terminal_cause: TerminalCause | None = None
    available_token_budget: int | None = None
    feasible_after_ms: int | None = None
    remembered: bool = False  # the same answer until something here changes (a model's failed load): not a 503

    def __post_init__(self) -> None:
        if self.remembered and self.code is not FailureCode.MODEL_UNAVAILABLE:
            raise ValueError("only a model's unavailability is remembered")
        if self.code is FailureCode.CAPACITY:
            if self.reason is not None and self.reason not in _CAPACITY_REASONS:
                raise ValueError(f"{self.reason} is not a capacity reason")
        elif self.rejection is not None or self.available_token_budget is not None:
            raise ValueError("rejection details belong to capacity failures")
        for name in ("available_token_budget", "feasible_after_ms"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"{name} must be a non-negative int")

    # --- fast-admission rejects (before inference_accepted) ---------------------------------------------

    @classmethod
    def capacity(
        cls,
        rejection: RejectionReason,
        *,
        reason: ErrorReason = ErrorReason.CAPACITY_BUSY,
        available_token_budget: int | None = None,
        feasible_after_ms: int | None = None,
    ) -> Failure:
        """Cannot serve it now (memory cap, KV headroom, token budget, slot state): 503, rerouted."""
        return cls(
            FailureCode.CAPACITY,
            reason,
            rejection,
            available_token_budget=available_token_budget,
            feasible_after_ms=feasible_after_ms,
        )

    @classmethod
    def exceeds_node(cls, rejection: RejectionReason = RejectionReason.MEMORY_CAP) -> Failure:
        """Bigger than this machine could ever serve, though another may: 503, rerouted."""
        reason = (
            ErrorReason.REQUEST_EXCEEDS_NODE_BUDGET
            if rejection is RejectionReason.TOKEN_BUDGET
            else ErrorReason.REQUEST_EXCEEDS_NODE
        )
        return cls(FailureCode.CAPACITY, reason, rejection)

    @classmethod
    def draining(cls) -> Failure:
        return cls(FailureCode.CAPACITY, ErrorReason.DRAINING)

    @classmethod
    def paused(cls, retry_after_s: int) -> Failure:
        """The owner's Mac is not serving now (outside its serving windows, in use, on battery, hot):
        a ``draining`` refusal, which [N] fails over without using the capacity allowance, with
        ``feasible_after_ms`` saying when to come back."""
        return cls(FailureCode.CAPACITY, ErrorReason.DRAINING, feasible_after_ms=max(0, retry_after_s) * 1000)

    @property
    def retry_after_s(self) -> int | None:
        """Whole seconds in ``feasible_after_ms`` (the HTTP Retry-After), None when it says nothing."""
        return None if not self.feasible_after_ms else -(-self.feasible_after_ms // 1000)

    @classmethod
    def deadline_unreachable(cls) -> Failure:
        """``first_content_budget_ms`` cannot be met: 503, rerouted without using the capacity allowance."""
        return cls(FailureCode.CAPACITY, ErrorReason.DEADLINE_UNREACHABLE, RejectionReason.DEADLINE)

    @classmethod
    def admission_timeout(cls) -> Failure:
        """Waited for capacity and none came free before any output: 503, rerouted."""
        return cls(FailureCode.CAPACITY, ErrorReason.CAPACITY_TIMEOUT, terminal_cause=TerminalCause.ADMISSION_TIMEOUT)

    @classmethod
    def model_unavailable(cls) -> Failure:
        """The requested model is not one we serve: 404, rerouted."""
        return cls(FailureCode.MODEL_UNAVAILABLE)

    @classmethod
    def model_unloaded(cls) -> Failure:
        """The model went away under the request (unloaded while it waited, its load undone): 503,
        rerouted; a retry, here or on another provider, may find it."""
        return cls(FailureCode.MODEL_UNAVAILABLE, ErrorReason.MODEL_LOAD)

    @classmethod
    def model_load_failed(cls) -> Failure:
        """This provider's copy of the model failed to load, and the failure is remembered: the same
        answer until the model's folder changes or a backoff passes, so a 404 (``model_unavailable``,
        ``error_reason: model_load``), not a 503. The coordinator reroutes the request to another
        provider, as for any model this one does not serve ([N] keeps a 404 as sent), and the model
        is no longer advertised here. The wire's closed ``error_reason`` vocabulary has no word for
        "failed and remembered" (an unknown value is not one a Go coordinator accepts): the status
        says it; the local server names it ``model_load_failed``."""
        return cls(FailureCode.MODEL_UNAVAILABLE, ErrorReason.MODEL_LOAD, remembered=True)

    # --- client errors: the coordinator stops at once, never retried ---------------------------------------

    @classmethod
    def invalid_request(cls) -> Failure:
        """Undecryptable or unparsable body, missing ``encrypted_body``, invalid messages: 400."""
        return cls(FailureCode.INVALID_REQUEST, ErrorReason.CLIENT_ERROR)

    @classmethod
    def request_exceeds_context(cls) -> Failure:
        """The prompt is longer than the model's context window on any machine: 400, not retried."""
        return cls(FailureCode.INVALID_REQUEST, ErrorReason.REQUEST_EXCEEDS_CONTEXT)

    @classmethod
    def template_render(cls) -> Failure:
        return cls(FailureCode.TEMPLATE_RENDER, ErrorReason.JINJA_TEMPLATE)

    @classmethod
    def invalid_media(cls) -> Failure:
        return cls(FailureCode.INVALID_MEDIA)

    @classmethod
    def media_too_large(cls) -> Failure:
        return cls(FailureCode.MEDIA_TOO_LARGE)

    @classmethod
    def unsupported_media(cls) -> Failure:
        return cls(FailureCode.UNSUPPORTED_MEDIA)

    # --- during or after generation ------------------------------------------------------------------------

    @classmethod
    def cancelled(cls) -> Failure:
        return cls(FailureCode.CANCELLED, ErrorReason.CANCELLED, terminal_cause=TerminalCause.CANCELLED)

    @classmethod
    def generation_failed(cls, cause: TerminalCause = TerminalCause.ENGINE_ERROR) -> Failure:
        """The engine failed or stalled (``prefill_stall``, ``decode_stall``, ``watchdog``, …)."""
        return cls(FailureCode.GENERATION_FAILURE, terminal_cause=cause)

    @classmethod
    def encryption_failed(cls) -> Failure:
        """A response chunk could not be sealed: 502."""
        return cls(FailureCode.ENCRYPTION_FAILURE)

    @classmethod
    def internal(cls) -> Failure:
        return cls(FailureCode.INTERNAL_FAILURE)

    # --- derived ---------------------------------------------------------------------------------------------

    @property
    def status_code(self) -> int:
        if self.terminal_cause in _GATEWAY_TIMEOUT_CAUSES:
            return 504
        if self.reason is ErrorReason.MODEL_LOAD and not self.remembered:
            return 503
        return _STATUS[self.code]

    @property
    def message(self) -> str:
        """The fixed, privacy-safe ``error`` text."""
        if self.reason is not None and self.reason in _REASON_TEXT:
            return _REASON_TEXT[self.reason]
        return _TEXT[self.code]

    @property
    def failover(self) -> Failover:
        if self.code is FailureCode.CANCELLED:
            return Failover.NEUTRAL
        if self.code in _CLIENT_CODES:
            return Failover.STOP
        if self.reason is ErrorReason.DRAINING:
            return Failover.DRAIN
        if self.reason is ErrorReason.DEADLINE_UNREACHABLE or self.rejection is RejectionReason.DEADLINE:
            return Failover.DEADLINE
        if self.code in (FailureCode.CAPACITY, FailureCode.MODEL_UNAVAILABLE):
            return Failover.CAPACITY
        return Failover.FAULT


def inference_error_frame(request_id: str, failure: Failure) -> InferenceError:
    """The one ``inference_error`` frame that reports ``failure`` for ``request_id``."""
    return InferenceError(
        request_id=request_id,
        error=failure.message,
        status_code=failure.status_code,
        error_reason=failure.reason,
        failure_code=failure.code,
        terminal_cause=failure.terminal_cause,
        rejection_reason=failure.rejection,
        available_token_budget=failure.available_token_budget,
        feasible_after_ms=failure.feasible_after_ms or 0,
    )
