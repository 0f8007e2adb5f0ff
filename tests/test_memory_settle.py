"""memory.settle: the barrier with an injected poll and clock, and once with real MLX buffers."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from structlog.testing import capture_logs

from memory.policy import GiB
from memory.settle import settle, settle_target_bytes

MiB = 2**20


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_target_tolerance() -> None:
    assert settle_target_bytes(10 * GiB) == 8 * GiB  # 2 GiB floor > 5 %
    assert settle_target_bytes(100 * GiB) == 95 * GiB  # 5 % > 2 GiB
    assert settle_target_bytes(GiB) == 0  # small models settle at once
    assert settle_target_bytes(GiB, tolerance_bytes=0) == GiB
    assert settle_target_bytes(-5) == 0


def test_settles_while_polling() -> None:
    t = FakeTime()
    readings = iter([40 * GiB, 35 * GiB, 31 * GiB])  # active memory falls over two intervals
    result = settle(resident_bytes=10 * GiB, active_before_bytes=40 * GiB, poll=lambda: next(readings),
                    reclaim=lambda: pytest.fail("no reclaim needed"), clock=t.clock, sleep=t.sleep)
    assert result.settled and result.rounds == 0 and result.polls == 3
    assert result.freed_bytes == 9 * GiB and result.target_bytes == 8 * GiB
    assert t.sleeps == [0.5, 0.5] and result.seconds == 1.0


def test_times_out_then_aggressive_rounds_free_it() -> None:
    t = FakeTime()
    state = {"active": 40 * GiB, "reclaims": 0}

    def reclaim() -> None:
        state["reclaims"] += 1
        if state["reclaims"] == 2:
            state["active"] = 30 * GiB

    result = settle(resident_bytes=10 * GiB, active_before_bytes=40 * GiB, poll=lambda: state["active"],
                    reclaim=reclaim, clock=t.clock, sleep=t.sleep)
    assert result.settled and result.rounds == 2 and result.freed_bytes == 10 * GiB
    assert result.polls == 11  # t = 0, 0.5, ..., 5.0
    assert sum(t.sleeps) == pytest.approx(5.0) and max(t.sleeps) == 0.5


def test_never_settles_reports_and_warns() -> None:
    t = FakeTime()
    reclaims = []
    with capture_logs() as logs:
        result = settle(resident_bytes=10 * GiB, active_before_bytes=40 * GiB, poll=lambda: 39 * GiB,
                        reclaim=lambda: reclaims.append(1), timeout_s=2.0, interval_s=0.5,
                        clock=t.clock, sleep=t.sleep)
    assert not result.settled and result.rounds == 3 and len(reclaims) == 3
    assert result.freed_bytes == GiB and result.polls == 5 and result.seconds == 2.0
    warnings = [e for e in logs if e["event"] == "memory_settle_incomplete"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    assert warnings[0]["freed_bytes"] == GiB and warnings[0]["target_bytes"] == 8 * GiB


def test_configurable_timeout_and_rounds() -> None:
    t = FakeTime()
    result = settle(resident_bytes=10 * GiB, active_before_bytes=10 * GiB, poll=lambda: 10 * GiB,
                    reclaim=lambda: None, timeout_s=0.0, rounds=1, clock=t.clock, sleep=t.sleep)
    assert not result.settled and result.polls == 1 and result.rounds == 1 and t.sleeps == []


# -- real MLX -------------------------------------------------------------------------------------

def _resident(n_bytes: int) -> mx.array:
    a = mx.ones((n_bytes // 4,), dtype=mx.float32)
    mx.eval(a)
    return a


def test_real_mlx_freed_buffers_settle_at_once() -> None:
    mx.clear_cache()
    a = _resident(128 * MiB)
    before = mx.get_active_memory()
    del a
    result = settle(resident_bytes=128 * MiB, active_before_bytes=before, tolerance_bytes=0,
                    timeout_s=1.0, interval_s=0.05)
    assert result.settled and result.rounds == 0 and result.polls == 1
    assert result.freed_bytes >= 128 * MiB


def test_real_mlx_cycle_is_freed_by_the_aggressive_round() -> None:
    """A model object caught in a reference cycle: polling alone never frees it, gc.collect() does."""
    mx.clear_cache()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # keep the collector from breaking the cycle on its own schedule
    try:
        holder: dict = {"weights": _resident(128 * MiB)}
        holder["self"] = holder
        before = mx.get_active_memory()
        del holder
        result = settle(resident_bytes=128 * MiB, active_before_bytes=before, tolerance_bytes=0,
                        timeout_s=0.2, interval_s=0.1)
    finally:
        if gc_was_enabled:
            gc.enable()
    assert result.settled and result.rounds == 1 and result.polls >= 2  # it waited, then reclaimed
    assert result.freed_bytes >= 128 * MiB
    assert mx.get_cache_memory() == 0  # the real reclaim also cleared MLX's cache


def test_real_mlx_memory_still_held_does_not_settle() -> None:
    a = _resident(64 * MiB)
    before = mx.get_active_memory()
    with capture_logs():
        result = settle(resident_bytes=64 * MiB, active_before_bytes=before, tolerance_bytes=0,
                        timeout_s=0.1, interval_s=0.05)
    assert not result.settled and result.rounds == 3 and result.freed_bytes < 64 * MiB
    del a
