"""The host's thermal state for ``heartbeat.system_metrics.thermal_state`` (nominal/fair/serious/critical).

macOS has two sources, and the sampler reports the worse of the two it can read:

* the system thermal pressure that ``thermald`` publishes as the notification
  ``com.apple.system.thermalpressurelevel``, read with ``notifyutil -g`` (no root). It is the only one
  that moves on Apple silicon. ``notifyutil`` prints ``<name> <level>`` (``"%s %llu\\n"``, or
  ``"<name>: <error>"`` when the lookup fails; Libnotify's ``notifyutil.c``); the levels are
  ``OSThermalNotification.h``'s on macOS: 0 Nominal, 1 Moderate, 2 Heavy, 3 Trapping, 4 Sleeping.
  Moderate → fair, Heavy → serious, Trapping and above → critical.
* ``pmset -g therm``, which on Intel Macs prints the CPU power status (``\\tCPU_Speed_Limit \\t= 62``):
  100 → nominal, ≥ 80 → fair, ≥ 50 → serious, lower → critical. On Apple silicon it only prints
  "Note: No CPU power status has been recorded" (``IOPMCopyCPUPowerStatus`` finds nothing there),
  which says nothing either way.

Linux has no equivalent of macOS's thermal pressure, so it is ``nominal``. Both commands run a process,
so they are sampled off the event loop at most every ``THERMAL_TTL_S``; ``state`` is the last reading
(nominal until one succeeds).
"""

from __future__ import annotations

import asyncio
import re
import sys
import time

from protocol import ThermalState
from provider.hostcmd import Runner, run_command

THERMAL_TTL_S = 30.0
PRESSURE_NOTIFICATION = "com.apple.system.thermalpressurelevel"
_SEVERITY = (ThermalState.NOMINAL, ThermalState.FAIR, ThermalState.SERIOUS, ThermalState.CRITICAL)


def parse_thermal_pressure(output: str | None) -> ThermalState | None:
    """``notifyutil -g com.apple.system.thermalpressurelevel``; None when the lookup failed."""
    match = re.fullmatch(rf"{re.escape(PRESSURE_NOTIFICATION)} (\d+)", (output or "").strip())
    if match is None:
        return None
    level = int(match.group(1))
    return _SEVERITY[min(level, len(_SEVERITY) - 1)]  # Trapping (3), Sleeping (4) and beyond: critical


def parse_pmset_therm(output: str | None) -> ThermalState | None:
    """``pmset -g therm``'s ``CPU_Speed_Limit``; None when it has none (Apple silicon, no record)."""
    match = re.search(r"CPU_Speed_Limit\s*=\s*(\d+)", output or "")
    if match is None:
        return None
    limit = int(match.group(1))
    if limit >= 100:
        return ThermalState.NOMINAL
    if limit >= 80:
        return ThermalState.FAIR
    if limit >= 50:
        return ThermalState.SERIOUS
    return ThermalState.CRITICAL


def worst(*states: ThermalState | None) -> ThermalState | None:
    """The most severe of the readings that succeeded; None when none did."""
    known = [s for s in states if s is not None]
    return max(known, key=_SEVERITY.index) if known else None


def read_thermal_state(run: Runner = run_command) -> ThermalState | None:
    """One reading of both macOS sources (blocking: two short commands)."""
    return worst(parse_thermal_pressure(run(["notifyutil", "-g", PRESSURE_NOTIFICATION])),
                 parse_pmset_therm(run(["pmset", "-g", "therm"])))


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
            reading = await asyncio.to_thread(read_thermal_state, self._run)
            if reading is not None:
                self.state = reading
        return self.state


__all__ = ["PRESSURE_NOTIFICATION", "THERMAL_TTL_S", "ThermalSampler", "parse_pmset_therm", "parse_thermal_pressure",
           "read_thermal_state", "worst"]
