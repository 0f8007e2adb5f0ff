"""The ``heartbeat`` frame, every ``heartbeat_interval_s`` (protocol.md §3.2, §9).

* ``status`` — ``serving`` iff a request is in flight, else ``idle``; ``draining`` while shutting down
  ([N] reads it; [A] ignores unknown statuses).
* ``active_model`` — the model of the most recently accepted request in flight, else null.
* ``stats`` — cumulative for the process (``ServingStats``), ints.
* ``warm_models`` — loaded models (from the model manager).
* ``system_metrics`` — ``memory_pressure`` = ``memory.pressure(snapshot).wire_value``; ``cpu_usage`` =
  psutil's system-wide ``cpu_percent(None)`` / 100 (non-blocking: the share since the previous call);
  ``thermal_state`` from ``ThermalSampler``.
* ``backend_capacity`` — from the model manager (slots, token budgets, MLX memory, ``free_for_load_gb``).

Thermal state: Linux has no equivalent of macOS's thermal pressure, so it is ``nominal``. On macOS
``pmset -g therm`` reports ``CPU_Speed_Limit``; 100 → nominal, ≥ 80 → fair, ≥ 50 → serious, lower →
critical. It runs a process, so it is sampled off the event loop at most every ``THERMAL_TTL_S``.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Callable, Sequence

import psutil

from memory import MemorySnapshot, pressure
from protocol import BackendCapacity, Heartbeat, HeartbeatStatus, SystemMetrics, ThermalState
from provider.jobs.stats import ServingStats
from provider.session.posture import Runner, run_command

THERMAL_TTL_S = 30.0


def parse_pmset_therm(output: str | None) -> ThermalState:
    match = re.search(r"CPU_Speed_Limit\s*=\s*(\d+)", output or "")
    if match is None:
        return ThermalState.NOMINAL
    limit = int(match.group(1))
    if limit >= 100:
        return ThermalState.NOMINAL
    if limit >= 80:
        return ThermalState.FAIR
    if limit >= 50:
        return ThermalState.SERIOUS
    return ThermalState.CRITICAL


class ThermalSampler:
    """The host's thermal state, refreshed off the loop; ``state`` is always the last reading."""

    def __init__(self, *, platform: str = sys.platform, run: Runner = run_command,
                 ttl_s: float = THERMAL_TTL_S) -> None:
        self._darwin = platform == "darwin"
        self._run = run
        self._ttl = ttl_s
        self._sampled_at = float("-inf")
        self.state = ThermalState.NOMINAL

    async def refresh(self) -> ThermalState:
        if self._darwin and time.monotonic() - self._sampled_at >= self._ttl:
            self._sampled_at = time.monotonic()
            output = await asyncio.to_thread(self._run, ["pmset", "-g", "therm"])
            self.state = parse_pmset_therm(output)
        return self.state


def _clamp01(value: float) -> float:
    return min(1.0, max(0.0, value))


class HeartbeatSource:
    """Builds heartbeat frames from the live state of the agent. Call on the event loop."""

    def __init__(
        self,
        *,
        stats: ServingStats,
        snapshot: Callable[[], MemorySnapshot],
        capacity: Callable[[], BackendCapacity | None],
        warm_models: Callable[[], Sequence[str]],
        thermal: ThermalSampler | None = None,
        cpu_percent: Callable[[], float] = lambda: psutil.cpu_percent(None),
    ) -> None:
        self._stats = stats
        self._snapshot = snapshot
        self._capacity = capacity
        self._warm = warm_models
        self.thermal = thermal or ThermalSampler()
        self._cpu = cpu_percent
        self._cpu()  # psutil's first non-blocking reading is meaningless: prime it

    def status(self, draining: bool) -> HeartbeatStatus:
        if draining:
            return HeartbeatStatus.DRAINING
        return HeartbeatStatus.SERVING if self._stats.serving else HeartbeatStatus.IDLE

    def system_metrics(self) -> SystemMetrics:
        return SystemMetrics(
            memory_pressure=pressure(self._snapshot()).wire_value,
            cpu_usage=_clamp01(float(self._cpu()) / 100.0),
            thermal_state=self.thermal.state.value,
        )

    def __call__(self, draining: bool = False) -> Heartbeat:
        return Heartbeat(
            status=self.status(draining).value,
            active_model=self._stats.active_model,
            stats=self._stats.wire(),
            warm_models=tuple(self._warm()),
            system_metrics=self.system_metrics(),
            backend_capacity=self._capacity(),
        )


__all__ = ["THERMAL_TTL_S", "HeartbeatSource", "ThermalSampler", "parse_pmset_therm"]
