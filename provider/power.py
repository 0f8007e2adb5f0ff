"""Keep the Mac awake while the agent is available.

An idle Mac goes to sleep, and a sleeping Mac drops the coordinator's WebSocket: for the network the
provider is gone until someone touches the machine. While the agent is available it holds a power
assertion the way Darkbloom's Rust provider does: ``caffeinate -i -w <our pid>``. ``-i`` prevents idle
system sleep (the display may still sleep, and closing a laptop's lid still sleeps it); ``-w`` ends
the assertion when our process exits, so a crash or a kill can never leave the Mac awake for nothing.

``keep_awake = false`` turns it off. Availability is a hook, not a guess: the agent wires
``set_available`` to the guest monitor (``GuestMonitor.follow``), so the assertion is held
while a serving window is open and nothing pauses the agent, released while it is paused (outside a
window, the owner busy, on battery, too hot: the Mac may sleep then), and released for good when the
agent drains. Elsewhere than macOS there is nothing to hold (a Linux server is configured not to
sleep; a systemd user unit has no business inhibiting it), so this does nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence

from provider.telemetry import get_logger

CAFFEINATE = "/usr/bin/caffeinate"
STOP_TIMEOUT_S = 5.0

log = get_logger("provider.power")

Spawn = Callable[[Sequence[str]], "subprocess.Popen[bytes]"]


def _spawn(argv: Sequence[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, close_fds=True)


def caffeinate_argv(pid: int, binary: str = CAFFEINATE) -> list[str]:
    """The command that holds the assertion for as long as process ``pid`` lives."""
    return [binary, "-i", "-w", str(pid)]


class KeepAwake:
    """Holds a ``caffeinate`` assertion while available and enabled. Call from the event loop."""

    def __init__(self, *, enabled: bool, platform: str = sys.platform, pid: int | None = None,
                 binary: str = CAFFEINATE, spawn: Spawn = _spawn) -> None:
        self._enabled = enabled and platform == "darwin"
        self._pid = os.getpid() if pid is None else pid
        self._binary = binary
        self._spawn = spawn
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def holding(self) -> bool:
        """The assertion is held now (the caffeinate process is alive)."""
        return self._process is not None and self._process.poll() is None

    def set_available(self, available: bool) -> None:
        """Hold the assertion while the agent is available, release it when it is not."""
        if available and self._enabled and not self.holding:
            try:
                self._process = self._spawn(caffeinate_argv(self._pid, self._binary))
            except OSError as exc:
                log.warning("keep_awake_unavailable", exc_type=type(exc).__name__, path=self._binary)
                return
            log.info("keep_awake_held", pid=self._process.pid)
        elif not available:
            self.release()

    def release(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.info("keep_awake_released")


__all__ = ["CAFFEINATE", "KeepAwake", "caffeinate_argv"]
