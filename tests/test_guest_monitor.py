"""provider/guest GuestMonitor: the shell around `availability` — readings, one log event and
one metric change per change of state, the grace period before the memory goes back, the preloads
restored when the agent may serve again, and a loop that acts at a window's edge. An injected clock;
the readers are stand-ins returning what the recorded-output tests prove the real ones return."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from clock import Clock
from protocol import ThermalState
from provider.config import Settings
from provider.guest import Available, Paused, PauseReason, Rules, parse_windows
from provider.guest.monitor import GuestMonitor
from provider.guest.readers import Reading, Source
from provider.metrics import Metrics
from provider.telemetry import capture_redacted_logs

START = datetime(2025, 1, 8, 21, 0, tzinfo=UTC)  # a Wednesday


class Hooks:
    def __init__(self) -> None:
        self.releases = 0
        self.restores = 0
        self.busy = False

    async def release(self) -> bool:
        self.releases += 1
        return not self.busy

    async def restore(self) -> None:
        self.restores += 1


def monitor(*windows: str, clock: Clock, grace_s: float = 300, **kw) -> tuple[GuestMonitor, Hooks]:
    rule_kw = {k: kw.pop(k) for k in ("pause_when_active_s", "pause_on_battery", "pause_on_thermal") if k in kw}
    m = GuestMonitor(Rules(windows=parse_windows(windows), zone=UTC, **rule_kw), grace_s=grace_s, clock=clock, **kw)
    hooks = Hooks()
    m.bind(release=hooks.release, restore=hooks.restore)
    return m, hooks


async def test_each_change_is_logged_once_with_its_reason_and_counted():
    clock, metrics = Clock(START), Metrics()
    m, _ = monitor("22:00-07:30", clock=clock, metrics=metrics)
    seen: list = []
    m.on_change(seen.append)
    with capture_redacted_logs() as logs:
        assert await m.step() == Paused(PauseReason.OUTSIDE_WINDOW, 3600)
        clock.advance(minutes=30)
        await m.step()  # still paused for the same reason: no new event
        clock.advance(minutes=30)
        assert await m.step() == Available()
    events = [(e["state"], e.get("reason"), e.get("from_state"), e.get("retry_after_s"))
              for e in logs if e["event"] == "availability_changed"]
    assert events == [("paused", "outside_window", "available", 3600), ("available", None, "outside_window", None)]
    assert [type(s) for s in seen] == [Paused, Available]
    assert metrics.pauses_total.labels(reason="outside_window")._value.get() == 1
    assert metrics.paused.labels(reason="outside_window")._value.get() == 0
    text = metrics.render().decode()
    assert 'darkbloom_paused{reason="outside_window"} 0.0' in text


async def test_admission_sees_the_edge_before_the_next_step():
    clock = Clock(START.replace(hour=22))
    m, _ = monitor("22:00-07:30", clock=clock)
    await m.step()
    assert m.paused() is None
    clock.now = START.replace(hour=7, minute=30) + timedelta(days=1)
    paused = m.paused()  # the loop has not stepped yet: the pure function still answers at this instant
    assert paused is not None and paused.retry_after_s == 14.5 * 3600 and paused.retry_hint_s == 3600
    assert not m.is_paused()  # the reported state follows the steps


async def test_memory_goes_back_after_the_grace_period_and_the_preloads_come_back():
    clock = Clock(START)
    m, hooks = monitor("22:00-07:30", clock=clock, grace_s=300)
    await m.step()
    clock.advance(seconds=299)
    await m.step()
    assert hooks.releases == 0  # within the grace period
    clock.advance(seconds=1)
    hooks.busy = True  # a request still running: the unload waits for it
    await m.step()
    assert hooks.releases == 1 and not m.released
    assert m.as_json()["release_at"] == (START + timedelta(seconds=300)).timestamp()
    hooks.busy = False
    clock.advance(seconds=10)
    await m.step()
    assert hooks.releases == 2 and m.released
    await m.step()
    assert hooks.releases == 2  # once released, nothing more to do
    clock.now = START.replace(hour=22)
    assert await m.step() == Available()
    assert hooks.restores == 1 and not m.released


async def test_heat_and_battery_pause_without_giving_the_memory_back():
    clock, thermal = Clock(START), {"state": ThermalState.SERIOUS}
    power = Reading(True, Source.PMSET)
    m, hooks = monitor(clock=clock, grace_s=0, pause_on_battery=True, thermal=lambda: thermal["state"],
                       read_power=lambda: power)
    paused = await m.step()
    assert paused == Paused(PauseReason.THERMAL, None) and paused.retry_hint_s == 60
    thermal["state"] = ThermalState.FAIR
    assert (await m.step()).reason is PauseReason.ON_BATTERY
    assert hooks.releases == 0
    power = Reading(False, Source.PMSET)
    assert await m.step() == Available() and hooks.restores == 0  # nothing was released
    signals = m.as_json()["signals"]
    assert signals["on_battery"] is False and signals["power_source"] == "pmset" and signals["thermal"] == "fair"


async def test_the_owner_at_the_keyboard():
    clock = Clock(START)
    idle = {"s": 5.0}
    m, hooks = monitor(clock=clock, grace_s=60, pause_when_active_s=600,
                       read_idle=lambda: Reading(idle["s"], Source.IOREG))
    paused = await m.step()
    assert paused == Paused(PauseReason.OWNER_ACTIVE, 595)
    clock.advance(seconds=60)
    idle["s"] += 60
    await m.step()
    assert hooks.releases == 1  # the owner uses the Mac: the memory goes back too
    clock.advance(seconds=535)
    idle["s"] += 535
    assert await m.step() == Available() and hooks.restores == 1
    doc = m.as_json()
    assert doc["signals"]["idle_s"] == 600 and doc["signals"]["idle_source"] == "ioreg"


async def test_a_start_inside_a_pause_restores_the_deferred_preloads():
    clock = Clock(START)
    m, hooks = monitor("22:00-07:30", clock=clock)
    await m.step()
    m.defer_restore()
    clock.now = START.replace(hour=22)
    await m.step()
    assert hooks.restores == 1


async def test_the_loop_acts_at_the_window_edge():
    """The clock runs with the event loop; the window closes 0.3 s in: the loop steps at that moment
    (not at its 10 s poll), the listener hears it."""
    loop = asyncio.get_running_loop()
    t0, base = loop.time(), START.replace(hour=7, minute=29, second=59, microsecond=700_000)

    def clock() -> datetime:
        return base + timedelta(seconds=loop.time() - t0)

    m = GuestMonitor(Rules(windows=parse_windows(["22:00-07:30"]), zone=UTC), grace_s=300, clock=clock)
    changed = asyncio.Event()
    m.on_change(lambda state: changed.set() if isinstance(state, Paused) else None)
    task = asyncio.create_task(m.run())
    try:
        await asyncio.wait_for(changed.wait(), 5)  # well under the 10 s poll
        assert m.state.reason is PauseReason.OUTSIDE_WINDOW
    finally:
        task.cancel()


def test_from_settings_turns_on_only_the_readers_the_rules_use():
    calls: list[str] = []

    def idle():
        calls.append("idle")
        return Reading(1.0, Source.IOREG)

    quiet = GuestMonitor.from_settings(Settings(serve_windows=["22:00-07:30"], serve_timezone="Europe/Paris"),
                                       read_idle=idle)
    assert quiet.rules.pause_when_active_s is None and quiet.as_json()["signals"]["idle_source"] == "off"
    assert quiet.as_json()["timezone"] == "Europe/Paris" and quiet.as_json()["windows"] == ["22:00-07:30"]
    asyncio.run(quiet.step())
    assert calls == []
    watching = GuestMonitor.from_settings(Settings(pause_when_active_mins=10), read_idle=idle)
    asyncio.run(watching.step())
    assert calls == ["idle"] and watching.rules.pause_when_active_s == 600


async def test_an_unload_waiting_for_a_request_is_retried_at_the_poll_not_in_a_spin():
    """Past the grace period with a request still running, the release is retried at each poll (10 s),
    not every 50 ms: each step runs the readers (ioreg, pmset: a process each)."""
    clock = Clock(START)
    m, hooks = monitor("22:00-07:30", clock=clock, grace_s=300)
    await m.step()
    assert m.next_step_s() == m.poll_s
    clock.advance(seconds=300)
    hooks.busy = True
    await m.step()
    assert hooks.releases == 1 and not m.released
    assert m.next_step_s() == m.poll_s
    m.bind()  # nothing to release with (a monitor without a runtime): no spin either
    await m.step()
    assert m.next_step_s() == m.poll_s


async def test_the_loop_survives_a_failing_hook():
    """A hook that raises (an unload's error) is logged by its type and the loop goes on: a dead loop
    would leave the heartbeat and the metrics in the last state for the life of the process."""
    clock = Clock(START)
    m = GuestMonitor(Rules(windows=parse_windows(["22:00-07:30"]), zone=UTC), grace_s=0, clock=clock)
    first, second = asyncio.Event(), asyncio.Event()

    async def release() -> bool:
        if not first.is_set():
            first.set()
            raise RuntimeError("an engine error")
        second.set()
        return True

    m.bind(release=release)
    with capture_redacted_logs() as logs:
        task = asyncio.create_task(m.run())
        try:
            await asyncio.wait_for(first.wait(), 5)
            m.wake()
            await asyncio.wait_for(second.wait(), 5)
            assert m.released
        finally:
            task.cancel()
    (failed,) = [e for e in logs if e["event"] == "guest_step_failed"]
    assert failed["exc_type"] == "RuntimeError"


async def test_follow_hears_each_flip_between_available_and_paused():
    """The hook a power assertion uses (KeepAwake.set_available): the state at once, then a
    call at each flip, none when only the reason of a pause changes."""
    clock, thermal = Clock(START), {"state": ThermalState.NOMINAL}
    m, _ = monitor("22:00-07:30", clock=clock, thermal=lambda: thermal["state"])
    await m.step()
    heard: list[bool] = []
    m.follow(heard.append)
    assert heard == [False]  # 21:00: outside the window
    clock.now = START.replace(hour=22)
    await m.step()
    thermal["state"] = ThermalState.SERIOUS
    await m.step()
    clock.now = START.replace(hour=8) + timedelta(days=1)
    assert (await m.step()).reason is PauseReason.OUTSIDE_WINDOW  # paused all along: no call
    assert heard == [False, True, False]
