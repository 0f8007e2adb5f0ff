"""A clock the test moves by hand, handed to the code under test in place of the real one."""

from __future__ import annotations

from datetime import datetime, timedelta


class Clock:
    """Calling it reads ``now``: seconds (a monotonic clock's float) or a datetime (a wall clock).

    The test sets ``now`` or moves it on with ``advance(seconds=…, minutes=…)``.
    """

    def __init__(self, now: float | datetime) -> None:
        self.now = now

    def __call__(self) -> float | datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        step = timedelta(**delta)
        self.now = self.now + (step if isinstance(self.now, datetime) else step.total_seconds())
