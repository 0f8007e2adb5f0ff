"""One agent per state directory, and where a running one can be found.

The state directory holds the identity keys, the KV SSD cache (whose start-up sweep deletes what a
previous process left there) and the crash-loop count: two agents on one would register with the
same identity, and the second's sweep would delete the first's live cache files. So `serve` and
`serve --local` take an exclusive OS lock (`fcntl.flock`) on ``state_dir/agent.lock`` before they
touch anything else and hold it for the process's life. The OS releases it when the process ends,
however it ends: a SIGKILLed agent leaves no stale lock. A second agent refuses to start with
`AlreadyRunning`, whose message names the first.

The lock file is also the running agent's record (JSON, mode 0600): its pid and start time, its
mode, the URL of its local server (None when `local_enabled` is off) and its coordinator URL.
`status` and `doctor` read it (they take no lock) to find an agent started with another
`--local-port`, and believe it only while that pid is still the process that wrote it. A clean
release empties the file; it is never deleted (deleting a lock file races with the next agent
opening it).

A state directory that cannot hold the lock (read-only, someone else's, something in the way) costs
only the lock: one warning, and the agent starts, as it starts without the SSD tier there.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import psutil

from provider.config import Settings
from provider.telemetry import get_logger

log = get_logger(__name__)

LOCK_FILE = "agent.lock"


class AgentMode(StrEnum):
    COORDINATOR = "coordinator"  # `serve`
    LOCAL = "local"  # `serve --local`

    @property
    def command(self) -> str:
        return "serve" if self is AgentMode.COORDINATOR else "serve --local"


@dataclass(frozen=True, slots=True)
class AgentRecord:
    """What the lock's holder wrote about itself."""

    pid: int
    created: float | None  # the process's start time, so a reused pid is not mistaken for it
    mode: AgentMode
    local_url: str | None  # its local server (/status, and the OpenAI API with --local); None when off
    coordinator_url: str | None
    started_at: str  # ISO 8601, UTC

    def describe(self) -> str:
        """E.g. "pid 4242, serve --local on http://127.0.0.1:8484"."""
        where = f" on {self.local_url}" if self.local_url else " (no local server)"
        if self.mode is AgentMode.COORDINATOR and self.coordinator_url:
            where += f", coordinator {self.coordinator_url}"
        return f"pid {self.pid}, {self.mode.command}{where}"

    @classmethod
    def parse(cls, text: str) -> AgentRecord | None:
        try:
            data = json.loads(text)
            record = cls(int(data["pid"]), _number(data.get("created")), AgentMode(data["mode"]),
                         _text(data.get("local_url")), _text(data.get("coordinator_url")), str(data["started_at"]))
        except (ValueError, KeyError, TypeError):
            return None
        return record


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


class AlreadyRunning(Exception):
    """Another agent holds the state directory's lock; the message is one line for the operator."""

    def __init__(self, state_dir: Path, holder: AgentRecord | None) -> None:
        self.state_dir = state_dir
        self.holder = holder
        who = holder.describe() if holder is not None else "its pid is not recorded yet"
        super().__init__(f"another agent is already running on the state directory {state_dir} ({who}): stop it "
                         "first, or give this one its own --state-dir")


class StateLock:
    """The held lock (`held` False when the directory could not hold one); `release()` or a `with`
    block ends it, and so does the end of the process."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    @classmethod
    def acquire(cls, state_dir: Path, *, mode: AgentMode, local_url: str | None,
                coordinator_url: str | None) -> StateLock:
        """Lock `state_dir` for this process and record who holds it; `AlreadyRunning` if another
        process holds it. Never blocks."""
        path = Path(state_dir) / LOCK_FILE
        try:
            fd = _open(path)
        except OSError as exc:
            log.warning("state_dir_not_locked", path=str(path), reason=errno.errorcode.get(exc.errno or 0, "OSError"))
            return cls(path, None)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = AgentRecord.parse(_read(fd))
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise AlreadyRunning(Path(state_dir), holder) from None
            log.warning("state_dir_not_locked", path=str(path), reason=errno.errorcode.get(exc.errno or 0, "OSError"))
            return cls(path, None)
        pid = os.getpid()
        record = AgentRecord(pid, _created(pid), mode, local_url, coordinator_url,
                             datetime.now(UTC).isoformat(timespec="seconds"))
        _rewrite(fd, json.dumps({**asdict(record), "mode": mode.value}, indent=2) + "\n")
        return cls(path, fd)

    @classmethod
    def for_serving(cls, settings: Settings, *, local: bool) -> StateLock:
        """`acquire` for `serve` (`local=False`) or `serve --local` with these settings."""
        has_server = local or settings.local_enabled  # `serve --local` is its local server
        return cls.acquire(settings.state_dir, mode=AgentMode.LOCAL if local else AgentMode.COORDINATOR,
                           local_url=settings.local_base_url if has_server else None,
                           coordinator_url=None if local else settings.coordinator_url)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            _rewrite(fd, "")  # no record of an agent that is gone
        finally:
            os.close(fd)  # releases the lock

    def __enter__(self) -> StateLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def running_agent(state_dir: Path) -> AgentRecord | None:
    """The agent that holds `state_dir`'s lock, from its record; None when none runs (no record, or
    its process is gone). Takes no lock, so it never gets in an agent's way."""
    try:
        text = (Path(state_dir) / LOCK_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    record = AgentRecord.parse(text)
    if record is None:
        return None
    started = _created(record.pid)
    if started is None or (record.created is not None and abs(started - record.created) >= 1.0):
        return None
    return record


def _open(path: Path) -> int:
    """The lock file for writing (created 0600, with its directory 0700), or read-only where it
    exists but cannot be written (flock works on either)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except PermissionError:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise
        return os.open(path, os.O_RDONLY)
    os.fchmod(fd, 0o600)  # an older file may have another mode
    return fd


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _rewrite(fd: int, text: str) -> None:
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
    except OSError:
        pass  # read-only: locked, but `status` cannot find the agent from here


def _created(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None
