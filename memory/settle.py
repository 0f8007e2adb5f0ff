"""The settle barrier after an unload.

After a model is stopped and dropped, its buffers can take a moment to leave MLX's active count (a
trailing async step held ~60 MiB for 70–90 ms in our measurements; on Metal the release can lag
longer). The load that follows must not size itself on memory that is not yet free, so:

1. poll active memory every `interval_s` (0.5 s) for up to `timeout_s` (5 s) until
   `freed ≥ resident − max(2 GiB, 5 % of resident)`;
2. if it does not get there, up to `rounds` (3) rounds of `gc.collect()` + `mx.clear_cache()`,
   checking after each; if still short, log a warning with the figures.

The poll, the reclaim step, the clock and the sleep are injectable, so the barrier is tested
without MLX and without waiting. It blocks: run it on the thread that owns MLX (or in
`asyncio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from memory.heap import malloc_trim
from memory.policy import GiB

TOLERANCE_FLOOR_BYTES = 2 * GiB
TOLERANCE_PERCENT = 5
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_INTERVAL_S = 0.5
DEFAULT_ROUNDS = 3


@dataclass(frozen=True, slots=True)
class SettleResult:
    settled: bool
    freed_bytes: int  # active_before − active at the last check (≥ 0)
    target_bytes: int  # what had to be freed to count as settled
    seconds: float  # total time spent in the barrier
    polls: int  # active-memory readings taken while waiting
    rounds: int  # aggressive gc + clear_cache rounds run (0 when it settled while polling)


def settle_target_bytes(resident_bytes: int, tolerance_bytes: int | None = None) -> int:
    """Bytes that must be freed: `resident − max(2 GiB, 5 %)` (or `resident − tolerance_bytes`), ≥ 0."""
    resident = max(0, resident_bytes)
    if tolerance_bytes is None:
        tolerance_bytes = max(TOLERANCE_FLOOR_BYTES, -(-resident * TOLERANCE_PERCENT // 100))
    return max(0, resident - max(0, tolerance_bytes))


def read_active_memory() -> int:
    import mlx.core as mx  # deferred: only the real barrier needs MLX

    return mx.get_active_memory()


def clear_buffer_cache() -> None:
    """Drop MLX's buffer cache and return freed heap to the OS (glibc keeps freed weight buffers
    otherwise). No cycle collection: what the cache rule and loads need, cheaply."""
    import mlx.core as mx

    mx.clear_cache()
    trim = malloc_trim()
    if trim is not None:
        trim(0)


def reclaim() -> None:
    """One aggressive round: collect cycles, then `clear_buffer_cache`. A full collection holds the
    GIL for ~0.1 s in the agent (more in a big process), so it is kept for after an unload and the
    settle barrier's last rounds."""
    gc.collect()
    clear_buffer_cache()


def settle(
    *,
    resident_bytes: int,
    active_before_bytes: int,
    poll: Callable[[], int] = read_active_memory,
    reclaim: Callable[[], None] = reclaim,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = DEFAULT_INTERVAL_S,
    rounds: int = DEFAULT_ROUNDS,
    tolerance_bytes: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> SettleResult:
    """Wait until the unloaded model's memory has left MLX's active count; see the module doc.

    `resident_bytes`: what the model held (its measured resident delta). `active_before_bytes`:
    `mx.get_active_memory()` read just before the unload began.
    """
    target = settle_target_bytes(resident_bytes, tolerance_bytes)
    start = clock()
    polls = 0

    def freed() -> int:
        return max(0, active_before_bytes - poll())

    while True:
        now_freed = freed()
        polls += 1
        if now_freed >= target:
            return SettleResult(True, now_freed, target, clock() - start, polls, 0)
        elapsed = clock() - start
        if elapsed >= timeout_s:
            break
        sleep(min(interval_s, timeout_s - elapsed))

    for round_no in range(1, rounds + 1):
        reclaim()
        now_freed = freed()
        if now_freed >= target:
            return SettleResult(True, now_freed, target, clock() - start, polls, round_no)

    result = SettleResult(False, now_freed, target, clock() - start, polls, rounds)
    # A fresh logger per (rare) warning, so it honours the structlog config current at the time.
    structlog.get_logger(__name__).warning(
        "memory_settle_incomplete", freed_bytes=result.freed_bytes, target_bytes=target,
        resident_bytes=resident_bytes, seconds=round(result.seconds, 3), rounds=rounds)
    return result
