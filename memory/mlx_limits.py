"""MLX's own memory settings, from the cap figures: the memory limit, the buffer-cache limit and the
ceiling of the wired limit. Pure: the engine applies them on the thread that owns MLX.

* memory limit = the effective cap. MLX's allocator treats it as a guideline: past it, it first
  releases cached buffers and waits for scheduled work before allocating more (on Metal the default is
  1.5 × the recommended working set, far above our cap). Never raised above a stricter limit already
  in force.
* cache limit = min(0.75 × memory limit, 8 GiB), never above the limit already in force. On Metal the
  default lets the cache keep freed buffers up to the memory limit; Darkbloom's Swift provider caps it
  this way after seeing tens of GB held for a ~21 GB model. On CPU the default is 32 MiB and stays.
* wired limit ≤ min(the device's recommended working set, memory limit). mlx-lm wires the recommended
  size per `BatchGenerator` and restores the previous value on `close()`, which with one generator per
  model unwires a model that is still serving; the engine owns it instead (`provider/engine/device.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from memory.policy import CapFigures, GiB

CACHE_LIMIT_FRACTION = 0.75
CACHE_LIMIT_CEILING_BYTES = 8 * GiB


@dataclass(frozen=True, slots=True)
class MlxLimits:
    memory_limit_bytes: int  # mx.set_memory_limit
    cache_limit_bytes: int  # mx.set_cache_limit (at most)


def mlx_limits(figures: CapFigures) -> MlxLimits | None:
    """The limits for these figures; None when the cap leaves nothing (no model can load anyway)."""
    memory = figures.effective_cap_bytes
    if memory <= 0:
        return None
    return MlxLimits(memory_limit_bytes=memory,
                     cache_limit_bytes=min(int(memory * CACHE_LIMIT_FRACTION), CACHE_LIMIT_CEILING_BYTES))


def tighter(limit: int, current: int) -> int:
    """`limit`, unless the limit in force is already stricter (MLX: 0 means no cache at all)."""
    return min(limit, current)


def wired_limit(limits: MlxLimits | None, recommended_bytes: int | None) -> int | None:
    """The wired limit while a model is resident: the device's recommended working set, never above the
    memory limit; None when the device has no such figure (CPU: there is nothing to wire)."""
    if recommended_bytes is None or recommended_bytes <= 0:
        return None
    return recommended_bytes if limits is None else min(recommended_bytes, limits.memory_limit_bytes)


__all__ = ["CACHE_LIMIT_CEILING_BYTES", "CACHE_LIMIT_FRACTION", "MlxLimits", "mlx_limits", "tighter", "wired_limit"]
