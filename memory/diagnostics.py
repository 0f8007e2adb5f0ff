"""Memory that does not come back: the no-model baseline, its drift, and a restart recommendation.

On Apple silicon, memory that an unload does not give back accumulates over model switches until
the machine swaps or needs a restart (the oMLX hardening PR in the project's seeds: "steady memory
accumulation ... over 50+ model switches"). The agent already measures the pieces: every unload's
freed bytes and settle time, and whether the settle barrier got there. This module turns them into
one verdict, from the history alone (pure: the samples come in as numbers):

* the **baseline**: MLX active memory (and the process RSS) with no model resident, sampled at
  start and after each settle that left nothing resident; its **drift** is the latest sample less
  the first (bytes, and as a share of the effective cap);
* `restart_advice(...)`:
  - `needed` when the drift leaves less than one model's worth of what the cap promised: the
    largest advertised model no longer loads under `effective cap − drift` (its weights estimate
    plus the activation reserve and the minimum KV);
  - `advised` when the drift passes `min(drift_fraction × effective cap, drift_bytes)` (defaults
    5 % and 1 GiB), or when the last `failed_settles` settles in a row (default 2) fell short;
  - `none` otherwise.

The thresholds are settings (`RestartThresholds`); `provider` acts on the verdict (status, metrics,
doctor, and a safe self-restart under a service manager).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from memory.policy import CapFigures, GiB


class Recommendation(StrEnum):
    NONE = "none"
    ADVISED = "advised"
    NEEDED = "needed"


class RestartReason(StrEnum):
    BASELINE_DRIFT = "baseline_drift"  # no-model memory grew past the threshold
    SETTLE_FAILURES = "settle_failures"  # unloads in a row did not give their memory back
    NO_MODEL_HEADROOM = "no_model_headroom"  # what is left no longer loads the largest advertised model


@dataclass(frozen=True, slots=True)
class BaselineSample:
    """No model resident, after a full settle (or at start)."""

    taken_at: float  # time.monotonic()
    mlx_active_bytes: int
    rss_bytes: int


@dataclass(frozen=True, slots=True)
class RestartThresholds:
    drift_fraction: float = 0.05  # of the effective cap
    drift_bytes: int = 1 * GiB
    failed_settles: int = 2  # consecutive unloads whose memory did not settle

    def drift_limit_bytes(self, figures: CapFigures) -> int:
        return max(0, min(int(self.drift_fraction * figures.effective_cap_bytes), self.drift_bytes))


@dataclass(frozen=True, slots=True)
class Drift:
    mlx_active_bytes: int  # latest − first (may be negative: memory came back)
    rss_bytes: int
    fraction_of_cap: float  # mlx_active_bytes / effective cap

    @classmethod
    def of(cls, history: Sequence[BaselineSample], figures: CapFigures) -> Drift:
        if len(history) < 2:
            return cls(0, 0, 0.0)
        first, last = history[0], history[-1]
        active = last.mlx_active_bytes - first.mlx_active_bytes
        cap = figures.effective_cap_bytes
        return cls(active, last.rss_bytes - first.rss_bytes, active / cap if cap > 0 else 0.0)


@dataclass(frozen=True, slots=True)
class RestartAdvice:
    recommendation: Recommendation
    reason: RestartReason | None
    drift: Drift

    @property
    def needed(self) -> bool:
        return self.recommendation is Recommendation.NEEDED


def restart_advice(figures: CapFigures, history: Sequence[BaselineSample], settles: Sequence[bool], *,
                   largest_model_required_bytes: int = 0,
                   thresholds: RestartThresholds = RestartThresholds()) -> RestartAdvice:
    """The verdict over the baseline `history` (oldest first) and the unloads' `settles` (oldest
    first, True = settled). `largest_model_required_bytes`: what the largest advertised model needs
    to load (`CapFigures.required_load_bytes` of its padded weights); 0 = none advertised."""
    drift = Drift.of(history, figures)
    if largest_model_required_bytes > 0 and drift.mlx_active_bytes > 0 and \
            figures.effective_cap_bytes - drift.mlx_active_bytes < largest_model_required_bytes:
        return RestartAdvice(Recommendation.NEEDED, RestartReason.NO_MODEL_HEADROOM, drift)
    if drift.mlx_active_bytes > 0 and drift.mlx_active_bytes >= thresholds.drift_limit_bytes(figures):
        return RestartAdvice(Recommendation.ADVISED, RestartReason.BASELINE_DRIFT, drift)
    tail = list(settles[-thresholds.failed_settles:]) if thresholds.failed_settles > 0 else []
    if tail and len(tail) == thresholds.failed_settles and not any(tail):
        return RestartAdvice(Recommendation.ADVISED, RestartReason.SETTLE_FAILURES, drift)
    return RestartAdvice(Recommendation.NONE, None, drift)


__all__ = ["BaselineSample", "Drift", "Recommendation", "RestartAdvice", "RestartReason", "RestartThresholds",
           "restart_advice"]
