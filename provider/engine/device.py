"""MLX's process-wide memory settings, owned by the engine thread.

`memory.mlx_limits` says what they should be; this applies them with the MLX calls, on the thread
that owns MLX, and puts back what it found when the engine stops:

* at start: the memory limit and the buffer-cache limit (each only ever tightened);
* the wired limit while any model is resident. mlx-lm's `BatchGenerator` wires the device's
  recommended size when it is created and restores the *previous* value on `close()`; with one
  generator per model, closing model A's generator while B serves would restore whatever was in
  force before A (0: nothing wired). So the engine wires its own limit before a generator is built
  (the generator then records the engine's value as the one to restore), sets it again right after
  (the generator has just set its own), and restores the original when the last model leaves.

On CPU `device_info()` has no `max_recommended_working_set_size` and `set_wired_limit` does nothing:
the wired limit is left alone. A limit MLX refuses (above the system's `iogpu.wired_limit_mb`, say)
is logged and skipped: serving without it is slower, not unsafe.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx

from memory.mlx_limits import MlxLimits, tighter, wired_limit
from provider.telemetry import get_logger

log = get_logger("provider.engine")


class DeviceLimits:
    """Applies `MlxLimits` and owns the wired limit. Call every method on the engine thread."""

    def __init__(self, limits: MlxLimits | None, *, mlx: ModuleType = mx) -> None:
        self._limits = limits
        self._mx = mlx
        self._restore_memory: int | None = None
        self._restore_cache: int | None = None
        self._restore_wired: int | None = None  # set while we hold the wired limit

    # -- memory and cache limits, for the engine's lifetime -----------------------------------

    def start(self) -> None:
        if self._limits is None:
            return
        previous = self._mx.set_memory_limit(self._limits.memory_limit_bytes)
        self._restore_memory = previous
        if tighter(self._limits.memory_limit_bytes, previous) != self._limits.memory_limit_bytes:
            self._mx.set_memory_limit(previous)  # a stricter limit was already in force: keep it
        previous = self._mx.set_cache_limit(self._limits.cache_limit_bytes)
        self._restore_cache = previous
        if tighter(self._limits.cache_limit_bytes, previous) != self._limits.cache_limit_bytes:
            self._mx.set_cache_limit(previous)  # CPU's 32 MiB default is already below the cap

    def stop(self) -> None:
        self.unwire()
        if self._restore_cache is not None:
            self._mx.set_cache_limit(self._restore_cache)
            self._restore_cache = None
        if self._restore_memory is not None:
            self._mx.set_memory_limit(self._restore_memory)
            self._restore_memory = None

    # -- the wired limit, while models are resident --------------------------------------------

    @property
    def wired_target(self) -> int | None:
        """The wired limit the engine holds while a model is resident (None: nothing to wire)."""
        info = self._mx.device_info()
        recommended = info.get("max_recommended_working_set_size") if isinstance(info, dict) else None
        return wired_limit(self._limits, int(recommended) if recommended else None)

    def wire(self) -> None:
        """Hold the engine's wired limit (again). Before and after building a `BatchGenerator`."""
        target = self.wired_target
        if target is None:
            return
        try:
            previous = self._mx.set_wired_limit(target)
        except (RuntimeError, ValueError):
            log.warning("wired_limit_refused", figure=target)
            return
        if self._restore_wired is None:
            self._restore_wired = previous

    def unwire(self) -> None:
        """The last model has left: put back the wired limit found before the first one came."""
        if self._restore_wired is None:
            return
        try:
            self._mx.set_wired_limit(self._restore_wired)
        except (RuntimeError, ValueError):
            log.warning("wired_limit_restore_refused", figure=self._restore_wired)
        self._restore_wired = None


__all__ = ["DeviceLimits"]
