"""Models whose load failed, remembered: `BrokenModels`.

A failed load (slots/loading.py) marks its model with the reason (provider/models/broken.py: from the
folder, never from an exception's text) and the folder's fingerprint. While the mark holds, the model
is not loaded again: admission answers every request for it `Failure.model_load_failed()` (a 404, the
same answer each time), it is left out of what is advertised to the coordinator and of `/v1/models`,
and `/status` (hence `models` and `doctor`) shows it with its reason. A mark holds until

* the folder changes (its fingerprint differs from the one taken after the failure): the operator
  fixed or replaced it, and the next request loads it at once; or
* its backoff passes: `FIRST_RETRY_S` after the first failure, doubling with each failure in a row
  of the same folder, up to `MAX_RETRY_S` (for a failure the folder does not explain).

A load that succeeds forgets the mark. Everything here runs on the event loop except `holds`, which
the intake may ask from the bulk lane's thread (it reads the marks and stats the folder).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from provider.models import ModelInfo
from provider.models.broken import BrokenReason, folder_fingerprint
from provider.telemetry import get_logger

log = get_logger("provider.slots")

FIRST_RETRY_S = 300.0
MAX_RETRY_S = 3600.0


@dataclass(frozen=True, slots=True)
class Broken:
    """One model's failed load, as remembered."""

    model_id: str
    reason: BrokenReason
    fingerprint: str  # the folder's, taken after the failure
    failures: int  # failed loads in a row of this folder
    retry_at: float  # the manager's clock: from then on a request may load it again
    since: float  # wall clock of the last failure (for people)

    def as_json(self, now: float) -> dict[str, Any]:
        return {"reason": self.reason.value, "failures": self.failures, "since": round(self.since, 3),
                "retry_in_s": round(max(0.0, self.retry_at - now), 1)}


def backoff_s(failures: int) -> float:
    """How long a model that failed `failures` loads in a row waits before the next."""
    return min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** max(0, failures - 1))


class BrokenModels:
    """The marks of one model manager. `clock` is the manager's; `fingerprint` reads a folder's."""

    def __init__(self, clock: Callable[[], float], *, wall_clock: Callable[[], float] = time.time,
                 fingerprint: Callable[[ModelInfo], str] = folder_fingerprint) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._fingerprint = fingerprint
        self._marks: dict[str, Broken] = {}

    def mark(self, info: ModelInfo, reason: BrokenReason, fingerprint: str) -> Broken:
        """Remember a failed load of `info` whose folder, after the failure, had `fingerprint`."""
        last = self._marks.get(info.id)
        failures = last.failures + 1 if last is not None and last.fingerprint == fingerprint else 1
        broken = Broken(info.id, reason, fingerprint, failures, self._clock() + backoff_s(failures),
                        self._wall_clock())
        self._marks[info.id] = broken
        log.warning("model_marked_broken", model=info.id, reason=reason.value, failures=failures,
                    retry_in_s=round(backoff_s(failures)))
        return broken

    def loaded(self, model_id: str) -> None:
        """The model loaded: whatever failed before is forgotten."""
        if self._marks.pop(model_id, None) is not None:
            log.info("model_mark_cleared", model=model_id)

    def holds(self, info: ModelInfo) -> Broken | None:
        """The model's mark while it holds (same folder, backoff not passed), else None."""
        broken = self._marks.get(info.id)
        if broken is None or self._clock() >= broken.retry_at:
            return None
        return broken if self._fingerprint(info) == broken.fingerprint else None

    def holding(self, models: Iterable[ModelInfo]) -> frozenset[str]:
        """The ids among `models` whose marks hold (a stat of the folder for each one marked)."""
        return frozenset(m.id for m in models if m.id in self._marks and self.holds(m) is not None)

    def as_json(self, models: Iterable[ModelInfo]) -> dict[str, dict[str, Any]]:
        """`/status`'s `models_broken`: each model whose mark holds, with its reason and when it is
        tried again at the latest (sooner if its folder changes)."""
        now = self._clock()
        return {m.id: broken.as_json(now) for m in models if (broken := self.holds(m)) is not None}


__all__ = ["FIRST_RETRY_S", "MAX_RETRY_S", "Broken", "BrokenModels", "backoff_s"]
