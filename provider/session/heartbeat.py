"""The ``heartbeat`` frame, every ``heartbeat_interval_s``.

* ``status`` — ``serving`` iff a request is in flight, else ``idle``; ``draining`` while shutting down
  and while the owner's Mac is paused (provider/guest: outside its serving windows, in use, on
  battery, hot) — [N] then routes elsewhere until an ``idle``/``serving`` heartbeat; [A] ignores
  statuses it does not know and reroutes on the 503 ``draining`` each request gets.
* ``active_model`` — the model of the most recently accepted request in flight, else null.
* ``stats`` — cumulative for the process (``ServingStats``), ints.
* ``warm_models`` — loaded models (from the model manager).
* ``system_metrics`` — ``memory_pressure`` = ``memory.pressure(snapshot).wire_value`` (the report's); ``cpu_usage`` =
  psutil's system-wide ``cpu_percent(None)`` / 100 (non-blocking: the share since the previous call);
  ``thermal_state`` from ``ThermalSampler`` (``session/thermal.py``).
* ``backend_capacity`` — from the model manager (slots, token budgets, MLX memory, ``free_for_load_gb``).
  ``total_memory_gb`` and ``gpu_memory_*_gb`` are the memory MLX allocates from; ``telemetry.memory``
  says which (``device``: ``unified``, the machine's RAM; ``discrete``, a GPU's own memory, with the
  host's RAM beside it as ``host_total_gb`` / ``host_available_gb``). Each slot carries its measured
  ``observed_prefill_tps`` / ``observed_decode_tps`` and, in ``performance_measurements``, their sample
  counts and ages (``provider.slots.rates``). ``capacity_seq`` numbers every snapshot (1, 2, …) when the
  agent answers ``capacity_probe`` (a quote names the snapshot it was computed beside).
"""

from __future__ import annotations

from collections.abc import Callable

import psutil

from memory.policy import GiB
from protocol import BackendCapacity, BackendSlotCapacity, Heartbeat, HeartbeatStatus, SystemMetrics
from provider.jobs.stats import ServingStats
from provider.session.thermal import THERMAL_TTL_S, ThermalSampler
from provider.slots import CapacityReport
from provider.slots.rates import RateBook

MAX_TOKENS_POTENTIAL = 1_000_000  # the coordinator clamps to this; we never send more


def backend_capacity(report: CapacityReport, *, rates: RateBook | None = None,
                     capacity_seq: int = 0) -> BackendCapacity:
    """The manager's report in wire units: GB floats, token and request counts as ints. Loaded models
    are ``running`` (what [A] counts as warm), loading ones ``reloading``. ``rates``: each slot's
    measured ``observed_*_tps`` and their ages (``performance_measurements``). ``capacity_seq`` > 0
    says we answer ``capacity_probe``; 0 leaves it absent."""
    observed = {s.model: rates.observed(s.model) for s in report.slots} if rates is not None else {}
    return BackendCapacity(
        slots=tuple(
            BackendSlotCapacity(
                model=s.model,
                state=s.state.value,
                num_running=s.num_running,
                num_waiting=s.num_waiting,
                active_tokens=s.active_tokens,
                max_tokens_potential=min(s.max_tokens_potential, MAX_TOKENS_POTENTIAL),
                max_concurrency=s.max_concurrency,
                kv_bytes_per_token=s.kv_bytes_per_token,
                active_token_budget_used=s.active_token_budget_used,
                active_token_budget_max=s.active_token_budget_max,
                model_load_time_ms=s.model_load_time_ms or 0,
                observed_prefill_tps=observed.get(s.model, (0.0, 0.0))[0],
                observed_decode_tps=observed.get(s.model, (0.0, 0.0))[1],
                performance_measurements=rates.measurements(s.model) if rates is not None else None,
            )
            for s in report.slots
        ),
        gpu_memory_active_gb=_gb(report.mlx_active_bytes),
        gpu_memory_peak_gb=_gb(report.mlx_peak_bytes),
        gpu_memory_cache_gb=_gb(report.mlx_cache_bytes),
        total_memory_gb=_gb(report.total_memory_bytes),
        free_for_load_gb=_gb(report.free_for_load_bytes),
        capacity_seq=capacity_seq,
        telemetry={"memory": memory_kind(report)},
    )


def memory_kind(report: CapacityReport) -> dict[str, object]:
    """Which memory the capacity figures are of (and, on a discrete GPU, the host's RAM beside it)."""
    kind: dict[str, object] = {"device": report.device_memory.value}
    if report.host_physical_bytes is not None:
        kind["host_total_gb"] = _gb(report.host_physical_bytes)
        kind["host_available_gb"] = _gb(report.host_available_bytes or 0)
    return kind


def _gb(nbytes: int) -> float:
    return round(nbytes / GiB, 4)


def _clamp01(value: float) -> float:
    return min(1.0, max(0.0, value))


class HeartbeatSource:
    """Builds heartbeat frames from the live state of the agent. Call on the event loop."""

    def __init__(
        self,
        *,
        stats: ServingStats,
        capacity: Callable[[], CapacityReport],
        thermal: ThermalSampler | None = None,
        cpu_percent: Callable[[], float] = lambda: psutil.cpu_percent(None),
        paused: Callable[[], bool] = lambda: False,
        rates: RateBook | None = None,
        quoting: bool = False,
    ) -> None:
        self._stats = stats
        self._rates = rates
        self._quoting = quoting
        self.capacity_seq = 0  # the newest snapshot's sequence number (> 0 once quoting)
        self._paused = paused
        self._capacity = capacity
        self.thermal = thermal or ThermalSampler()
        self._cpu = cpu_percent
        self._cpu()  # psutil's first non-blocking reading is meaningless: prime it

    def status(self, draining: bool) -> HeartbeatStatus:
        if draining or self._paused():
            return HeartbeatStatus.DRAINING
        return HeartbeatStatus.SERVING if self._stats.serving else HeartbeatStatus.IDLE

    def __call__(self, draining: bool = False) -> Heartbeat:
        report = self._capacity()
        if self._quoting:  # every snapshot a new number: the coordinator drops stale or reordered ones
            self.capacity_seq += 1
        return Heartbeat(
            status=self.status(draining).value,
            active_model=self._stats.active_model,
            stats=self._stats.wire(),
            warm_models=report.warm_models,
            system_metrics=SystemMetrics(
                memory_pressure=report.pressure.wire_value,
                cpu_usage=_clamp01(float(self._cpu()) / 100.0),
                thermal_state=self.thermal.state.value,
            ),
            backend_capacity=backend_capacity(report, rates=self._rates, capacity_seq=self.capacity_seq),
        )


__all__ = ["MAX_TOKENS_POTENTIAL", "THERMAL_TTL_S", "HeartbeatSource", "ThermalSampler", "backend_capacity"]
