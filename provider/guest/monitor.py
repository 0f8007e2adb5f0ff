"""The shell around `availability`: reads the owner's signals, keeps the agent's state, acts on changes.

    monitor = GuestMonitor.from_settings(settings, thermal=lambda: sampler.state)
    monitor.bind(release=runtime.release_models, restore=runtime.restore_preloads)
    manager.pause_source = monitor.paused          # admission asks at every request (provider/slots)
    await monitor.run()                            # a task of the agent, until cancelled

`paused()` evaluates the pure function at the clock's now over the latest readings, so a request
arriving one second after a window closes is refused with the right Retry-After even before the
monitor's next step. `step()` is what the loop runs (tests call it after moving an injected clock):

1. read the signals the rules use (idle time, power source: blocking commands, off the loop; the
   thermal state is the heartbeat's own reading, no I/O);
2. evaluate; on a change of state or reason: log ``availability_changed``, update the metrics, call
   the listeners (the session sends a heartbeat at once: ``draining`` while paused, as [N] reads it);
3. while paused for a reason that gives the memory back (outside a window, the owner at the
   keyboard) for `grace_s`: `release()` (unload every idle model; in-flight requests finish first,
   retried at each step until nothing is left resident);
4. available again after a release (or a start inside a pause, which deferred the preloads):
   `restore()` (reload ``preload_models``).

The loop steps every `poll_s`, and sooner at the moment the state is due to change (a window edge,
the end of the owner's idle wait, the end of the grace period) or when `wake()` is called.

Hooks for whoever must follow the state: `on_change(listener)` is called on the loop with the new
`Available | Paused` at each change (the session's prompt heartbeat); `follow(available)` gets a bool
now and at each flip between available and paused (a power assertion that keeps the Mac awake only
while it may serve); `is_paused()` is the state as of the last step. A hook that raises is logged
(``guest_step_failed``) and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from protocol import ThermalState
from provider.config import Settings
from provider.guest.availability import (
    Availability,
    Available,
    Paused,
    PauseReason,
    Rules,
    Signals,
    availability,
    next_window_change,
)
from provider.guest.readers import Reading, Source, read_idle_seconds, read_on_battery
from provider.guest.windows import is_open
from provider.guest.zone import rules_from_settings, zone_name
from provider.telemetry import get_logger

if TYPE_CHECKING:
    from provider.metrics import Metrics

log = get_logger("provider.guest")

POLL_S = 10.0  # how often the signals are read; a window edge is acted on at its own moment
MIN_WAIT_S = 0.05

Clock = Callable[[], datetime]
Reader = Callable[[], Reading]


def utc_now() -> datetime:
    return datetime.now(UTC)


def _key(state: Availability) -> PauseReason | None:
    return state.reason if isinstance(state, Paused) else None


def _unix(at: datetime | None) -> float | None:
    return None if at is None else round(at.timestamp(), 3)


class GuestMonitor:
    def __init__(self, rules: Rules, *, grace_s: float, clock: Clock = utc_now,
                 thermal: Callable[[], ThermalState | None] | None = None, read_idle: Reader | None = None,
                 read_power: Reader | None = None, poll_s: float = POLL_S, metrics: Metrics | None = None) -> None:
        self.rules = rules
        self.grace_s = grace_s
        self._clock = clock
        self._thermal = thermal
        self._read_idle = read_idle
        self._read_power = read_power
        self.poll_s = poll_s
        self._metrics = metrics
        self.signals = Signals(thermal=thermal() if thermal else None)
        self.idle_reading: Reading | None = None  # None: the reader is off
        self.power_reading: Reading | None = None
        self.state: Availability = Available()
        self.since = clock()
        self.pauses: Counter[PauseReason] = Counter()
        self.released = False  # every model was unloaded during this pause
        self._releasing_since: datetime | None = None
        self._restore_due = False
        self._release: Callable[[], Awaitable[bool]] | None = None
        self._restore: Callable[[], Awaitable[None]] | None = None
        self._listeners: list[Callable[[Availability], None]] = []
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()

    @classmethod
    def from_settings(cls, settings: Settings, *, thermal: Callable[[], ThermalState | None] | None = None,
                      clock: Clock = utc_now, read_idle: Reader | None = None, read_power: Reader | None = None,
                      **kwargs: Any) -> GuestMonitor:
        """The rules and readers the settings ask for (a reader the rules do not use stays off)."""
        rules = rules_from_settings(settings)
        return cls(rules, grace_s=settings.pause_unload_grace_s, clock=clock,
                   thermal=thermal if settings.pause_on_thermal else None,
                   read_idle=(read_idle or read_idle_seconds) if rules.pause_when_active_s else None,
                   read_power=(read_power or read_on_battery) if rules.pause_on_battery else None, **kwargs)

    # -- what admission, the heartbeat and the status page ask ------------------------------------

    def current(self) -> Availability:
        """The pure function at this instant over the latest readings."""
        return availability(self._clock(), self.signals, self.rules)

    def paused(self) -> Paused | None:
        state = self.current()
        return state if isinstance(state, Paused) else None

    def is_paused(self) -> bool:
        """As of the last step (what the heartbeat and the logs say)."""
        return isinstance(self.state, Paused)

    def on_change(self, listener: Callable[[Availability], None]) -> None:
        self._listeners.append(listener)

    def follow(self, available: Callable[[bool], None]) -> None:
        """Call `available(not paused)` now (the state as of the last step) and at each flip between
        available and paused, not when only a pause's reason changes: the hook of a power assertion
        that keeps the Mac awake only while it may serve (``KeepAwake.set_available``)."""
        last = [not self.is_paused()]
        available(last[0])

        def flipped(state: Availability) -> None:
            now = isinstance(state, Available)
            if now != last[0]:
                last[0] = now
                available(now)

        self.on_change(flipped)

    def bind(self, *, release: Callable[[], Awaitable[bool]] | None = None,
             restore: Callable[[], Awaitable[None]] | None = None) -> None:
        self._release, self._restore = release, restore

    def report_to(self, metrics: Metrics) -> None:
        """Keep ``darkbloom_paused`` / ``darkbloom_pauses_total`` on `metrics` from now on."""
        self._metrics = metrics
        metrics.availability_changed(_key(self.state), count=False)

    def defer_restore(self) -> None:
        """The preloads were skipped at start (it began inside a pause): load them when available."""
        self._restore_due = True

    def wake(self) -> None:
        self._wake.set()

    # -- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.step()
            except Exception as exc:  # a hook's error (an unload's): the loop must outlive it
                log.error("guest_step_failed", exc_type=type(exc).__name__)
            with contextlib.suppress(TimeoutError):  # a real interval, or sooner when woken
                await asyncio.wait_for(self._wake.wait(), self.next_step_s())

    def next_step_s(self) -> float:
        """Seconds the loop waits before its next step: a poll, or less when the state is due to change."""
        now = self._clock()
        due = [t for t in (self._due_at(now),) if t is not None]
        soonest = min([self.poll_s] + [(t - now).total_seconds() for t in due])
        return max(MIN_WAIT_S, soonest)

    def _due_at(self, now: datetime) -> datetime | None:
        """The next moment the state may change with the same readings. A grace period already over
        is not one: a release still waiting for a request is retried at the poll, not in a spin."""
        moments = [next_window_change(now, self.rules)]
        if isinstance(self.state, Paused):
            moments.append(self.state.resumes_at)
            if self._releasing_since is not None and not self.released:
                moments.append(self._releasing_since + timedelta(seconds=self.grace_s))
        return min((m for m in moments if m is not None and m > now), default=None)

    async def step(self) -> Availability:
        async with self._lock:
            await self._read()
            now = self._clock()
            new = availability(now, self.signals, self.rules)
            if _key(new) != _key(self.state):
                self._changed(new, now)
            self.state = new
            if isinstance(new, Paused) and new.reason.releases_memory:
                await self._maybe_release(new, now)
            else:
                self._releasing_since = None
                if isinstance(new, Available) and (self.released or self._restore_due):
                    await self._restore_models()
            return new

    async def _read(self) -> None:
        idle, power = self._read_idle, self._read_power
        if idle is not None:
            self.idle_reading = await asyncio.to_thread(idle)
        if power is not None:
            self.power_reading = await asyncio.to_thread(power)
        now = self._clock()
        seconds = self.idle_reading.value if self.idle_reading is not None else None
        self.signals = Signals(
            last_input_at=now - timedelta(seconds=float(seconds)) if isinstance(seconds, float | int) else None,
            on_battery=self.power_reading.value if self.power_reading is not None else None,  # type: ignore[arg-type]
            thermal=self._thermal() if self._thermal is not None else None,
        )

    def _changed(self, new: Availability, now: datetime) -> None:
        old = _key(self.state)
        self.since = now
        if isinstance(new, Paused):
            self.pauses[new.reason] += 1
            log.info("availability_changed", state="paused", reason=new.reason, from_state=old or "available",
                     retry_after_s=new.retry_after_s)
        else:
            log.info("availability_changed", state="available", from_state=old)
        if self._metrics is not None:
            self._metrics.availability_changed(_key(new))
        for listener in self._listeners:
            listener(new)

    async def _maybe_release(self, state: Paused, now: datetime) -> None:
        if self._releasing_since is None:
            self._releasing_since = now
        if self.released or self._release is None or now - self._releasing_since < timedelta(seconds=self.grace_s):
            return
        self.released = await self._release()
        if self.released:
            log.info("guest_memory_released", reason=state.reason,
                     paused_s=round((now - self._releasing_since).total_seconds(), 3))

    async def _restore_models(self) -> None:
        self.released = self._restore_due = False
        if self._restore is not None:
            await self._restore()
            log.info("guest_models_restored")

    # -- reporting --------------------------------------------------------------------------------

    def as_json(self) -> dict[str, Any]:
        """The ``availability`` section of /status (keys are only ever added)."""
        now = self._clock()
        state = self.state
        resumes = state.resumes_at if isinstance(state, Paused) else None
        grace_at = (self._releasing_since + timedelta(seconds=self.grace_s)
                    if self._releasing_since is not None and not self.released else None)
        rules = self.rules
        return {
            "state": "paused" if isinstance(state, Paused) else "available",
            "reason": state.reason.value if isinstance(state, Paused) else None,
            "retry_after_s": None if resumes is None else max(0, math.ceil((resumes - now).total_seconds())),
            "resumes_at": _unix(resumes),
            "since": _unix(self.since),
            "memory_released": self.released,
            "release_at": _unix(grace_at),
            "pauses": {r.value: n for r, n in sorted(self.pauses.items())},
            "windows": [w.text for w in rules.windows],
            "timezone": zone_name(rules.zone),
            "window_open": is_open(now, rules.windows, rules.zone),
            "next_window_change": _unix(next_window_change(now, rules)),
            "signals": {
                "idle_s": _idle_s(self.signals, now),
                "idle_source": self.idle_reading.source.value if self.idle_reading else "off",
                "on_battery": self.signals.on_battery,
                "power_source": self.power_reading.source.value if self.power_reading else "off",
                "thermal": self.signals.thermal.value if self.signals.thermal is not None else None,
            },
            "rules": {"pause_when_active_s": rules.pause_when_active_s, "pause_on_battery": rules.pause_on_battery,
                      "pause_on_thermal": rules.pause_on_thermal, "unload_grace_s": self.grace_s},
        }


def _idle_s(signals: Signals, now: datetime) -> float | None:
    if signals.last_input_at is None:
        return None
    return round(max(0.0, (now - signals.last_input_at).total_seconds()), 3)


__all__ = ["POLL_S", "GuestMonitor", "Source", "utc_now"]
