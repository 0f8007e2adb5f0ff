"""Progress of long operations (weight hashing, model loads): a redrawn line on a terminal, log
events elsewhere.

On a terminal a single line is redrawn in place (`Progress`). Under launchd or systemd stderr is a
log file where nothing can be redrawn, so `LogProgress` writes `progress` events instead: one every
`interval_s` (5 s) while the operation runs, and one when it ends, with the bytes done, the total and
the elapsed time. An operation shorter than the interval logs only its end. `default_progress()`
picks one of the two for stderr.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import structlog

# label ("hashing <model id>", "loading <model id>") -> a progress reporter.
ProgressFactory = Callable[[str], "Progress | LogProgress"]
LOG_INTERVAL_S = 5.0


class Progress:
    """A one-line progress bar on `stream` (stderr) when it is a terminal; silent otherwise.

    `update` may be called from any thread (weight hashing reports from a worker thread)."""

    def __init__(self, label: str, stream: TextIO | None = None, min_interval_s: float = 0.1) -> None:
        self._label = label
        self._stream = sys.stderr if stream is None else stream
        self._tty = is_terminal(self._stream)
        self._min_interval_s = min_interval_s
        self._last = 0.0
        self._lock = threading.Lock()

    def __enter__(self) -> Progress:
        return self

    def update(self, done: int, total: int) -> None:
        if not self._tty:
            return
        with self._lock:
            now = time.monotonic()
            if now - self._last < self._min_interval_s and done < total:
                return
            self._last = now
            frac = min(1.0, done / total) if total > 0 else 1.0
            bar = "#" * int(frac * 30)
            self._stream.write(f"\r{self._label} [{bar:<30}] {frac:4.0%}")
            self._stream.flush()

    def close(self) -> None:
        if self._tty:
            with self._lock:
                self._stream.write("\n")
                self._stream.flush()

    def __exit__(self, *exc: object) -> None:
        self.close()


class LogProgress:
    """Progress as `progress` log events (phase = the label's verb, model = the rest of it). Thread-safe;
    the same `update(done, total)` / context-manager shape as `Progress`."""

    def __init__(self, label: str, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, logger: Any = None) -> None:
        self._phase, _, self._subject = label.partition(" ")
        self._interval_s = interval_s
        self._clock = clock
        self._log = logger if logger is not None else structlog.get_logger("provider.progress")
        self._started = clock()
        self._last = self._started
        self._done = self._total = 0
        self._ended = False
        self._lock = threading.Lock()

    def __enter__(self) -> LogProgress:
        return self

    def update(self, done: int, total: int) -> None:
        with self._lock:
            self._done, self._total = done, total
            now = self._clock()
            if self._ended or done >= total or now - self._last < self._interval_s:
                return  # the end is logged once, by close()
            self._last = now
            self._emit(now, ended=False)

    def close(self) -> None:
        with self._lock:
            if not self._ended:
                self._ended = True
                self._emit(self._clock(), ended=True)

    def _emit(self, now: float, *, ended: bool) -> None:
        pct = round(100 * min(1.0, self._done / self._total), 1) if self._total > 0 else 100.0
        self._log.info("progress_done" if ended else "progress", phase=self._phase, model=self._subject,
                       done_bytes=self._done, total_bytes=self._total, done_pct=pct,
                       elapsed_s=round(now - self._started, 3))

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_terminal(stream: TextIO) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def terminal_progress(stream: TextIO | None = None) -> ProgressFactory | None:
    """A factory of progress lines when `stream` (stderr) is a terminal, else None."""
    target = sys.stderr if stream is None else stream
    if not is_terminal(target):
        return None
    return lambda label: Progress(label, target)


def default_progress(stream: TextIO | None = None) -> ProgressFactory:
    """Progress lines on a terminal (`stream`, default stderr), log events anywhere else."""
    return terminal_progress(stream) or LogProgress
