"""Progress of long operations (weight hashing, model loads), shown only on a terminal.

Under launchd or systemd stderr is a log file: nothing is drawn there, the structured logs say
what happened. On a terminal a single line is redrawn in place.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

# label -> a progress line; `None` where progress is not shown.
ProgressFactory = Callable[[str], "Progress"]


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


def is_terminal(stream: TextIO) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def terminal_progress(stream: TextIO | None = None) -> ProgressFactory | None:
    """A factory of progress lines when `stream` (stderr) is a terminal, else None."""
    target = sys.stderr if stream is None else stream
    if not is_terminal(target):
        return None
    return lambda label: Progress(label, target)
