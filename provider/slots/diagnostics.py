"""What the model manager remembers for memory diagnostics: the last unloads and the
no-model baseline, and the restart verdict over them (the rule is `memory.diagnostics`).

`ModelManager` owns one `MemoryDiagnostics`: it reports each unload (`unloaded`), and samples the
baseline whenever a settle left no model resident (and once at start, `sample`). Everything here is
loop-side and cheap: a bounded deque of unloads, a bounded list of baseline samples (the first is
kept: drift is measured from it).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memory import CapFigures, MemorySnapshot
from memory.diagnostics import BaselineSample, RestartAdvice, RestartThresholds, restart_advice

MAX_UNLOADS = 16  # eviction/unload events kept for /status
MAX_BASELINE = 64  # baseline samples kept (the first always)


@dataclass(frozen=True, slots=True)
class UnloadEvent:
    """One unload as /status shows it (the manager's `UnloadReport`, plus when)."""

    at: float  # time.time()
    model_id: str
    cause: str
    resident_bytes: int
    freed_bytes: int
    settled: bool
    settle_seconds: float

    def as_json(self) -> dict[str, Any]:
        return {"at": self.at, "model": self.model_id, "cause": self.cause, "resident_bytes": self.resident_bytes,
                "freed_bytes": self.freed_bytes, "settled": self.settled,
                "settle_s": round(self.settle_seconds, 3)}


class MemoryDiagnostics:
    def __init__(self, figures: Callable[[], CapFigures], thresholds: RestartThresholds = RestartThresholds(),
                 *, wall_clock: Callable[[], float]) -> None:
        self._figures = figures
        self.thresholds = thresholds
        self._wall = wall_clock
        self.unloads: collections.deque[UnloadEvent] = collections.deque(maxlen=MAX_UNLOADS)
        self._settles: collections.deque[bool] = collections.deque(maxlen=max(1, thresholds.failed_settles) * 4)
        self.baseline: list[BaselineSample] = []

    def unloaded(self, event: UnloadEvent) -> None:
        self.unloads.append(event)
        self._settles.append(event.settled)

    def sample(self, snapshot: MemorySnapshot) -> BaselineSample:
        """Record the no-model baseline now (call only when no model is resident or loading)."""
        sample = BaselineSample(snapshot.taken_at, snapshot.mlx_active_bytes, snapshot.rss_bytes)
        self.baseline.append(sample)
        if len(self.baseline) > MAX_BASELINE:
            del self.baseline[1]  # keep the first: drift is measured from start
        return sample

    def advice(self, largest_model_required_bytes: int) -> RestartAdvice:
        return restart_advice(self._figures(), self.baseline, list(self._settles),
                              largest_model_required_bytes=largest_model_required_bytes, thresholds=self.thresholds)

    def as_json(self, advice: RestartAdvice) -> dict[str, Any]:
        first = self.baseline[0] if self.baseline else None
        last = self.baseline[-1] if self.baseline else None
        return {
            "unloads": [e.as_json() for e in reversed(self.unloads)],  # newest first
            "baseline": {
                "samples": len(self.baseline),
                "start": None if first is None else {"mlx_active_bytes": first.mlx_active_bytes,
                                                     "rss_bytes": first.rss_bytes},
                "latest": None if last is None else {"mlx_active_bytes": last.mlx_active_bytes,
                                                     "rss_bytes": last.rss_bytes},
                "drift_bytes": advice.drift.mlx_active_bytes,
                "drift_pct": round(100 * advice.drift.fraction_of_cap, 3),
                "rss_drift_bytes": advice.drift.rss_bytes,
            },
            "restart": {"recommendation": advice.recommendation.value,
                        "reason": advice.reason.value if advice.reason else None,
                        "thresholds": {"drift_bytes": self.thresholds.drift_limit_bytes(self._figures()),
                                       "failed_settles": self.thresholds.failed_settles}},
        }


__all__ = ["MAX_BASELINE", "MAX_UNLOADS", "MemoryDiagnostics", "UnloadEvent"]
