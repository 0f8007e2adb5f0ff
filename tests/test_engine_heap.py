"""The engine's idle heap release (provider/engine/heap.py): once after work, at most once an interval."""

from __future__ import annotations

import sys

import pytest

from clock import Clock
from provider.engine.heap import HeapTrim


def test_released_at_the_first_idle_turn_after_work_then_not_within_the_interval():
    calls: list[int] = []
    clock = Clock(0.0)
    heap = HeapTrim(30.0, release=lambda: calls.append(1), clock=clock)
    assert not heap.idle() and calls == []  # no work yet: nothing was freed
    heap.worked()
    assert heap.idle() and calls == [1]
    assert not heap.idle()  # idle again, no work since
    heap.worked()
    clock.advance(seconds=29.9)
    assert not heap.idle() and calls == [1]  # within the interval
    clock.advance(seconds=0.2)
    assert heap.idle() and calls == [1, 1] and heap.releases == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: this suite's CI is Linux")
def test_the_real_release_runs_on_glibc():
    heap = HeapTrim(0.0)
    assert heap.available
    blocks = [bytearray(4096) for _ in range(20_000)]  # ~80 MiB of small blocks, then freed
    del blocks
    heap.worked()
    assert heap.idle() and heap.releases == 1
