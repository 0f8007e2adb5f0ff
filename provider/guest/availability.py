"""May the agent take new work now? One pure function over the clock, the owner's signals and rules.

    availability(now, signals, rules) -> Available | Paused(reason, retry_after_s)

Every pause has exactly one reason, the first that applies in this order:

1. ``outside_window``  no serving window is open (`rules.windows`, local time in `rules.zone`);
2. ``thermal``         the thermal state is serious or critical (`rules.pause_on_thermal`);
3. ``on_battery``      the Mac draws from its battery, or a UPS's (`rules.pause_on_battery`);
4. ``owner_active``    keyboard or mouse used less than `rules.pause_when_active_s` ago.

`retry_after_s` is the number of whole seconds until the function says Available with the same
signals (the idle time grows with the clock; nothing else moves): the later of "idle long
enough" and the next window opening. It is None when no such moment exists with these signals
(on battery, too hot: only a new reading can lift it). A signal that could not be read (None)
never pauses: an unreadable sensor must not stop a provider that was told to serve.

Admission refuses with `Paused.retry_hint_s` (capped at `MAX_RETRY_AFTER_S`; `UNKNOWN_RETRY_AFTER_S`
when unknown); `releases_memory` says which reasons give the owner the memory back after the grace
period (the owner's time or attention: outside a window, at the keyboard; unloading cools nothing
and saves no battery).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from enum import StrEnum

from protocol import ThermalState
from provider.guest.windows import ServeWindow, is_open, next_flip, next_open

MAX_RETRY_AFTER_S = 3600  # a client told "come back in an hour" asks again then; longer hints go stale
UNKNOWN_RETRY_AFTER_S = 60  # battery or heat: about when a new reading may lift it
HOT = frozenset({ThermalState.SERIOUS, ThermalState.CRITICAL})


class PauseReason(StrEnum):
    OUTSIDE_WINDOW = "outside_window"
    THERMAL = "thermal"
    ON_BATTERY = "on_battery"
    OWNER_ACTIVE = "owner_active"

    @property
    def releases_memory(self) -> bool:
        return self in (PauseReason.OUTSIDE_WINDOW, PauseReason.OWNER_ACTIVE)


@dataclass(frozen=True, slots=True)
class Signals:
    """The latest readings; None where a reader is off or could not read."""

    last_input_at: datetime | None = None  # now − HIDIdleTime when it was read
    on_battery: bool | None = None
    thermal: ThermalState | None = None


@dataclass(frozen=True, slots=True)
class Rules:
    windows: Sequence[ServeWindow] = ()
    zone: tzinfo = UTC
    pause_when_active_s: float | None = None  # None or 0: never
    pause_on_battery: bool = False
    pause_on_thermal: bool = True


@dataclass(frozen=True, slots=True)
class Available:
    pass


@dataclass(frozen=True, slots=True)
class Paused:
    reason: PauseReason
    retry_after_s: int | None  # whole seconds until Available with these signals; None: not foreseeable
    resumes_at: datetime | None = field(default=None, compare=False)  # the instant itself

    @property
    def retry_hint_s(self) -> int:
        """What a refusal tells the client: capped, and a re-check interval when unknown."""
        if self.retry_after_s is None:
            return UNKNOWN_RETRY_AFTER_S
        return max(1, min(self.retry_after_s, MAX_RETRY_AFTER_S))


Availability = Available | Paused


def _active_until(now: datetime, signals: Signals, rules: Rules) -> datetime | None:
    """When the owner will have been idle long enough (None: the feature is off or unread)."""
    if not rules.pause_when_active_s or signals.last_input_at is None:
        return None
    return signals.last_input_at + timedelta(seconds=rules.pause_when_active_s)


def availability(now: datetime, signals: Signals, rules: Rules) -> Availability:
    """Available, or Paused with its one reason and the seconds until Available (see the module)."""
    hot = rules.pause_on_thermal and signals.thermal in HOT
    battery = rules.pause_on_battery and bool(signals.on_battery)
    idle_at = _active_until(now, signals, rules)
    active = idle_at is not None and now < idle_at
    window = is_open(now, rules.windows, rules.zone)
    if window and not (hot or battery or active):
        return Available()
    reason = (PauseReason.OUTSIDE_WINDOW if not window else PauseReason.THERMAL if hot
              else PauseReason.ON_BATTERY if battery else PauseReason.OWNER_ACTIVE)
    if hot or battery:
        return Paused(reason, None)
    resumes = next_open(max(now, idle_at) if active and idle_at is not None else now, rules.windows, rules.zone)
    if resumes is None:
        return Paused(reason, None)
    return Paused(reason, max(1, math.ceil((resumes - now).total_seconds())), resumes)


def next_window_change(now: datetime, rules: Rules) -> datetime | None:
    """When a window next opens or closes (doctor, /status); None without windows."""
    return next_flip(now, rules.windows, rules.zone)


__all__ = ["HOT", "MAX_RETRY_AFTER_S", "UNKNOWN_RETRY_AFTER_S", "Availability", "Available", "PauseReason", "Paused",
           "Rules", "Signals", "availability", "next_window_change"]
