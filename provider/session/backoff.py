"""Reconnect policy, as pure functions (as websockets' ``backoff()`` / ``process_exception``).

* ``backoff_delays()`` — an infinite generator of delays: 1 s, 2 s, 4 s … capped at 30 s, each with
  up to ±20 % jitter so a fleet of providers does not reconnect in lock step after a coordinator restart.
* ``should_reset_backoff(registered_for_s)`` — a fresh generator is taken only after a session that
  stayed registered for at least ``STABLE_SESSION_S``: a coordinator that accepts and then drops us at
  once must not be hammered every second.
* ``clock_jumped(...)`` — the wall clock moved much more than the monotonic clock between two ticks:
  the machine slept, so the socket is presumed dead even if no error surfaced yet.
* ``is_retryable(exc)`` — whether a failed connect or a lost connection is worth another attempt.
  Everything is, except a URL that can never work: a provider runs for months, and a refused
  handshake (a 502 from a load balancer, a coordinator restarting) heals by itself. Every close from
  the coordinator (1000 goodbye, 1013 restore failure, replaced by a newer connection) is followed by
  a reconnect with backoff.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator

from websockets.exceptions import InvalidURI

INITIAL_DELAY_S = 1.0
MAX_DELAY_S = 30.0
FACTOR = 2.0
JITTER = 0.2  # ± fraction of each delay
STABLE_SESSION_S = 30.0
CLOCK_JUMP_FACTOR = 3.0  # Swift's suspension rule: a wall gap > 3 × the tick interval


def backoff_delays(
    *,
    initial: float = INITIAL_DELAY_S,
    maximum: float = MAX_DELAY_S,
    factor: float = FACTOR,
    jitter: float = JITTER,
    rand: Callable[[], float] = random.random,
) -> Iterator[float]:
    """Delays before reconnect attempts 1, 2, 3 …: exponential from ``initial`` to ``maximum``, jittered.

    Every yielded delay lies in ``[base × (1 − jitter), base × (1 + jitter)]`` and never exceeds
    ``maximum × (1 + jitter)``; ``rand`` returns values in [0, 1) (injectable for tests)."""
    if initial <= 0 or maximum < initial or factor < 1 or not 0 <= jitter < 1:
        raise ValueError("invalid backoff parameters")
    base = initial
    while True:
        yield base * (1.0 + jitter * (2.0 * rand() - 1.0))
        base = min(maximum, base * factor)


def should_reset_backoff(registered_for_s: float | None, *, stable_after_s: float = STABLE_SESSION_S) -> bool:
    """Reset to the initial delay only after a session that stayed registered long enough.

    ``registered_for_s`` is None when the connection never got as far as sending ``register``."""
    return registered_for_s is not None and registered_for_s >= stable_after_s


def clock_jumped(
    wall_elapsed_s: float, monotonic_elapsed_s: float, interval_s: float, *, factor: float = CLOCK_JUMP_FACTOR
) -> bool:
    """True when the wall clock advanced more than ``factor × interval`` beyond the monotonic clock's
    view of the same tick (a sleep or suspend), or went backwards by as much."""
    return abs(wall_elapsed_s - monotonic_elapsed_s) > factor * interval_s


def is_retryable(exc: BaseException) -> bool:
    """False only for errors no retry can fix (a malformed URL); cancellation is never "retried"."""
    if isinstance(exc, (InvalidURI, asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
        return False
    return isinstance(exc, Exception)


__all__ = [
    "CLOCK_JUMP_FACTOR",
    "FACTOR",
    "INITIAL_DELAY_S",
    "JITTER",
    "MAX_DELAY_S",
    "STABLE_SESSION_S",
    "backoff_delays",
    "clock_jumped",
    "is_retryable",
    "should_reset_backoff",
]
