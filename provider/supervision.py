"""How the agent ends when a service manager runs it, and what it leaves for `service status`.

launchd has no `RestartPreventExitStatus`: with `KeepAlive {SuccessfulExit: false}` a configuration
error (exit 78) would relaunch the agent every `ThrottleInterval` forever, each time failing the same
way. So the launchd plist marks the agent's environment with ``DARKBLOOM_SERVICE_MANAGER=launchd``,
and when that is set a configuration or command-line error

* is printed as usual (launchd's StandardErrorPath),
* is recorded in ``<log dir>/last-exit.json`` (what `darkbloom-provider service status` shows), and
* ends the agent with exit 0, which launchd does not relaunch (until the next login or
  `service install`).

A clean start under launchd removes the record. Without the marker (a terminal, systemd, whose unit
sets ``RestartPreventExitStatus=78``) nothing changes: the exit code is the error's own.

The record holds an error class, the exit code it replaced, the one-line message (the same text
the operator sees on a terminal: setting names and values, never request text) and a UTC time.

Crash loops. `KeepAlive {SuccessfulExit: false}` relaunches an agent that exits
abnormally (a crash, a signal, jetsam's SIGKILL) every `ThrottleInterval`, for ever; oMLX's tracker
shows such a loop stranding wired memory until reboot (233 restarts). So the agent counts its own
abnormal exits in the state directory, ``abnormal-exits.json``, each with its time and kind:

* an exit code is known when `serve` returns: 0 (a drain) and 78 (a refused configuration) are
  clean; 75 is a memory self-restart (memory that did not come back after unloads), which
  counts too, so a restart that does not help cannot loop either; any other code is an error exit;
* a kill or a crash leaves no code: while it runs, ``agent.running`` names the agent's pid and that
  process's start time, and every exit with a code removes it; a marker whose process is gone (no
  such pid, or a pid reused by another process since), found at the next start, was a crash.

When ``crash_loop_limit`` of them fall within ``crash_loop_window_mins``, an agent under launchd
stays down: it records ``crash_loop`` with the kinds counted (shown by `service status`), says so on
stderr and exits 0, which launchd does not relaunch (until the next login or boot, by when the
window has usually passed, or `service install`, which starts the count afresh). Elsewhere nothing
stays down: the systemd unit has the same limit as ``StartLimitBurst`` / ``StartLimitIntervalSec``
(every restart counts there, exit 75 included), and a terminal has a person in front of it.
`doctor` reports both the recent abnormal exits and a stay-down.

The guard's files are written like the identity keys (`kvcache.disk.atomic_write`: 0600, a
temporary file renamed into place and fsynced, removed when a write fails). When the state directory cannot
take them (a full disk, a read-only one) the agent still serves, without the guard: it logs
``crash_loop_guard_off`` (the OS error's name, never its text), and `doctor`, which writes and removes
a probe the same way, reports ``crash_loop_guard_off`` until it can again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path

import psutil

from kvcache.disk import atomic_write, os_error_name
from provider.config import SERVICE_MANAGER_ENV  # set by the launchd plist; not a setting
from provider.telemetry import get_logger

log = get_logger(__name__)

EXIT_RECORD_FILE = "last-exit.json"
MAX_MESSAGE = 2000  # characters of the message kept
RUN_MARKER_FILE = "agent.running"  # in the state directory, while an agent runs
ABNORMAL_EXITS_FILE = "abnormal-exits.json"  # in the state directory: the recent abnormal exits
GUARD_PROBE_FILE = "crash-loop-guard.probe"  # `doctor` writes and removes it: can the guard write here?
GUARD_PROBE_BYTES = 4096  # more than a record of many exits takes
EX_CRASH_LOOP = 1  # recorded as the exit it replaced (only launchd stays down: elsewhere it never happens)
EXIT_RESTART = 75  # EX_TEMPFAIL: the agent's memory self-restart (provider/agent.py), relaunched by the manager
CLEAN_EXITS = (0, 78)  # a drain, a refused configuration


class ExitReason(StrEnum):
    CONFIGURATION = "configuration_error"  # a bad setting, file or flag value (exit 78)
    USAGE = "usage_error"  # a command line argparse refused (exit 2), e.g. a flag an upgrade removed
    CRASH_LOOP = "crash_loop"  # crash_loop_limit abnormal exits within crash_loop_window_mins


@dataclass(frozen=True, slots=True)
class ExitRecord:
    reason: ExitReason
    exit_code: int  # what the agent would have exited with outside launchd
    message: str
    at: str  # ISO 8601, UTC


def under_launchd(env: Mapping[str, str]) -> bool:
    return env.get(SERVICE_MANAGER_ENV) == "launchd"


def under_service_manager(env: Mapping[str, str]) -> bool:
    """launchd (the plist's marker) or systemd (it sets INVOCATION_ID for every unit it starts):
    something that starts the agent again after it exits non-zero."""
    return under_launchd(env) or bool(env.get("INVOCATION_ID"))


def launchd_log_dir(home: Path) -> Path:
    """Where the launchd agent's logs (and the exit record) live."""
    return home / "Library" / "Logs" / "darkbloom"


def exit_record_path(home: Path) -> Path:
    return launchd_log_dir(home) / EXIT_RECORD_FILE


def exit_code_for(reason: ExitReason, code: int, message: str, *, home: Path, env: Mapping[str, str],
                  now: datetime | None = None) -> int:
    """The process exit code for an error that a restart cannot fix: `code` normally; under launchd,
    0 after recording it (see the module docstring)."""
    if not under_launchd(env):
        return code
    record = ExitRecord(reason, code, message.strip()[:MAX_MESSAGE],
                        (now or datetime.now(UTC)).isoformat(timespec="seconds"))
    path = exit_record_path(home)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_private(path, (json.dumps(asdict(record), indent=2) + "\n").encode())
    except OSError:
        pass  # the message is in the stderr log anyway; not relaunching matters more
    return 0


def started(*, home: Path, env: Mapping[str, str]) -> None:
    """The agent started with a valid configuration: a recorded error is history now."""
    if under_launchd(env):
        exit_record_path(home).unlink(missing_ok=True)


def read_exit_record(home: Path) -> ExitRecord | None:
    """The last recorded error exit, or None (none, or unreadable)."""
    try:
        data = json.loads(exit_record_path(home).read_text(encoding="utf-8"))
        return ExitRecord(ExitReason(data["reason"]), int(data["exit_code"]), str(data["message"]), str(data["at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- crash loops (see the module docstring) ----------------------------------------------------------


class ExitKind(StrEnum):
    CRASH = "crash"  # no exit code: a signal (jetsam's SIGKILL), a crash, found at the next start
    MEMORY_RESTART = "memory_restart"  # exit 75: the memory self-restart
    ERROR_EXIT = "error_exit"  # another non-zero exit code


_KIND_WORDS = {ExitKind.CRASH: ("crash", "crashes"),
               ExitKind.MEMORY_RESTART: ("memory self-restart", "memory self-restarts"),
               ExitKind.ERROR_EXIT: ("error exit", "error exits")}


@dataclass(frozen=True, slots=True)
class AbnormalExit:
    at: str  # ISO 8601 UTC
    kind: ExitKind


@dataclass(frozen=True, slots=True)
class AbnormalExits:
    abnormal_exits: tuple[AbnormalExit, ...] = ()  # oldest first, only those inside the window
    stayed_down_at: str | None = None  # the last start stayed down for a crash loop, then (None: it served)

    def kinds(self) -> str:
        """What they were, e.g. "3 memory self-restarts, 1 crash" (most first)."""
        counts: dict[ExitKind, int] = {}
        for e in self.abnormal_exits:
            counts[e.kind] = counts.get(e.kind, 0) + 1
        return ", ".join(f"{n} {_KIND_WORDS[kind][n != 1]}"
                         for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))

    def as_json(self) -> dict:
        return {"abnormal_exits": [{"at": e.at, "kind": e.kind.value} for e in self.abnormal_exits],
                "stayed_down_at": self.stayed_down_at}


@dataclass(frozen=True, slots=True)
class StartDecision:
    record: AbnormalExits
    stay_down: bool
    previous_crashed: bool  # the run before this one ended without an exit code (a kill, a crash)

    def message(self, window_mins: float) -> str:
        exits = self.record.abnormal_exits
        why = ""
        if any(e.kind is ExitKind.MEMORY_RESTART for e in exits):
            why = " (memory self-restarts: memory did not come back after unloads, again after each restart)"
        return (f"stayed down after {len(exits)} abnormal exit{'s' if len(exits) != 1 else ''} within {window_mins:g} minutes "
                f"({self.record.kinds()}; the first at {exits[0].at}): find the cause in provider.log{why}, "
                "then run `darkbloom-provider service install` to start it again")


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the state directory, if it is the first thing
    _write_private(path, (json.dumps(data, indent=2) + "\n").encode())  # 0600; no temp file left on failure


def _write_private(path: Path, data: bytes) -> None:
    atomic_write(path, data, mode=0o600)


def _guard_off(state_dir: Path, exc: OSError, phase: str) -> None:
    log.warning("crash_loop_guard_off", phase=phase, path=str(state_dir), reason=os_error_name(exc),
                hint="the state directory cannot be written (a full disk?): abnormal exits are not counted, so a "
                     "crash loop would not be stopped, until it can")


def guard_unwritable(state_dir: Path) -> OSError | None:
    """Why the guard cannot write its files in `state_dir` now (None: it can), for `doctor`: writes a
    probe the way the guard writes them, and removes it."""
    probe = state_dir / GUARD_PROBE_FILE
    try:
        _write_json(probe, {"probe": "x" * GUARD_PROBE_BYTES})
        probe.unlink()
    except OSError as exc:
        return exc
    return None


def _entry(item: object, now: datetime, window_s: float) -> AbnormalExit | None:
    """One recorded exit, if it is well formed and inside the window."""
    if not isinstance(item, dict):
        return None
    try:
        at, kind = datetime.fromisoformat(str(item.get("at"))), ExitKind(item.get("kind"))
    except ValueError:
        return None
    if at.tzinfo is None or not timedelta(0) <= now - at <= timedelta(seconds=window_s):
        return None
    return AbnormalExit(at.astimezone(UTC).isoformat(timespec="seconds"), kind)


def read_abnormal_exits(state_dir: Path, *, window_s: float, now: datetime | None = None) -> AbnormalExits:
    """The abnormal exits inside the window, and the last stay-down, from the state directory."""
    data = _read_json(state_dir / ABNORMAL_EXITS_FILE) or {}
    now = now or datetime.now(UTC)
    items = data.get("abnormal_exits")
    kept = [e for e in (_entry(item, now, window_s) for item in (items if isinstance(items, list) else ()))
            if e is not None]
    stayed = data.get("stayed_down_at")
    return AbnormalExits(tuple(sorted(kept, key=lambda e: e.at)), stayed if isinstance(stayed, str) else None)


def _created(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), or None if there is none we may inspect."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def _same_run(pid: int, created: object) -> bool:
    """The process the marker names is still running: its pid exists and started when the marker says
    (after a reboot the pid may belong to any other process). One we may not inspect runs as another
    user, so it is not an agent of ours."""
    now = _created(pid)
    if now is None:
        return False
    return not isinstance(created, (int, float)) or abs(now - created) < 1.0


def on_start(state_dir: Path, *, env: Mapping[str, str], limit: int, window_s: float, pid: int | None = None,
             now: datetime | None = None) -> StartDecision:
    """At `serve`: count the previous run if it was killed or crashed, decide whether to stay down, and
    if not, mark this run. Another agent still running (a second `serve`) is neither counted nor replaced."""
    now = now or datetime.now(UTC)
    pid = os.getpid() if pid is None else pid
    record = read_abnormal_exits(state_dir, window_s=window_s, now=now)
    marker = _read_json(state_dir / RUN_MARKER_FILE) or {}
    previous = marker.get("pid")
    running = isinstance(previous, int) and _same_run(previous, marker.get("created"))
    other_alive = running and previous != pid
    crashed = isinstance(previous, int) and not running  # (our own pid too: the last boot's agent had it)
    stamp = now.isoformat(timespec="seconds")
    exits = record.abnormal_exits + ((AbnormalExit(stamp, ExitKind.CRASH),) if crashed else ())
    stay_down = under_launchd(env) and len(exits) >= limit
    record = AbnormalExits(exits, stamp if stay_down else None)  # set: the last start stayed down
    try:
        _write_json(state_dir / ABNORMAL_EXITS_FILE, record.as_json())
        if stay_down:
            (state_dir / RUN_MARKER_FILE).unlink(missing_ok=True)
        elif not other_alive:
            _write_json(state_dir / RUN_MARKER_FILE, {"pid": pid, "created": _created(pid), "started_at": stamp})
    except OSError as exc:  # the agent serves all the same: it says so
        _guard_off(state_dir, exc, "start")
    return StartDecision(record, stay_down, crashed)


def on_exit(state_dir: Path, code: int, *, window_s: float, pid: int | None = None,
            now: datetime | None = None) -> None:
    """`serve` returned `code`: this run is accounted for now (its marker goes). A clean exit is not
    counted; any other is, with its kind (exit 75, a memory self-restart, or an error exit)."""
    pid = os.getpid() if pid is None else pid
    marker = _read_json(state_dir / RUN_MARKER_FILE)
    ours = marker is not None and marker.get("pid") == pid
    try:
        if code not in CLEAN_EXITS:
            now = now or datetime.now(UTC)
            record = read_abnormal_exits(state_dir, window_s=window_s, now=now)
            kind = ExitKind.MEMORY_RESTART if code == EXIT_RESTART else ExitKind.ERROR_EXIT
            exits = record.abnormal_exits + (AbnormalExit(now.isoformat(timespec="seconds"), kind),)
            _write_json(state_dir / ABNORMAL_EXITS_FILE, AbnormalExits(exits, record.stayed_down_at).as_json())
        if ours:
            (state_dir / RUN_MARKER_FILE).unlink(missing_ok=True)
    except OSError as exc:  # counted as a crash at the next start instead, if the marker stayed
        _guard_off(state_dir, exc, "exit")


def reset_abnormal_exits(state_dir: Path) -> None:
    """`service install`: the operator starts the agent again on purpose; the count starts afresh."""
    (state_dir / ABNORMAL_EXITS_FILE).unlink(missing_ok=True)
