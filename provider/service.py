"""Run the provider in the background: a launchd agent on macOS, a systemd user unit on Linux.

The files installed are the templates in ``deploy/`` with their ``@NAME@`` placeholders filled:

* launchd: ``deploy/io.darkbloom.provider.plist`` -> ``~/Library/LaunchAgents/``, loaded with
  ``launchctl bootstrap gui/<uid>``; logs in ``~/Library/Logs/darkbloom/``: ``provider.log`` is the
  agent's own (``--log-file``, rotated by size), ``provider.stderr.log`` what is printed before
  logging starts (a configuration error). A per-user agent runs only once its user has logged in to
  the desktop, and ``bootstrap gui/<uid>`` fails over SSH.
* launchd, ``system_user=`` (``service install --system``, as root): the same plist as a LaunchDaemon
  in ``/Library/LaunchDaemons/`` with ``UserName`` (the agent runs as that user, never as root) and that
  user's ``HOME``, loaded with ``launchctl bootstrap system``: it starts at boot, before anyone logs in
  (with FileVault on, once the disk is unlocked). Installing one kind while the other is installed is
  refused: two agents would share one state directory and one port.
* ``ProcessType`` is the ``process_type`` setting (the trade-off is in ``deploy/README.md``); ``Nice``
  and ``LowPriorityIO`` stay only with ``background``.
* systemd: ``deploy/darkbloom-provider.service`` -> ``~/.config/systemd/user/``, then
  ``systemctl --user daemon-reload``, ``enable``, ``reset-failed`` (a crash loop's start limit), ``restart``;
  logs in the user journal.

The program is ``darkbloom-provider serve`` (``local=True``: ``serve --local``, the owner's OpenAI
server in the background, as Ollama and LM Studio run; one service per user either way, so `status`
and `uninstall` find whichever is installed and say which) plus every setting given on the
``install`` command line (``args``, e.g. ``--memory-reserve-gb 8 --model-dirs /srv/models``) and
``--config``. The ``DARKBLOOM_*`` variables of the installing shell (plus ``PATH``, ``HF_HOME``,
``HF_HUB_CACHE``) are written into the service's environment, so the background agent sees what the
operator set. When that includes ``DARKBLOOM_AUTH_TOKEN`` the file is written 0600 instead of 0644.
If starting the service fails, the file is put back as it was: removed when the install created it,
restored when one was there before (an earlier ``--no-load`` install's): a failed install never
deletes what it did not write. Without a systemd user session (SSH, su) ``systemctl --user`` cannot
reach a manager; the error then says how to get one (``loginctl enable-linger``) or to use
``--no-load``, ``uninstall`` still removes the file and says that systemd was not told, and ``status``
says how to get one instead of systemctl's own words.

Under launchd a configuration error ends the agent without a relaunch loop and is shown by
``service status`` (``provider/supervision.py``).

Every function takes the home directory, platform, environment and a ``runner`` (``subprocess.run``
shape) as arguments, so tests install into a temporary home and check the exact commands.
"""

from __future__ import annotations

import math
import os
import plistlib
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from kvcache.disk import atomic_write
from provider.config import ProcessType
from provider.supervision import (
    SERVICE_MANAGER_ENV,
    AbnormalExits,
    launchd_log_dir,
    read_abnormal_exits,
    read_exit_record,
)

LABEL = "io.darkbloom.provider"
UNIT_NAME = "darkbloom-provider.service"
# The templates live in the source tree's deploy/ (editable installs, the Makefile's); a wheel ships
# them as data files under <prefix>/share/darkbloom-provider/deploy (pyproject's data-files).
_SOURCE_DEPLOY_DIR = Path(__file__).resolve().parent.parent / "deploy"
_INSTALLED_DEPLOY_DIR = Path(sys.prefix) / "share" / "darkbloom-provider" / "deploy"
DEPLOY_DIR = _SOURCE_DEPLOY_DIR if _SOURCE_DEPLOY_DIR.is_dir() else _INSTALLED_DEPLOY_DIR
PLIST_TEMPLATE = DEPLOY_DIR / f"{LABEL}.plist"
UNIT_TEMPLATE = DEPLOY_DIR / UNIT_NAME
DRAIN_MARGIN_S = 15  # on top of drain_timeout_s: time to send terminal frames and close the socket
LOG_FILE = "provider.log"  # the agent's own log (rotated), in the launchd log directory
CARRIED_ENV = ("PATH", "HF_HOME", "HF_HUB_CACHE")  # besides every DARKBLOOM_* variable
SECRET_ENV = frozenset({"DARKBLOOM_AUTH_TOKEN"})
EX_CONFIG = 78  # the agent's exit code for a configuration error (provider/cli.py)
_PLACEHOLDER = re.compile(r"@([A-Z_]+)@")
DAEMON_DIR = Path("Library") / "LaunchDaemons"  # under the file system's root
BACKGROUND_ONLY_KEYS = ("LowPriorityIO", "Nice")
_PROCESS_TYPE = {ProcessType.BACKGROUND: "Background", ProcessType.STANDARD: "Standard",
                 ProcessType.INTERACTIVE: "Interactive"}

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


class ServiceError(Exception):
    """The service cannot be installed, removed or queried; the message is for the operator."""


class ServiceKind(StrEnum):
    LAUNCHD = "launchd"
    SYSTEMD = "systemd"


@dataclass(frozen=True, slots=True)
class InstallResult:
    kind: ServiceKind
    path: Path  # the plist or unit file written
    commands: tuple[tuple[str, ...], ...]  # what was run, in order (empty with load=False)
    env_names: tuple[str, ...]  # names of the variables carried (values stay in the file)
    log_dir: Path | None  # launchd log files; None for systemd (journal)
    system: bool = False  # the boot-time LaunchDaemon


@dataclass(frozen=True, slots=True)
class UninstallResult:
    kind: ServiceKind
    path: Path
    removed: bool  # a file was there and is gone
    commands: tuple[tuple[str, ...], ...]
    manager_error: str | None = None  # the service manager could not be asked (the file is gone regardless)


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    kind: ServiceKind
    path: Path
    installed: bool  # the file exists
    loaded: bool  # the service manager knows the job
    running: bool
    pid: int | None
    detail: str  # the manager's own state words, e.g. "running" or "active/running"
    last_exit_code: int | None = None  # as the manager saw it (None: never exited, or not known)
    last_error: str | None = None  # why the last start ended, when it was an error a restart cannot fix
    crash_loop: AbnormalExits | None = None  # the agent's own count of abnormal exits (state directory)
    system: bool = False  # the boot-time LaunchDaemon
    command: str | None = None  # what the installed file runs: "serve" or "serve --local" (None: no file)


# --- where things go


def service_kind(platform: str) -> ServiceKind:
    if platform == "darwin":
        return ServiceKind.LAUNCHD
    if platform.startswith("linux"):
        return ServiceKind.SYSTEMD
    raise ServiceError(f"background service is supported on macOS (launchd) and Linux (systemd), not {platform!r}")


def daemon_path(root: Path = Path("/")) -> Path:
    """Where ``--system`` installs the LaunchDaemon."""
    return root / DAEMON_DIR / f"{LABEL}.plist"


def service_path(kind: ServiceKind, home: Path, env: Mapping[str, str]) -> Path:
    if kind is ServiceKind.LAUNCHD:
        return home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    config_home = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else home / ".config"
    return config_home / "systemd" / "user" / UNIT_NAME


def log_dir(home: Path) -> Path:
    return launchd_log_dir(home)


def exit_timeout_s(drain_timeout_s: float) -> int:
    """How long the manager waits after SIGTERM before SIGKILL: the drain plus a margin."""
    return math.ceil(drain_timeout_s) + DRAIN_MARGIN_S


def carried_env(env: Mapping[str, str]) -> dict[str, str]:
    """The installer's variables that the service gets: every DARKBLOOM_* plus PATH and HF_*."""
    keep = {k: v for k, v in env.items() if k.startswith("DARKBLOOM_") or k in CARRIED_ENV}
    return dict(sorted(keep.items()))


def default_program(env: Mapping[str, str]) -> list[str]:
    """The command that starts the agent: the console script of this very installation."""
    beside = Path(os.path.abspath(sys.executable)).parent / "darkbloom-provider"  # no resolve(): keep the venv
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside), "serve"]
    found = shutil.which("darkbloom-provider", path=env.get("PATH"))
    if found:
        return [os.path.abspath(found), "serve"]
    return [os.path.abspath(sys.executable), "-m", "provider.cli", "serve"]


# --- rendering


def render_plist(*, program: Sequence[str], env: Mapping[str, str], home: Path, drain_timeout_s: float,
                 process_type: ProcessType = ProcessType.BACKGROUND, user: str | None = None) -> bytes:
    """``deploy/io.darkbloom.provider.plist`` with its placeholders filled, as plist XML bytes. With
    ``user`` it is the LaunchDaemon: ``UserName``, that user's ``HOME`` and ``WorkingDirectory`` are added."""
    template = plistlib.loads(_read_template(PLIST_TEMPLATE))
    # The marker tells the agent it runs under launchd (provider/supervision.py).
    environment = {**carried_env(env), SERVICE_MANAGER_ENV: "launchd"}
    if user is not None:
        environment["HOME"] = str(home)  # the agent's state, keys and logs are the user's, not root's
    values: dict[str, Any] = {
        "PROGRAM_ARGUMENTS": list(program),
        "EXIT_TIMEOUT": exit_timeout_s(drain_timeout_s),
        "LOG_DIR": str(log_dir(home)),
        "PROCESS_TYPE": _PROCESS_TYPE[ProcessType(process_type)],
        "ENVIRONMENT": environment,
    }
    plist = _fill(template, values)
    if ProcessType(process_type) is not ProcessType.BACKGROUND:
        for key in BACKGROUND_ONLY_KEYS:
            plist.pop(key, None)
    if user is not None:
        plist["UserName"] = user
        plist["WorkingDirectory"] = str(home)  # a daemon starts in /, which is not the user's
    rendered = plistlib.dumps(plist, sort_keys=False)
    plistlib.loads(rendered)  # what we write must parse
    return rendered


def render_unit(*, program: Sequence[str], env: Mapping[str, str], drain_timeout_s: float,
                crash_loop_limit: int = 5, crash_loop_window_s: float = 600.0) -> str:
    """``deploy/darkbloom-provider.service`` with its placeholders filled."""
    template = _read_template(UNIT_TEMPLATE).decode()
    # One Environment= line per variable; the placeholder owns its whole line, so none leaves no gap.
    environment = "".join(
        f'Environment="{_systemd_quote(f"{k}={v}", k)}"\n' for k, v in carried_env(env).items()
    )
    template = template.replace("@ENVIRONMENT@\n", environment)
    values = {
        # ExecStart also expands $VAR, so a literal $ is doubled there (and only there).
        "EXEC_START": " ".join(f'"{_systemd_quote(arg, "ExecStart").replace("$", "$$")}"' for arg in program),
        "STOP_TIMEOUT": str(exit_timeout_s(drain_timeout_s)),
        "CRASH_LOOP_LIMIT": str(crash_loop_limit),
        "CRASH_LOOP_WINDOW": str(math.ceil(crash_loop_window_s)),
    }
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def _read_template(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        raise ServiceError(f"service template {path} is missing: reinstall darkbloom-provider from its source") from None


def _fill(node: Any, values: Mapping[str, Any]) -> Any:
    """Replace @NAME@ placeholders: a whole-string placeholder takes the value's own type."""
    if isinstance(node, dict):
        return {k: _fill(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, values) for v in node]
    if isinstance(node, str):
        whole = _PLACEHOLDER.fullmatch(node)
        if whole:
            return values[whole.group(1)]
        return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), node)
    return node


def _systemd_quote(value: str, what: str) -> str:
    """Escape for inside a double-quoted systemd value: C escapes, and % starts a specifier."""
    if any(ord(c) < 0x20 or c == "\x7f" for c in value):
        raise ServiceError(f"{what}: control characters (e.g. a newline) cannot go into a systemd unit")
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")


# --- install / uninstall / status


def install(
    *,
    home: Path,
    platform: str = sys.platform,
    env: Mapping[str, str],
    runner: Runner = subprocess.run,
    load: bool = True,
    program: Sequence[str] | None = None,
    config_path: Path | None = None,
    args: Sequence[str] = (),
    drain_timeout_s: float = 30.0,
    uid: int | None = None,
    process_type: ProcessType = ProcessType.BACKGROUND,
    crash_loop_limit: int = 5,
    crash_loop_window_s: float = 600.0,
    system_user: str | None = None,
    root: Path = Path("/"),
    euid: int | None = None,
    local: bool = False,
) -> InstallResult:
    """Write the service file (directories created) and, unless ``load=False``, start it.

    ``args`` are setting flags for ``serve`` (values already validated, paths absolute); ``local``
    runs ``serve --local``, the owner's OpenAI server, instead of the agent. If a service manager
    command fails, the file is put back as it was: removed if this call created it, its earlier
    content restored otherwise (a ``--no-load`` install's), and the error says which. ``system_user``
    installs the boot-time LaunchDaemon that runs as that user (``home`` is that user's home); it
    needs root to load (``euid``: the effective uid, for tests), and ``root`` is where
    ``Library/LaunchDaemons`` is (``/``, or a test directory)."""
    kind = service_kind(platform)
    system = system_user is not None
    if system and kind is not ServiceKind.LAUNCHD:
        raise ServiceError("--system installs a launchd daemon (macOS). On Linux the user unit keeps running "
                           "without a login after `loginctl enable-linger $USER`")
    if system and load and (os.geteuid() if euid is None else euid) != 0:
        raise ServiceError("`service install --system` installs a LaunchDaemon, which needs root: "
                           "run it with sudo (the agent itself runs as the user it names)")
    _refuse_both(kind, home, env, root, system=system)
    manager = _manager(kind, env) if load else None  # refuse before writing anything
    argv = list(program) if program is not None else default_program(env)
    if local:
        argv.append("--local")
    if config_path is not None:
        argv += ["--config", str(config_path.expanduser().absolute())]
    if kind is ServiceKind.LAUNCHD:
        argv += ["--log-file", str(log_dir(home) / LOG_FILE)]  # before args: an explicit --log-file wins
    argv += list(args)
    path = daemon_path(root) if system else service_path(kind, home, env)
    carried = carried_env(env)
    mode = 0o600 if SECRET_ENV & carried.keys() else 0o644

    if kind is ServiceKind.LAUNCHD:
        data = render_plist(program=argv, env=env, home=home, drain_timeout_s=drain_timeout_s,
                            process_type=process_type, user=system_user)
        _make_log_dir(log_dir(home), owner=system_user,
                      as_root=(os.geteuid() if euid is None else euid) == 0)
    else:
        data = render_unit(program=argv, env=env, drain_timeout_s=drain_timeout_s, crash_loop_limit=crash_loop_limit,
                           crash_loop_window_s=crash_loop_window_s).encode()
    earlier = _read_earlier(path)
    try:
        _write(path, data, mode)
    except PermissionError:
        raise ServiceError(f"cannot write {path}: permission denied (a LaunchDaemon is installed with sudo)") from None

    commands: list[tuple[str, ...]] = []
    if manager is not None:
        try:
            _start(kind, manager, runner, path, _domain(kind, uid, system), commands)
        except ServiceError as exc:
            if earlier is None:
                path.unlink(missing_ok=True)
                undone = f"Nothing was installed ({path} removed)."
            else:  # never delete what this call did not write
                _write(path, *earlier)
                undone = f"Nothing was installed: {path} is as it was before."
            if kind is ServiceKind.SYSTEMD:  # forget the unit it may have read; best effort
                _run(runner, (manager, "--user", "daemon-reload"), check=False)
            raise ServiceError(f"{exc}. {_fix_for(kind, str(exc), local)}{undone}") from None
    return InstallResult(
        kind=kind,
        path=path,
        commands=tuple(commands),
        env_names=tuple(carried),
        log_dir=log_dir(home) if kind is ServiceKind.LAUNCHD else None,
        system=system,
    )


def _start(kind: ServiceKind, manager: str, runner: Runner, path: Path, domain: str,
           commands: list[tuple[str, ...]]) -> None:
    """Have the service manager (re)start the service from `path`; each command run is appended."""
    if kind is ServiceKind.LAUNCHD:
        # A loaded older copy would keep its old definition; bootout may fail if none is loaded.
        commands.append(_run(runner, (manager, "bootout", f"{domain}/{LABEL}"), check=False))
        commands.append(_run(runner, (manager, "bootstrap", domain, str(path))))
    else:
        commands.append(_run(runner, (manager, "--user", "daemon-reload")))
        commands.append(_run(runner, (manager, "--user", "enable", UNIT_NAME)))
        # A unit StartLimitBurst stopped stays stopped, even for `restart`, until its count is flushed
        # (systemd.unit(5)); fails harmlessly for a unit not loaded yet.
        commands.append(_run(runner, (manager, "--user", "reset-failed", UNIT_NAME), check=False))
        commands.append(_run(runner, (manager, "--user", "restart", UNIT_NAME)))  # picks up a changed unit


def _domain(kind: ServiceKind, uid: int | None, system: bool) -> str:
    """launchd's domain: ``system`` for the daemon, ``gui/<uid>`` for the per-user agent."""
    if kind is not ServiceKind.LAUNCHD:
        return ""
    return "system" if system else f"gui/{os.getuid() if uid is None else uid}"


def _refuse_both(kind: ServiceKind, home: Path, env: Mapping[str, str], root: Path, *, system: bool) -> None:
    """One agent per machine and user: the daemon and the per-user agent would share the state
    directory, the identity and the local port."""
    if kind is not ServiceKind.LAUNCHD:
        return
    other = service_path(kind, home, env) if system else daemon_path(root)
    if other.exists():
        which = ("a per-user agent is installed; remove it first with `darkbloom-provider service uninstall`"
                 if system else "the boot-time daemon is installed; remove it first with "
                 "`sudo darkbloom-provider service uninstall --system`")
        raise ServiceError(f"{which} ({other})")


def _make_log_dir(path: Path, *, owner: str | None, as_root: bool) -> None:
    """The launchd log directory; a daemon's belongs to the user it runs as, not to root (made by
    root under sudo, it is handed to that user; an account that does not exist here is left alone:
    the CLI refuses one before it gets this far)."""
    path.mkdir(parents=True, exist_ok=True)
    if owner is not None and as_root:
        import pwd

        try:
            entry = pwd.getpwnam(owner)
        except KeyError:
            return
        for directory in (path, path.parent):  # ~/Library/Logs/darkbloom and the Logs it may have made
            if directory.stat().st_uid == 0 and directory != Path(entry.pw_dir):
                os.chown(directory, entry.pw_uid, entry.pw_gid)


def uninstall(
    *,
    home: Path,
    platform: str = sys.platform,
    env: Mapping[str, str],
    runner: Runner = subprocess.run,
    load: bool = True,
    uid: int | None = None,
    system: bool = False,
    root: Path = Path("/"),
) -> UninstallResult:
    """Stop the service if the manager knows it, then remove its file. Safe to repeat."""
    kind = service_kind(platform)
    if system and kind is not ServiceKind.LAUNCHD:
        raise ServiceError("--system is the macOS boot-time daemon; there is none on this platform")
    path = daemon_path(root) if system else service_path(kind, home, env)
    commands: list[tuple[str, ...]] = []
    failed: list[str] = []  # systemctl's own words when it could not be asked
    manager = _manager(kind, env) if load else None
    if manager is not None:
        if kind is ServiceKind.LAUNCHD:  # fails when the job is not loaded: nothing to say then
            commands.append(_run(runner, (manager, "bootout", f"{_domain(kind, uid, system)}/{LABEL}"), check=False))
        else:
            commands.append(_run(runner, (manager, "--user", "disable", "--now", UNIT_NAME), check=False,
                                 failures=failed))
    removed = path.exists()
    try:
        path.unlink(missing_ok=True)
    except PermissionError:
        raise ServiceError(f"cannot remove {path}: permission denied (run it with sudo)") from None
    if manager is not None and kind is ServiceKind.SYSTEMD:
        commands.append(_run(runner, (manager, "--user", "daemon-reload"), check=False, failures=failed))
    manager_error = None
    if any(_no_user_session(f) for f in failed):
        manager_error = (f"{failed[0]}. {_NO_SESSION}, so systemd was not told: an agent this unit started may "
                         "still run (`loginctl enable-linger $USER`, or a login session, lets "
                         f"`systemctl --user disable --now {UNIT_NAME}` reach it)")
    elif failed:
        manager_error = failed[-1]
    return UninstallResult(kind=kind, path=path, removed=removed, commands=tuple(commands),
                           manager_error=manager_error)


def status(
    *,
    home: Path,
    platform: str = sys.platform,
    env: Mapping[str, str],
    runner: Runner = subprocess.run,
    uid: int | None = None,
    system: bool = False,
    root: Path = Path("/"),
    state_dir: Path | None = None,
    crash_loop_window_s: float = 600.0,
) -> ServiceStatus:
    """What the service manager says about the agent, and (with `state_dir`) the agent's own count
    of its abnormal exits."""
    kind = service_kind(platform)
    if system and kind is not ServiceKind.LAUNCHD:
        raise ServiceError("--system is the macOS boot-time daemon; there is none on this platform")
    path = daemon_path(root) if system else service_path(kind, home, env)
    manager = _manager(kind, env)
    crash_loop = None if state_dir is None else read_abnormal_exits(state_dir, window_s=crash_loop_window_s)
    command = installed_command(kind, path)
    if kind is ServiceKind.LAUNCHD:
        proc = runner([manager, "print", f"{_domain(kind, uid, system)}/{LABEL}"], capture_output=True, text=True,
                      check=False)
        record = read_exit_record(home)  # the agent's own account of an error exit (supervision.py)
        last_error = None if record is None else f"{record.reason.value} at {record.at}: {record.message}"
        if proc.returncode != 0:
            return ServiceStatus(kind, path, path.exists(), False, False, None, "not loaded", None, last_error,
                                 crash_loop, system, command)
        fields = _launchctl_fields(proc.stdout)
        state = fields.get("state", "unknown")
        pid = int(fields["pid"]) if fields.get("pid", "").isdigit() else None
        # "last exit code = 78: EX_CONFIG", "= 0" or "= (never exited)", depending on macOS.
        last_code = re.match(r"-?\d+", fields.get("last exit code", ""))
        return ServiceStatus(kind, path, path.exists(), True, state == "running", pid, state,
                             int(last_code.group()) if last_code else None,
                             None if state == "running" else last_error, crash_loop, system, command)

    proc = runner(
        [manager, "--user", "show", UNIT_NAME,
         "--property=LoadState,ActiveState,SubState,MainPID,ExecMainStatus,Result"],
        capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        failure = f"`systemctl --user show` failed: {_first_line(proc.stderr)}"
        if _no_user_session(failure):
            installed = f"{path} is installed" if path.exists() else f"nothing is installed at {path}"
            raise ServiceError(f"{_NO_SESSION}, so systemd cannot be asked about {UNIT_NAME} ({installed}): run "
                               "`loginctl enable-linger $USER` and log in again (or `export XDG_RUNTIME_DIR=/run/user/"
                               "$(id -u)`) and ask again; `darkbloom-provider status` asks a running agent itself")
        raise ServiceError(failure)
    props = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    loaded = props.get("LoadState") == "loaded"
    active, sub = props.get("ActiveState", "unknown"), props.get("SubState", "unknown")
    main_pid = props.get("MainPID", "0")
    pid = int(main_pid) if main_pid.isdigit() and main_pid != "0" else None
    code = int(props["ExecMainStatus"]) if props.get("ExecMainStatus", "").isdigit() else None
    running = active == "active"
    last_error = None
    if code == EX_CONFIG and not running:  # RestartPreventExitStatus=78: stopped, waiting for a fix
        last_error = f"configuration_error (exit {EX_CONFIG}): see `journalctl --user -u {UNIT_NAME}`"
    elif sub == "failed" and props.get("Result") == "start-limit-hit":
        last_error = "crash_loop: systemd's start limit was hit (StartLimitBurst within StartLimitIntervalSec)"
    return ServiceStatus(kind, path, path.exists(), loaded, running, pid, f"{active}/{sub}", code, last_error,
                         crash_loop, command=command)


# --- helpers


def _manager(kind: ServiceKind, env: Mapping[str, str]) -> str:
    name = "launchctl" if kind is ServiceKind.LAUNCHD else "systemctl"
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found is None:
        what = "launchd (macOS)" if kind is ServiceKind.LAUNCHD else "systemd user services"
        raise ServiceError(
            f"`{name}` is not on PATH, so {what} cannot run the agent here. "
            "Use `service install --no-load` to only write the file, or run `darkbloom-provider serve` yourself."
        )
    return found


def _run(runner: Runner, argv: tuple[str, ...], *, check: bool = True,
         failures: list[str] | None = None) -> tuple[str, ...]:
    """Run one manager command; a failure raises (`check`) or is described into `failures`."""
    proc = runner(list(argv), capture_output=True, text=True, check=False)
    if proc.returncode != 0 and (check or failures is not None):
        shown = " ".join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv))
        failure = f"`{shown}` failed (exit {proc.returncode}): {_first_line(proc.stderr)}"
        if check:
            raise ServiceError(failure)
        failures.append(failure)  # type: ignore[union-attr]
    return argv


def _no_user_session(failure: str) -> bool:
    """systemctl --user's words when there is no user manager to talk to (an SSH or su login without a
    session: "Failed to connect to bus", "$DBUS_SESSION_BUS_ADDRESS and $XDG_RUNTIME_DIR not defined")."""
    return "systemctl" in failure and ("bus" in failure.lower() or "XDG_RUNTIME_DIR" in failure)


_NO_SESSION = "There is no systemd user session here (common over SSH or su)"


def _fix_for(kind: ServiceKind, failure: str, local: bool) -> str:
    """What the operator can do when starting failed for a reason we recognise ("" otherwise), ending in a space."""
    if kind is not ServiceKind.SYSTEMD or not _no_user_session(failure):
        return ""
    serve = "darkbloom-provider serve --local" if local else "darkbloom-provider serve"
    return (f"{_NO_SESSION}: run `loginctl enable-linger $USER` and log in again (or `export "
            "XDG_RUNTIME_DIR=/run/user/$(id -u)`), then install again; or install with --no-load and start it "
            f"yourself (`{serve}`). ")


def _read_earlier(path: Path) -> tuple[bytes, int] | None:
    """The service file already there (its bytes and mode), to put back if starting fails."""
    try:
        return path.read_bytes(), path.stat().st_mode & 0o777
    except FileNotFoundError:
        return None
    except OSError:
        raise ServiceError(f"cannot read {path} (an earlier service file): check its permissions") from None


def installed_command(kind: ServiceKind, path: Path) -> str | None:
    """What the installed service file runs: "serve", "serve --local", or None (no file, not ours)."""
    try:
        if kind is ServiceKind.LAUNCHD:
            argv = [str(a) for a in plistlib.loads(path.read_bytes()).get("ProgramArguments", [])]
        else:
            line = next((ln for ln in path.read_text().splitlines() if ln.startswith("ExecStart=")), "")
            argv = shlex.split(line.removeprefix("ExecStart="))  # the double quotes render_unit writes
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        return None
    if "serve" not in argv:
        return None
    after = argv[argv.index("serve") + 1:]
    return "serve --local" if after[:1] == ["--local"] else "serve"


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data, mode=mode)


def _launchctl_fields(text: str) -> dict[str, str]:
    """Top-level ``key = value`` lines of ``launchctl print`` (one tab deep)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("\t") and not line.startswith("\t\t") and " = " in line:
            key, value = line.strip().split(" = ", 1)
            fields.setdefault(key, value)
    return fields


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0][:200] if lines else "no error output"
