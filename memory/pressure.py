"""Pressure watermarks of projected utilization.

    u = (mlx_used + unattributed + incoming + overhead) / P

The process's bytes outside MLX and the ledger (`unattributed`, memory/snapshot.py) are used memory
too: growth nobody foresaw raises the level. `mlx_used` counts MLX's buffer cache, as every other figure
does (the one rule in
`memory/snapshot.py`; an earlier version discounted the cache here while the cap math counted it, so the
heartbeat's pressure disagreed with admission). The cache is reclaimable all the same: the model manager clears
it before it evicts for pressure, and decides again.
GREEN < 65 % ≤ YELLOW < 80 % ≤ RED < 90 % ≤ FATAL. YELLOW or worse before a load means: evict idle
models one at a time, re-checking after each. Heartbeats report `utilization` clamped to [0, 1]
(`system_metrics.memory_pressure`); `doctor` prints the level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

from memory.snapshot import MemorySnapshot

YELLOW_AT = 0.65
RED_AT = 0.80
FATAL_AT = 0.90


class PressureLevel(IntEnum):
    GREEN = 0
    YELLOW = 1
    RED = 2
    FATAL = 3


@dataclass(frozen=True, slots=True)
class Pressure:
    level: PressureLevel
    utilization: float  # projected, unclamped (can exceed 1)

    @property
    def wire_value(self) -> float:
        """`system_metrics.memory_pressure`: utilization clamped to [0, 1]."""
        return min(1.0, max(0.0, self.utilization))

    @property
    def evict_before_load(self) -> bool:
        return self.level >= PressureLevel.YELLOW


def pressure_thresholds() -> tuple[float, float, float]:
    """Where YELLOW, RED and FATAL begin (fractions of physical memory)."""
    return YELLOW_AT, RED_AT, FATAL_AT


def level_for(utilization: float) -> PressureLevel:
    """Map a utilization fraction to its watermark (NaN counts as FATAL: unknown is not safe)."""
    if math.isnan(utilization) or utilization >= FATAL_AT:
        return PressureLevel.FATAL
    if utilization >= RED_AT:
        return PressureLevel.RED
    if utilization >= YELLOW_AT:
        return PressureLevel.YELLOW
    return PressureLevel.GREEN


def projected_utilization(snapshot: MemorySnapshot, *, incoming_bytes: int = 0, overhead_bytes: int = 0) -> float:
    """`(mlx_used + unattributed + incoming + overhead) / P`; 1.0 when `P` is 0."""
    if snapshot.physical_bytes <= 0:
        return 1.0
    used = snapshot.counted_bytes + max(0, incoming_bytes) + max(0, overhead_bytes)
    return used / snapshot.physical_bytes


def pressure(snapshot: MemorySnapshot, *, incoming_bytes: int = 0, overhead_bytes: int = 0) -> Pressure:
    """The watermark for `snapshot`, projecting a load of `incoming_bytes` (+ its runtime overhead)."""
    u = projected_utilization(snapshot, incoming_bytes=incoming_bytes, overhead_bytes=overhead_bytes)
    return Pressure(level_for(u), u)
