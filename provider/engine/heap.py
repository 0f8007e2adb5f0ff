"""Freed heap pages back to the OS when the engine goes idle.

A server's Python objects come and go by the million (parsed bodies, token lists, log events), and the C
allocator keeps the pages they freed: on glibc, RSS outside MLX grows some MiB per 1,000 requests of
varied sizes although no live object grows, and falls back flat when `malloc_trim(0)` runs. So the engine
thread calls it when it goes idle after work, at most once per `min_interval_s` (a trim walks every arena:
2-70 ms on a 2-core CPU, time a waiting request must not pay). On macOS the same call is libmalloc's
`malloc_zone_pressure_relief(NULL, 0)` (every zone, as much as it can). Elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable

MIN_INTERVAL_S = 30.0


def _release_function() -> Callable[[], object] | None:
    """The C allocator's call that returns free pages, or None where there is none we know."""
    try:
        if sys.platform.startswith("linux"):
            trim = ctypes.CDLL("libc.so.6").malloc_trim
            trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
            return lambda: trim(0)
        if sys.platform == "darwin":
            relief = ctypes.CDLL("/usr/lib/libSystem.B.dylib").malloc_zone_pressure_relief
            relief.argtypes, relief.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_size_t
            return lambda: relief(None, 0)
    except (OSError, AttributeError):  # another libc (musl): nothing to call
        pass
    return None


class HeapTrim:
    """`worked()` on every busy turn of the engine loop, `idle()` when it is about to wait: a release at
    the first idle turn after work, then none for `min_interval_s`."""

    def __init__(self, min_interval_s: float = MIN_INTERVAL_S, *, release: Callable[[], object] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._release = _release_function() if release is None else release
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._dirty = False
        self._last: float | None = None
        self.releases = 0

    @property
    def available(self) -> bool:
        return self._release is not None

    def worked(self) -> None:
        self._dirty = True

    def idle(self) -> bool:
        """Release now if there was work since the last release and the interval has passed."""
        if not self._dirty or self._release is None:
            return False
        now = self._clock()
        if self._last is not None and now - self._last < self._min_interval_s:
            return False
        self._release()
        self._dirty, self._last = False, now
        self.releases += 1
        return True
