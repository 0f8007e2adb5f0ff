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
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

from provider.config import SERVICE_MANAGER_ENV  # set by the launchd plist; not a setting

EXIT_RECORD_FILE = "last-exit.json"
MAX_MESSAGE = 2000  # characters of the message kept


class ExitReason(StrEnum):
    CONFIGURATION = "configuration_error"  # a bad setting, file or flag value (exit 78)
    USAGE = "usage_error"  # a command line argparse refused (exit 2), e.g. a flag an upgrade removed


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
