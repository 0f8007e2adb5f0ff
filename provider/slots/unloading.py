"""Unloading and the idle reaper: `Unloader`, the model manager's part that gives memory back
(handed the manager's shared state, slots/shared.py).

The engine stops the model (its requests fail, their KV is released from the engine thread), its KV
is purged (`kv_purge`, the prefix cache's purge by default), gc + `mx.clear_cache()` + glibc
`malloc_trim(0)` (`memory.settle.reclaim`), then the settle barrier; freed bytes and settle time
are logged, kept for /status (`diagnostics`) and followed by a no-model baseline sample.
Idle models are evicted only when still idle at the moment (plans may be stale after an await);
kept-warm (preloaded) models are left to memory pressure and the slot cap.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

from memory import (
    PressureLevel,
    ReservationKind,
    pressure,
    settle,
)
from provider.engine import EngineError, EngineFailure
from provider.metrics import EvictionCause
from provider.slots.diagnostics import MemoryDiagnostics, UnloadEvent
from provider.slots.shared import ManagerState
from provider.slots.state import ModelSlot, ModelState, log

KvPurge = Callable[[str], Awaitable[None]]


@dataclasses.dataclass(frozen=True, slots=True)
class UnloadReport:
    """What one unload freed and how long memory took to settle (also logged as `model_unloaded`)."""

    model_id: str
    cause: EvictionCause
    resident_bytes: int
    freed_bytes: int
    settled: bool
    settle_seconds: float
    total_seconds: float


class Unloader:
    """Unloads, the idle reaper, draining and shutdown, over the manager's shared state.

    `kv_purge(model_id)` drops a model's KV after its unload (the prefix cache's purge by default);
    `on_resident_change()` is the manager's: a model was published or unloaded."""

    def __init__(self, state: ManagerState, diagnostics: MemoryDiagnostics, *, kv_purge: KvPurge | None,
                 settle_timeout_s: float, idle_timeout_s: float | None,
                 on_resident_change: Callable[[], None]) -> None:
        self._s = state
        self._diagnostics = diagnostics
        self._kv_purge = kv_purge
        self._settle_s = settle_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._on_resident_change = on_resident_change
        self._kept_warm: set[str] = set()  # preloaded: the idle reaper leaves them resident
        self.last_unload: UnloadReport | None = None  # the most recent unload's figures
        self.baseline_listeners: list[Callable[[], None]] = []  # called on the loop after each baseline sample

    async def evict_if_idle(self, model_id: str, cause: EvictionCause) -> bool:
        """Unload `model_id` if it is still idle now (the plan may be stale after an await)."""
        slot = self._s.slots[model_id]
        if not slot.view(self._s.engine.stats(model_id)).idle:
            return False
        await self.unload_slot(slot, cause)
        return True

    def start_unload(self, slot: ModelSlot, cause: EvictionCause) -> asyncio.Task:
        """UNLOADING from this step on (its memory counts as leaving); the unload runs as a task."""
        slot.state = ModelState.UNLOADING
        slot.unload_task = asyncio.create_task(self._unload(slot, cause), name=f"unload:{slot.model_id}")
        return slot.unload_task

    async def unload_slot(self, slot: ModelSlot, cause: EvictionCause) -> None:
        await asyncio.shield(self.start_unload(slot, cause))

    async def _unload(self, slot: ModelSlot, cause: EvictionCause) -> None:
        model_id = slot.model_id
        resident = slot.resident_bytes
        started = self._s.clock()
        active_before = self._s.probe.snapshot().mlx_active_bytes
        try:
            try:
                await self._s.engine.unload(model_id)  # fails its requests; their KV is released
            except EngineError as exc:
                if exc.code is not EngineFailure.MODEL_NOT_LOADED:
                    log.error("model_unload_failed", model=model_id, code=exc.code)
            # engine.unload ran gc + mx.clear_cache() + malloc_trim(0) on its thread; a purge drops
            # more buffers (the model's prefix cache), so it is followed by one more round.
            if self._kv_purge is not None:
                try:
                    await self._kv_purge(model_id)
                except Exception as exc:  # an edge: the unload must finish; the startup sweep cleans up
                    log.error("kv_purge_failed", model=model_id, exc_type=type(exc).__name__)
                await self._s.engine.reclaim()
            result = await asyncio.to_thread(settle, resident_bytes=resident, active_before_bytes=active_before,
                                             timeout_s=self._settle_s, reclaim=self._s.engine.reclaim_blocking)
        finally:
            slot.loaded = None
            slot.state = ModelState.NOT_LOADED
            self._on_resident_change()
        report = UnloadReport(model_id, cause, resident, result.freed_bytes, result.settled, result.seconds,
                              self._s.clock() - started)
        self.last_unload = report
        self._diagnostics.unloaded(UnloadEvent(time.time(), model_id, str(cause), resident, result.freed_bytes,
                                              result.settled, result.seconds))
        if result.settled:
            await self._sample_baseline()
        if self._s.metrics is not None:
            self._s.metrics.model_evicted(cause)
            self._s.metrics.settled(result.seconds)
        log.info("model_unloaded", model=model_id, cause=cause, resident_bytes=resident,
                 freed_bytes=result.freed_bytes, settle_s=round(result.seconds, 3),
                 outcome="settled" if result.settled else "unsettled", total_s=round(report.total_seconds, 3))

    async def unload(self, model_id: str, *, cause: EvictionCause = EvictionCause.IDLE) -> bool:
        """Unload an idle model now. False if it is not loaded or is busy (never evicted then)."""
        async with self._s.room_lock:
            slot = self._s.slots.get(model_id)
            if slot is None or slot.state is not ModelState.LOADED:
                return False
            return await self.evict_if_idle(model_id, cause)

    def keep_warm(self, model_id: str) -> None:
        """Exempt a model from the idle reaper (a preloaded model). Memory pressure and the slot cap
        can still evict it, as any idle model."""
        self._kept_warm.add(model_id)

    @property
    def kept_warm(self) -> frozenset[str]:
        return frozenset(self._kept_warm)

    async def reap_idle(self) -> list[str]:
        """Unload every model idle for `idle_timeout_s` or more, except those kept warm; returns their ids."""
        snap = self._s.probe.snapshot()
        if snap.reclaimable_bytes and pressure(snap).level >= PressureLevel.RED:
            await self._s.engine.reclaim()  # MLX's buffer cache goes before the prefix tier (memory/snapshot.py)
            snap = self._s.probe.snapshot()
        self._s.prefix.relieve(pressure(snap).level)
        if self._idle_timeout_s is None:
            return []
        now = self._s.clock()
        stale = [s.model_id for s in self._s.slots.values() if s.model_id not in self._kept_warm
                 and s.view(self._s.engine.stats(s.model_id)).idle and now - s.last_used >= self._idle_timeout_s]
        reaped = []
        async with self._s.room_lock:
            for model_id in stale:
                slot = self._s.slots[model_id]
                if self._s.clock() - slot.last_used >= self._idle_timeout_s and \
                        await self.evict_if_idle(model_id, EvictionCause.IDLE):
                    reaped.append(model_id)
        return reaped

    async def run_idle_reaper(self, interval_s: float | None = None) -> None:
        """Call `reap_idle` periodically until cancelled (a session task); each tick also relieves
        the prefix cache under RED pressure. Returns at once when there is nothing to do."""
        if self._idle_timeout_s is None and not self._s.prefix.enabled:
            return
        idle = self._idle_timeout_s if self._idle_timeout_s is not None else 240.0  # prefix relief only
        period = interval_s if interval_s is not None else min(60.0, max(1.0, idle / 4))
        while True:
            await asyncio.sleep(period)  # a real period, not synchronisation
            await self.reap_idle()

    def start_draining(self) -> None:
        """Refuse every new request (503 draining) and every new load; in-flight ones continue."""
        if not self._s.draining:
            self._s.draining = True
            log.info("slots_draining")

    async def unload_all(self) -> None:
        """Shutdown: drain, let loads in progress finish (and be undone), unload every model.
        Requests still running fail with MODEL_UNLOADED; the engine releases their KV."""
        self.start_draining()
        loading = [s.load_task for s in self._s.slots.values() if s.load_task is not None and not s.load_task.done()]
        await asyncio.gather(*(asyncio.shield(t) for t in loading), return_exceptions=True)
        async with self._s.room_lock:
            for slot in self._s.slots.values():
                if slot.state is ModelState.UNLOADING and slot.unload_task is not None:
                    await asyncio.shield(slot.unload_task)
                if slot.state is ModelState.LOADED:
                    await self.unload_slot(slot, EvictionCause.SHUTDOWN)

    async def _sample_baseline(self) -> None:
        """After a full settle: the no-model baseline. With nothing resident it is MLX's active memory;
        with models still resident, what is left of it once their measured weights, the KV their
        batches hold (read on the engine thread with the active figure, between two steps) and the
        RAM prefix cache are taken out. Skipped while a load is under way (its weights are half in)."""
        if any(s.state in (ModelState.LOADING, ModelState.UNLOADING) for s in self._s.slots.values()):
            return
        try:
            active, batch_kv = await self._s.engine.memory_reading()
        except EngineError:
            return
        weights = sum(s.resident_bytes for s in self._s.slots.values() if s.state is ModelState.LOADED)
        prefix = self._s.ledger.snapshot().bytes_by_kind[ReservationKind.PREFIX_CACHE]
        snap = self._s.probe.snapshot()
        baseline = max(0, active - weights - batch_kv - prefix)
        self._diagnostics.sample(dataclasses.replace(snap, mlx_active_bytes=baseline))
        for listener in list(self.baseline_listeners):
            listener()
