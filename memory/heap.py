"""The C heap of a process that serves for weeks: what glibc's malloc keeps, handed back now and then.

On Linux every MLX buffer on the CPU (weights, KV, the prefix cache's entries, each activation) comes
from `malloc`, and glibc keeps what is freed: its mmap threshold follows the largest block freed (up
to 32 MiB), so after the first prefills nearly every buffer comes from its arenas, and the free
space between live blocks (the prefix cache's entries live long and are evicted in any order) stays
resident. In the soak benchmark (benchmarks/soak_bench.py, the tiny model, 10,000 requests) that free
space, not live objects, was what grew with uptime: +121 MiB of RSS outside MLX from request 1,000 to
10,000 while Python's objects stayed flat.

`malloc_trim(0)` hands every arena's free pages back (the holes too, not only an arena's top): on
that soak 20-80 MiB in 10-35 ms, after which RSS outside MLX stayed at one level. `Trimmer` runs it on
the engine thread, the one that frees MLX's buffers: at most every `TRIM_EVERY_S` while the engine
works, and once when it has nothing left to do after work. Between two trims serving takes some of it
back (the busy reading in the soak: up to ~80 MiB above the level at rest), never more over time.

Tried and not taken: fixed thresholds (`mallopt`: mmap threshold 1 MiB, trim threshold 8 MiB, each
freed block then goes back at once) halved the soak's growth but not more, and cost a chunked prefill
on the medium preset ~35 % more page faults and ~20 % more time; two arenas at most (`M_ARENA_MAX`)
changed nothing measurable.

Elsewhere (macOS: MLX's arrays are Metal buffers and libmalloc returns freed pages itself; a C library
other than glibc) there is no `malloc_trim`, and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import time
from collections.abc import Callable

TRIM_EVERY_S = 30.0  # while the engine works: one trim (10-35 ms in the soak) per this many seconds at most
TRIM_IDLE_AFTER_S = 5.0  # idle after work: a trim unless one ran this recently


@functools.cache
def malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class Trimmer:
    """When the engine thread hands the heap's free pages back: `working()` after each step of work
    (a trim at most every `every_s`), `idle()` when nothing is left to do (a trim if there was work
    since the last one and that one is at least `idle_after_s` old). Engine thread only."""

    __slots__ = ("_trim", "_clock", "_every", "_idle_after", "_last", "_worked", "trims")

    def __init__(self, trim: Callable[[int], int] | None = None, *, every_s: float = TRIM_EVERY_S,
                 idle_after_s: float = TRIM_IDLE_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._trim = trim if trim is not None else malloc_trim()
        self._clock = clock
        self._every = every_s
        self._idle_after = idle_after_s
        self._last = clock()
        self._worked = False
        self.trims = 0

    def working(self) -> None:
        self._worked = True
        if self._clock() - self._last >= self._every:
            self._run()

    def idle(self) -> None:
        if self._worked and self._clock() - self._last >= self._idle_after:
            self._run()

    def _run(self) -> None:
        self._last = self._clock()
        self._worked = False
        if self._trim is not None:
            self._trim(0)
            self.trims += 1


__all__ = ["TRIM_EVERY_S", "TRIM_IDLE_AFTER_S", "Trimmer", "malloc_trim"]
