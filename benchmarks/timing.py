"""Shared timing for the micro-benchmarks: warm up, then per-call samples, median and p99 in µs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def measure(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """(median µs, p99 µs) over `n` calls of `fn`, after up to 200 warm-up calls."""
    for _ in range(min(200, n)):
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    samples.sort()
    return statistics.median(samples) / 1e3, samples[int(0.99 * (len(samples) - 1))] / 1e3
