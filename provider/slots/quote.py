"""``capacity_probe`` → ``capacity_quote``.

The quote is the admission decision a real request of the probed shape would get now —
`ModelManager.admit`, the read-only form of the booking the job makes (same `decide`, same
snapshot rule, same buffer-cache judgement) — so it never allocates, reserves or loads. A probe
reaches providers that may never serve the request: it carries a bucketed shape only, and nothing
of it is logged beyond the model.

* ``admissible_now`` / ``rejection_reason``: the decision; a refusal without a capacity reason is
  mapped onto the closed vocabulary (draining, a model we do not serve → ``slot_state``; an image
  for a text model → ``capability``; a prompt beyond the context → ``kv_headroom``, it never fits).
* ``ttft_p50_ms`` / ``ttft_p90_ms``: quantiles of the real requests of this (model, prompt bucket)
  (`RateBook.ttft`), ``confidence: high`` only with enough of them; otherwise an estimate from the
  measured or calibrated prefill rate, ``low``.
* ``queue_est_ms``: our engine runs every admitted request in its batch at once, so an admissible
  shape waits for nothing; a refused one reports the refusal's ``feasible_after_ms``.
* ``available_token_budget``: the tokens the ledger could still give this model now.
"""

from __future__ import annotations

from typing import Protocol

from protocol import CapacityProbe, CapacityQuote
from protocol.errors import ErrorReason, Failure, FailureCode, RejectionReason
from protocol.vocab import QuoteConfidence
from provider.models import ModelInfo
from provider.slots.admission import Admission, Refused
from provider.slots.rates import RateBook


class Admitting(Protocol):
    def admit(self, model_id: str, prompt_tokens: int, max_tokens: int | None = None) -> Admission: ...

    def available_tokens(self, model_id: str) -> int: ...

    def info(self, model_id: str) -> ModelInfo | None: ...


def rejection_of(failure: Failure) -> RejectionReason:
    """The closed capacity vocabulary for any refusal (capacity.go: unknown values read as absent)."""
    if failure.rejection is not None:
        return failure.rejection
    if failure.code is FailureCode.UNSUPPORTED_MEDIA:
        return RejectionReason.CAPABILITY
    if failure.reason is ErrorReason.REQUEST_EXCEEDS_CONTEXT:
        return RejectionReason.KV_HEADROOM
    if failure.code is FailureCode.TEMPLATE_RENDER:
        return RejectionReason.TEMPLATE
    return RejectionReason.SLOT_STATE  # draining, paused, a model we do not serve


def capacity_quote(probe: CapacityProbe, manager: Admitting, rates: RateBook, capacity_seq: int) -> CapacityQuote:
    """The quote for one probe: synchronous, read-only. (An image's size is not in a probe: a vision
    model's media reservation is judged when the request brings it.)"""
    max_tokens = probe.max_output_tokens if probe.max_output_tokens > 0 else None
    info = manager.info(probe.model)
    if probe.requires_vision and info is not None and not info.is_vision:
        verdict: Admission = Refused(Failure.unsupported_media())
    else:
        verdict = manager.admit(probe.model, max(0, probe.prompt_tokens_bucket), max_tokens)
    p50, p90, confidence = _ttft(rates, probe.model, probe.prompt_tokens_bucket)
    if isinstance(verdict, Refused):
        failure = verdict.failure
        return CapacityQuote(
            quote_id=probe.quote_id, capacity_seq=capacity_seq, admissible_now=False,
            rejection_reason=rejection_of(failure), ttft_p50_ms=p50, ttft_p90_ms=p90,
            queue_est_ms=float(failure.feasible_after_ms or 0),
            available_token_budget=max(0, failure.available_token_budget or 0), confidence=confidence)
    return CapacityQuote(
        quote_id=probe.quote_id, capacity_seq=capacity_seq, admissible_now=True, ttft_p50_ms=p50,
        ttft_p90_ms=p90, queue_est_ms=0.0, available_token_budget=max(0, manager.available_tokens(probe.model)),
        confidence=confidence)


def _ttft(rates: RateBook, model_id: str, prompt_tokens: int) -> tuple[float, float, QuoteConfidence]:
    seen = rates.ttft(model_id, prompt_tokens)
    if seen is not None and seen.high_confidence:
        return round(seen.p50_ms, 3), round(seen.p90_ms, 3), QuoteConfidence.HIGH
    if seen is not None:
        return round(seen.p50_ms, 3), round(seen.p90_ms, 3), QuoteConfidence.LOW
    prefill = rates.prefill_tps(model_id)
    estimate = round(max(1, prompt_tokens) / prefill * 1000, 3) if prefill > 0 else 0.0
    return estimate, estimate, QuoteConfidence.LOW


__all__ = ["capacity_quote", "rejection_of"]
