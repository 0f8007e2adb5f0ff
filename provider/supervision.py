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

Crash loops (issue 18.8). `KeepAlive {SuccessfulExit: false}` relaunches an agent that exits
abnormally (a crash, a signal, jetsam's SIGKILL) every `ThrottleInterval`, for ever; oMLX's tracker
shows such a loop stranding wired memory until reboot (233 restarts). So the agent counts its own
abnormal exits in the state directory: while it runs, ``agent.running`` names its pid and that
process's start time; a clean exit removes it, so a marker whose process is gone (no such pid, or a
pid reused by another process since), found at the next start, means that run ended abnormally, and
its time goes into ``abnormal-exits.json``. Only exit 0 (a drain) and 78 (a refused configuration)
are clean: a memory self-restart (exit 75, issue 20) counts too, so a restart that does not help
cannot loop either. When ``crash_loop_limit`` of them fall within ``crash_loop_window_mins``, an
agent under launchd stays down: it records ``crash_loop`` (shown by
`service status`), says so on stderr and exits 0, which launchd does not relaunch (until the next
login or boot, by when the window has usually passed, or `service install`, which starts the count
afresh). Elsewhere nothing stays down: the systemd unit has the same limit as ``StartLimitBurst`` /
``StartLimitIntervalSec``, and a terminal has a person in front of it. `doctor` reports both the
recent abnormal exits and a stay-down.
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

from provider.config import SERVICE_MANAGER_ENV  # set by the launchd plist; not a setting

EXIT_RECORD_FILE = "last-exit.json"
MAX_MESSAGE = 2000  # characters of the message kept
RUN_MARKER_FILE = "agent.running"  # in the state directory, while an agent runs
ABNORMAL_EXITS_FILE = "abnormal-exits.json"  # in the state directory: the recent abnormal exits
EX_CRASH_LOOP = 1  # recorded as the exit it replaced (only launchd stays down: elsewhere it never happens)


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
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(record), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
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


@dataclass(frozen=True, slots=True)
class AbnormalExits:
    abnormal_exits: tuple[str, ...] = ()  # ISO 8601 UTC, oldest first, only those inside the window
    stayed_down_at: str | None = None  # the last time an agent refused to start for a crash loop


@dataclass(frozen=True, slots=True)
class StartDecision:
    record: AbnormalExits
    stay_down: bool
    previous_crashed: bool  # the run before this one ended without a clean exit

    def message(self, window_mins: float) -> str:
        n = len(self.record.abnormal_exits)
        return (f"stayed down after {n} abnormal exits within {window_mins:g} minutes (the first at "
                f"{self.record.abnormal_exits[0]}): find the cause in provider.log, then run "
                "`darkbloom-provider service install` to start it again")


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the state directory, if it is the first thing
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_abnormal_exits(state_dir: Path, *, window_s: float, now: datetime | None = None) -> AbnormalExits:
    """The abnormal exits inside the window, and the last stay-down, from the state directory."""
    data = _read_json(state_dir / ABNORMAL_EXITS_FILE) or {}
    now = now or datetime.now(UTC)
    kept = []
    for stamp in data.get("abnormal_exits", ()):
        try:
            at = datetime.fromisoformat(str(stamp))
        except ValueError:
            continue
        if at.tzinfo is not None and timedelta(0) <= now - at <= timedelta(seconds=window_s):
            kept.append(at)
    stayed = data.get("stayed_down_at")
    return AbnormalExits(tuple(a.isoformat(timespec="seconds") for a in sorted(kept)),
                         stayed if isinstance(stayed, str) else None)


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
    """At `serve`: count the previous run if it ended abnormally, decide whether to stay down, and if
    not, mark this run. Another agent still running (a second `serve`) is neither counted nor replaced."""
    now = now or datetime.now(UTC)
    pid = os.getpid() if pid is None else pid
    record = read_abnormal_exits(state_dir, window_s=window_s, now=now)
    marker = _read_json(state_dir / RUN_MARKER_FILE) or {}
    previous = marker.get("pid")
    running = isinstance(previous, int) and _same_run(previous, marker.get("created"))
    other_alive = running and previous != pid
    crashed = isinstance(previous, int) and not running  # (our own pid too: the last boot's agent had it)
    stamp = now.isoformat(timespec="seconds")
    exits = record.abnormal_exits + ((stamp,) if crashed else ())
    stay_down = under_launchd(env) and len(exits) >= limit
    record = AbnormalExits(exits, stamp if stay_down else record.stayed_down_at)
    try:
        _write_json(state_dir / ABNORMAL_EXITS_FILE, {"abnormal_exits": list(exits), "stayed_down_at": record.stayed_down_at})
        if stay_down:
            (state_dir / RUN_MARKER_FILE).unlink(missing_ok=True)
        elif not other_alive:
            _write_json(state_dir / RUN_MARKER_FILE, {"pid": pid, "created": _created(pid), "started_at": stamp})
    except OSError:
        pass  # an unusable state directory stops the agent a moment later, with its own message
    return StartDecision(record, stay_down, crashed)


def on_clean_exit(state_dir: Path, *, pid: int | None = None) -> None:
    """The agent ended on purpose (a drain, a refused start): that run was not a crash."""
    pid = os.getpid() if pid is None else pid
    marker = _read_json(state_dir / RUN_MARKER_FILE)
    if marker is not None and marker.get("pid") == pid:
        (state_dir / RUN_MARKER_FILE).unlink(missing_ok=True)


def reset_abnormal_exits(state_dir: Path) -> None:
    """`service install`: the operator starts the agent again on purpose; the count starts afresh."""
    (state_dir / ABNORMAL_EXITS_FILE).unlink(missing_ok=True)
