"""`doctor`'s section on the owner's Mac: the serving windows, whether one is open now and the
next change, and the current reading of every signal the pause rules can use — read even when its rule
is off, so the owner can see what turning it on would do.

A rule whose signal cannot be read on this machine is a WARNING (``signal_unavailable``: the agent
serves as if the signal said "go"); e.g. ``pause_when_active_mins`` on a Linux service that cannot reach
the desktop session.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo
from typing import Any

from protocol import ThermalState
from provider.config import Settings
from provider.guest.availability import Availability, Paused, Rules, Signals, availability, next_window_change
from provider.guest.monitor import utc_now
from provider.guest.readers import Reading, Source, read_idle_seconds, read_on_battery
from provider.guest.windows import is_open
from provider.guest.zone import rules_from_settings, zone_name


@dataclass(frozen=True, slots=True)
class GuestReport:
    rules: Rules
    now: datetime
    idle: Reading
    power: Reading
    thermal: ThermalState
    state: Availability  # what the agent would decide now, with the rules as set

    @property
    def window_open(self) -> bool:
        return is_open(self.now, self.rules.windows, self.rules.zone)

    @property
    def next_change(self) -> datetime | None:
        return next_window_change(self.now, self.rules)

    def unreadable(self) -> list[tuple[str, str]]:
        """(setting, source) for each rule that is on but whose signal cannot be read here."""
        found = []
        if self.rules.pause_when_active_s and self.idle.value is None:
            found.append(("pause_when_active_mins", self.idle.source.value))
        if self.rules.pause_on_battery and self.power.value is None:
            found.append(("pause_on_battery", self.power.source.value))
        return found


def _thermal_now() -> ThermalState:
    """The heartbeat's own reading, taken here without an event loop (doctor may run inside one)."""
    from provider.session.thermal import read_thermal_state

    return (read_thermal_state() if sys.platform == "darwin" else None) or ThermalState.NOMINAL


def gather_guest(settings: Settings, *, now: datetime | None = None, zone: tzinfo | None = None,
                 read_idle: Callable[[], Reading] = read_idle_seconds,
                 read_power: Callable[[], Reading] = read_on_battery,
                 read_thermal: Callable[[], ThermalState] = _thermal_now) -> GuestReport:
    """Read every signal once (blocking: runs ioreg/pmset or reads sysfs)."""
    rules = rules_from_settings(settings, zone=zone)
    now = now or utc_now()
    idle, power, thermal = read_idle(), read_power(), read_thermal()
    seconds = idle.value if isinstance(idle.value, float | int) and not isinstance(idle.value, bool) else None
    signals = Signals(last_input_at=None if seconds is None else now - timedelta(seconds=seconds),
                      on_battery=power.value if isinstance(power.value, bool) else None, thermal=thermal)
    return GuestReport(rules, now, idle, power, thermal, availability(now, signals, rules))


def _local(at: datetime | None, zone: tzinfo) -> str | None:
    return None if at is None else at.astimezone(zone).strftime("%a %Y-%m-%d %H:%M %Z")


def guest_json(report: GuestReport) -> dict[str, Any]:
    r, state = report.rules, report.state
    change = report.next_change
    return {
        "windows": [w.text for w in r.windows],
        "timezone": zone_name(r.zone),
        "window_open": report.window_open,
        "next_window_change": None if change is None else change.timestamp(),
        "next_window_change_local": _local(change, r.zone),
        "state": "paused" if isinstance(state, Paused) else "available",
        "reason": state.reason.value if isinstance(state, Paused) else None,
        "retry_after_s": state.retry_after_s if isinstance(state, Paused) else None,
        "signals": {
            "idle_s": report.idle.value, "idle_source": report.idle.source.value,
            "on_battery": report.power.value, "power_source": report.power.source.value,
            "thermal": report.thermal.value,
        },
        "rules": {"pause_when_active_s": r.pause_when_active_s, "pause_on_battery": r.pause_on_battery,
                  "pause_on_thermal": r.pause_on_thermal},
    }


def _unread(reading: Reading) -> str:
    if reading.source is Source.UNREADABLE:
        return "unreadable (the command answered something else)"
    return "unavailable (nothing on this machine answers: no ioreg/pmset, no desktop session)"


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def guest_lines(report: GuestReport) -> list[str]:
    r, state = report.rules, report.state
    windows = ", ".join(w.text for w in r.windows) or "none (always)"
    change = report.next_change
    when = "" if change is None else (f"; {'closes' if report.window_open else 'opens'} "
                                      f"{_local(change, r.zone)}")
    idle = report.idle
    idle_text = f"{idle.value:.0f} s since the last input ({idle.source.value})" if idle.value is not None \
        else _unread(idle)
    power = report.power
    power_text = ("on battery" if power.value else "on AC") + f" ({power.source.value})" if power.value is not None \
        else _unread(power)
    active = f"{r.pause_when_active_s / 60:g} min" if r.pause_when_active_s else "off"
    verdict = (f"PAUSED ({state.reason.value})" + (f", serves again in {state.retry_after_s} s"
                                                   if state.retry_after_s is not None else "")
               if isinstance(state, Paused) else "would serve now")
    return [
        "Owner's Mac (serving windows and pauses)",
        f"  windows             {windows} ({zone_name(r.zone)}): {'open' if report.window_open else 'closed'} now{when}",
        f"  owner activity      {idle_text}; pause_when_active_mins {active}",
        f"  power               {power_text}; pause_on_battery {_on(r.pause_on_battery)}",
        f"  thermal             {report.thermal.value}; pause_on_thermal {_on(r.pause_on_thermal)}",
        f"  now                 {verdict}",
    ]


__all__ = ["GuestReport", "gather_guest", "guest_json", "guest_lines"]
