"""What the model manager reports: fit verdicts (register, doctor), heartbeat capacity, residency and
the restart verdict (`Reporter`, handed the manager's shared state, slots/shared.py; everything here
reads, nothing allocates)."""

from __future__ import annotations

from collections.abc import Callable

from memory import (
    FitResult,
    fit,
    free_for_load_bytes,
    pressure,
)
from memory.diagnostics import RestartAdvice
from protocol.vocab import SlotState
from provider.models import ALLOC_STEP, ModelInfo
from provider.slots.admission import ManagerView, tokens_for_bytes
from provider.slots.capacity import CapacityReport, SlotCapacity, max_concurrency
from provider.slots.diagnostics import MemoryDiagnostics
from provider.slots.rates import RateBook
from provider.slots.shared import ManagerState
from provider.slots.state import ModelState


class Reporter:
    """Read-only figures of the manager's models. `view()` is the manager's (what the pure
    decisions read)."""

    def __init__(self, state: ManagerState, diagnostics: MemoryDiagnostics, rates: RateBook, *,
                 view: Callable[[], ManagerView]) -> None:
        self._s = state
        self._diagnostics = diagnostics
        self._rates = rates
        self._view = view

    def resident_bytes(self, model_id: str) -> int:
        slot = self._s.slots.get(model_id)
        return slot.resident_bytes if slot is not None else 0

    def idle_seconds(self, model_id: str) -> float | None:
        """How long a loaded model has served nothing (`ps`); None while it is busy or not loaded."""
        slot = self._s.slots.get(model_id)
        if slot is None or slot.state is not ModelState.LOADED or slot.busy(self._s.engine.stats(model_id)):
            return None
        return max(0.0, self._s.clock() - slot.last_used)

    def warm_models(self) -> list[str]:
        return [s.model_id for s in self._s.slots.values() if s.state is ModelState.LOADED]

    def evictable_bytes(self, *, also: str | None = None) -> int:
        return sum(s.resident_bytes for s in self._s.slots.values()
                   if s.view(self._s.engine.stats(s.model_id)).idle or (also == s.model_id and s.loaded))

    def restart_advice(self) -> RestartAdvice:
        """memory.diagnostics' verdict: the baseline's drift against the largest model advertised here."""
        largest = max((v.required_bytes for _, v in self.verdicts() if v.ever_fits), default=0)
        return self._diagnostics.advice(largest)

    def verdicts(self) -> list[tuple[ModelInfo, FitResult]]:
        """Fit verdict per inventory model (register, doctor): could it load here now, or after
        evicting idle models? A resident model is judged as if it were reloaded."""
        snap = self._s.probe.recent()
        outstanding = self._view().firm_outstanding_bytes
        return [(s.info, fit(self._s.figures, snap, s.info.weight_bytes,
                             evictable_bytes=self.evictable_bytes(also=s.model_id),
                             outstanding_bytes=outstanding, activation_reserve_bytes=s.info.activation_reserve_bytes))
                for s in self._s.slots.values()]

    def register_rates(self) -> tuple[float, float]:
        """register's (prefill_tps, decode_tps): the largest loaded model's (the slowest here), served
        rates when measured, else its calibration at load. With nothing loaded, the largest model's
        that was measured since the start (a cold provider is priced on them: an older coordinator reads
        decode_tps only in register); zeros when none was."""
        loaded = [s for s in self._s.slots.values() if s.state is ModelState.LOADED]
        measured = loaded or [s for s in self._s.slots.values() if self._rates.decode_tps(s.model_id) > 0]
        if not measured:
            return 0.0, 0.0
        largest = max(measured, key=lambda s: (s.info.weight_bytes, s.model_id)).model_id
        return self._rates.prefill_tps(largest), self._rates.decode_tps(largest)

    def models_with_room(self) -> frozenset[str]:
        """Loaded models that could take one more request of one KV block now: a place in the batch
        and a block of KV in the ledger."""
        view = self._view()
        available = self._s.figures.available_bytes(self._s.probe.recent(), view.firm_outstanding_bytes)
        return frozenset(m for m, s in view.slots.items()
                         if s.state is ModelState.LOADED and s.kv.members < view.batch_size
                         and tokens_for_bytes(self._s.slots[m].info, available) >= ALLOC_STEP)

    def available_tokens(self, model_id: str) -> int:
        """Whole KV blocks of this model the ledger could still give a request now (a quote's budget)."""
        slot = self._s.slots.get(model_id)
        if slot is None:
            return 0
        available = self._s.figures.available_bytes(self._s.probe.recent(), self._view().firm_outstanding_bytes)
        return tokens_for_bytes(slot.info, available)

    def capacity(self) -> CapacityReport:
        """The heartbeat's `backend_capacity` figures, from one snapshot."""
        snap = self._s.probe.recent()
        figures = self._s.figures
        ledger = self._s.ledger.snapshot()
        firm = self._view().firm_outstanding_bytes  # the prefix cache gives way to requests and loads
        available = figures.available_bytes(snap, firm)
        slots = []
        for slot in self._s.slots.values():
            if slot.state not in (ModelState.LOADED, ModelState.LOADING):
                continue
            stats = self._s.engine.stats(slot.model_id)
            holds = slot.reservations()
            used = sum(h.tokens for h in holds)
            budget_max = used + tokens_for_bytes(slot.info, available)
            slots.append(SlotCapacity(
                model=slot.model_id,
                state=SlotState.RUNNING if slot.state is ModelState.LOADED else SlotState.RELOADING,
                num_running=stats.num_running if stats else 0,
                num_waiting=stats.num_waiting if stats else 0,
                active_tokens=stats.active_tokens if stats else 0,
                max_tokens_potential=sum(h.max_tokens for h in holds),
                max_concurrency=min(self._s.engine.batch_size, max_concurrency(budget_max, slot.info.context_length)),
                kv_bytes_per_token=slot.info.kv_bytes_per_token,
                active_token_budget_used=used,
                active_token_budget_max=budget_max,
                model_load_time_ms=round(slot.loaded.load_seconds * 1000) if slot.loaded else None,
            ))
        return CapacityReport(
            slots=tuple(slots), mlx_active_bytes=snap.mlx_active_bytes, mlx_peak_bytes=snap.mlx_peak_bytes,
            mlx_cache_bytes=snap.mlx_cache_bytes, total_memory_bytes=snap.physical_bytes,
            free_for_load_bytes=free_for_load_bytes(figures, snap, evictable_bytes=self.evictable_bytes(),
                                                    outstanding_bytes=firm),
            available_bytes=available, pressure=pressure(snap), ledger=ledger, device_memory=snap.device_memory,
            host_physical_bytes=snap.host_physical_bytes, host_available_bytes=snap.host_available_bytes)
