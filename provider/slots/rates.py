"""Routing evidence: what each model's requests really ran at.

The coordinator forecasts time to first content from a slot's ``observed_prefill_tps`` (isolated
prefill) and ``observed_decode_tps`` and trusts them only while fresh (first-content-routing.md:
an unchanged EWMA never renews; the slot's ``performance_measurements`` carries each rate's sample
count and ``sample_age_ms``). Per model, from the requests it serves:

* decode: (completion tokens − 1) / (last token − first token), every request with ≥ 2 tokens;
* isolated prefill: computed prompt tokens (the prompt less what came from the prefix cache) /
  (first token − submit), only when the request was alone in the engine from submit to its first
  token and the cache gave at most 1/8 of its prompt (a contended window, or one mostly spent
  restoring cached KV, says nothing about the rate; a shared template start of a few tokens is
  what nearly every request reuses);
* an EWMA with α = 0.3 (the Swift provider's), reseeded by the first sample after an evidence gap
  longer than ``FRESHNESS_S`` instead of blended with a rate that expired;
* implausible samples are dropped: a window under 1 ms, prefill above 20,000 tok/s (the
  coordinator's ``maxPrefillTPS``; such a value is read as no measurement);
* time to first token per (model, prompt bucket of 512): a ring of the last ``TTFT_RING`` real
  requests that found the model loaded, whose quantiles a ``capacity_quote`` reports (``confidence:
  high`` only from it).

A load starts a new epoch: what the previous engine measured is gone. ``calibrated`` keeps the
rates of the timed pass at load (register's ``prefill_tps`` / ``decode_tps``) apart from served ones.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import PerformanceMeasurements, PerformanceRateObservation

EWMA_ALPHA = 0.3
FRESHNESS_S = 120.0  # EnginePerformanceMeasurements.freshness upstream: older evidence is reseeded
MIN_WINDOW_S = 0.001
MAX_PREFILL_TPS = 20_000.0
MAX_DECODE_TPS = 500.0 * 40  # far above any real per-request rate; only garbage is dropped
PROMPT_BUCKET_TOKENS = 512  # CapacityProbePromptBucketTokens
TTFT_RING = 64
MAX_CACHED_SHARE = 8  # a prefill sample takes at most 1/8 of its prompt from the prefix cache
HIGH_CONFIDENCE_SAMPLES = 5  # a shape's ring needs this many real requests to quote "high"


def prompt_bucket(prompt_tokens: int) -> int:
    """Rounded up to a multiple of 512, as the coordinator buckets a probe's prompt."""
    return max(1, -(-max(0, prompt_tokens) // PROMPT_BUCKET_TOKENS)) * PROMPT_BUCKET_TOKENS


@dataclass(slots=True)
class Rate:
    """One EWMA with its sample count and the monotonic time of its newest sample."""

    tps: float = 0.0
    count: int = 0
    at: float | None = None

    def add(self, tps: float, now: float) -> None:
        stale = self.at is None or now - self.at > FRESHNESS_S
        self.tps = tps if stale else EWMA_ALPHA * tps + (1 - EWMA_ALPHA) * self.tps
        self.count += 1
        self.at = now

    def observation(self, now: float) -> PerformanceRateObservation | None:
        if self.at is None:
            return None
        return PerformanceRateObservation(tokens_per_second=round(self.tps, 3), sample_count=self.count,
                                          sample_age_ms=max(0, round((now - self.at) * 1000)))


@dataclass(frozen=True, slots=True)
class Ttft:
    p50_ms: float
    p90_ms: float
    samples: int

    @property
    def high_confidence(self) -> bool:
        return self.samples >= HIGH_CONFIDENCE_SAMPLES


@dataclass(slots=True)
class ModelRates:
    epoch: str
    decode: Rate = field(default_factory=Rate)
    prefill: Rate = field(default_factory=Rate)
    calibrated_prefill_tps: float = 0.0
    calibrated_decode_tps: float = 0.0
    ttft: dict[int, deque[float]] = field(default_factory=dict)
    loaded_at: float = float("-inf")  # monotonic: a request that arrived before waited for the load


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class RateBook:
    """Every model's measured rates. Called on the event loop (jobs, heartbeat, quotes)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._models: dict[str, ModelRates] = {}

    def loaded(self, model_id: str) -> None:
        """A new engine lifetime for this model: a new epoch, nothing measured yet."""
        self._models[model_id] = ModelRates(epoch=uuid.uuid4().hex[:16], loaded_at=self._clock())

    def _rates(self, model_id: str) -> ModelRates:
        rates = self._models.get(model_id)
        if rates is None:
            rates = self._models[model_id] = ModelRates(epoch=uuid.uuid4().hex[:16])
        return rates

    def calibrated(self, model_id: str, *, prefill_tps: float, decode_tps: float) -> None:
        rates = self._rates(model_id)
        rates.calibrated_prefill_tps = max(0.0, min(prefill_tps, MAX_PREFILL_TPS))
        rates.calibrated_decode_tps = max(0.0, min(decode_tps, MAX_DECODE_TPS))

    def served(self, model_id: str, *, prompt_tokens: int, completion_tokens: int, submitted: float,
               first_token: float, ended: float, isolated: bool, ttft_s: float | None = None,
               cached_tokens: int = 0) -> None:
        """One request that completed: its timings (monotonic seconds)."""
        rates = self._rates(model_id)
        now = self._clock()
        prefill_s = first_token - submitted
        computed = prompt_tokens - max(0, cached_tokens)
        if isolated and computed > 0 and cached_tokens * MAX_CACHED_SHARE <= prompt_tokens \
                and prefill_s >= MIN_WINDOW_S:
            tps = computed / prefill_s
            if tps <= MAX_PREFILL_TPS:
                rates.prefill.add(tps, now)
        decode_s = ended - first_token
        if completion_tokens >= 2 and decode_s >= MIN_WINDOW_S:
            tps = (completion_tokens - 1) / decode_s
            if tps <= MAX_DECODE_TPS:
                rates.decode.add(tps, now)
        ttft = prefill_s if ttft_s is None else ttft_s
        if first_token - ttft < rates.loaded_at:
            return  # it waited for the load: a cold first token is not this shape's warm TTFT
        ring = rates.ttft.setdefault(prompt_bucket(prompt_tokens), deque(maxlen=TTFT_RING))
        ring.append(max(0.0, ttft * 1000))

    def decode_tps(self, model_id: str) -> float:
        """The served EWMA, else the calibration's, else 0."""
        rates = self._models.get(model_id)
        if rates is None:
            return 0.0
        return rates.decode.tps if rates.decode.count else rates.calibrated_decode_tps

    def prefill_tps(self, model_id: str) -> float:
        rates = self._models.get(model_id)
        if rates is None:
            return 0.0
        return rates.prefill.tps if rates.prefill.count else rates.calibrated_prefill_tps

    def observed(self, model_id: str) -> tuple[float, float]:
        """(observed_prefill_tps, observed_decode_tps) from served requests; zeros when unmeasured."""
        rates = self._models.get(model_id)
        if rates is None:
            return 0.0, 0.0
        return round(rates.prefill.tps, 3) if rates.prefill.count else 0.0, \
            round(rates.decode.tps, 3) if rates.decode.count else 0.0

    def measurements(self, model_id: str) -> PerformanceMeasurements | None:
        rates = self._models.get(model_id)
        if rates is None or (rates.decode.at is None and rates.prefill.at is None):
            return None
        now = self._clock()
        return PerformanceMeasurements(epoch=rates.epoch, isolated_prefill=rates.prefill.observation(now),
                                       decode=rates.decode.observation(now))

    def ttft(self, model_id: str, prompt_tokens: int) -> Ttft | None:
        """Quantiles of real requests of this prompt bucket; None when there are none."""
        rates = self._models.get(model_id)
        ring = rates.ttft.get(prompt_bucket(prompt_tokens)) if rates is not None else None
        if not ring:
            return None
        values = list(ring)
        return Ttft(_quantile(values, 0.5), _quantile(values, 0.9), len(values))


__all__ = ["EWMA_ALPHA", "FRESHNESS_S", "PROMPT_BUCKET_TOKENS", "RateBook", "Ttft", "prompt_bucket"]
