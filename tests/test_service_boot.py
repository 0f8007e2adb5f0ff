"""The boot-time LaunchDaemon (`service install --system`), ProcessType as a setting, and the systemd
start limit. The daemon needs root to load: these tests write the plist into a
temporary root and check it, and check the launchctl commands against a recorder."""

from __future__ import annotations

import json
import plistlib
import pwd
import subprocess
from pathlib import Path

import pytest

from cli_runner import run_cli
from provider.config import ProcessType
from provider.service import LABEL, ServiceError, daemon_path, install, status, uninstall
from provider.supervision import ABNORMAL_EXITS_FILE
from service_recorder import Recorder

PROGRAM = ["/opt/darkbloom/venv/bin/darkbloom-provider", "serve"]


@pytest.fixture
def user_home(tmp_path: Path) -> Path:
    home = tmp_path / "Users" / "op"
    home.mkdir(parents=True)
    return home


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    exe = d / "launchctl"
    exe.write_text("#!/bin/sh\nexit 99\n")
    exe.chmod(0o755)
    return d


def test_the_daemon_plist_runs_the_agent_as_the_user_at_boot(user_home, root):
    env = {"PATH": "/usr/bin:/bin", "DARKBLOOM_MAX_MODEL_SLOTS": "2"}
    result = install(home=user_home, platform="darwin", env=env, load=False, program=PROGRAM, system_user="op",
                     root=root, euid=501)
    assert result.system and result.path == root / "Library/LaunchDaemons/io.darkbloom.provider.plist"
    assert result.path == daemon_path(root)
    logs = user_home / "Library/Logs/darkbloom"
    plist = plistlib.loads(result.path.read_bytes())
    assert plist["Label"] == LABEL
    assert plist["UserName"] == "op"  # never root
    assert plist["EnvironmentVariables"]["HOME"] == str(user_home)  # the user's state and keys
    assert plist["WorkingDirectory"] == str(user_home)
    assert plist["EnvironmentVariables"]["DARKBLOOM_SERVICE_MANAGER"] == "launchd"
    assert plist["EnvironmentVariables"]["DARKBLOOM_MAX_MODEL_SLOTS"] == "2"
    assert plist["ProgramArguments"] == [*PROGRAM, "--log-file", f"{logs}/provider.log"]
    assert plist["StandardErrorPath"] == f"{logs}/provider.stderr.log" and logs.is_dir()
    assert (plist["RunAtLoad"], plist["KeepAlive"], plist["ProcessType"]) == (True, {"SuccessfulExit": False},
                                                                               "Background")
    assert not (user_home / "Library/LaunchAgents").exists()  # not the per-user agent


def test_loading_the_daemon_needs_root_and_writes_nothing_without_it(user_home, root, bin_dir):
    runner = Recorder()
    with pytest.raises(ServiceError, match="needs root: run it with sudo"):
        install(home=user_home, platform="darwin", env={"PATH": str(bin_dir)}, runner=runner, program=PROGRAM,
                system_user="op", root=root, euid=501)
    assert runner.calls == [] and not daemon_path(root).exists()


def test_the_daemon_is_bootstrapped_into_the_system_domain(user_home, root, bin_dir):
    runner = Recorder()
    user = pwd.getpwuid(0).pw_name  # a real account (chown of the log directory), as under sudo
    install(home=user_home, platform="darwin", env={"PATH": str(bin_dir)}, runner=runner, program=PROGRAM,
            system_user=user, root=root, euid=0)
    launchctl = str(bin_dir / "launchctl")
    assert runner.calls == [[launchctl, "bootout", f"system/{LABEL}"],
                            [launchctl, "bootstrap", "system", str(daemon_path(root))]]
    shown = f"system/{LABEL} = {{\n\tstate = running\n\tpid = 812\n}}\n"
    st = status(home=user_home, platform="darwin", env={"PATH": str(bin_dir)},
                runner=Recorder({"print": (0, shown, "")}), system=True, root=root)
    assert (st.system, st.running, st.pid, st.installed) == (True, True, 812, True)
    runner = Recorder()
    gone = uninstall(home=user_home, platform="darwin", env={"PATH": str(bin_dir)}, runner=runner, system=True,
                     root=root)
    assert runner.calls == [[launchctl, "bootout", f"system/{LABEL}"]]
    assert gone.removed and not daemon_path(root).exists()


def test_daemon_and_agent_are_one_or_the_other(user_home, root):
    install(home=user_home, platform="darwin", env={}, load=False, program=PROGRAM, root=root)
    with pytest.raises(ServiceError, match="a per-user agent is installed; remove it first"):
        install(home=user_home, platform="darwin", env={}, load=False, program=PROGRAM, system_user="op", root=root)
    uninstall(home=user_home, platform="darwin", env={}, load=False)
    install(home=user_home, platform="darwin", env={}, load=False, program=PROGRAM, system_user="op", root=root)
    with pytest.raises(ServiceError, match="the boot-time daemon is installed"):
        install(home=user_home, platform="darwin", env={}, load=False, program=PROGRAM, root=root)


def test_system_is_for_launchd_only(user_home, root):
    with pytest.raises(ServiceError, match="enable-linger"):
        install(home=user_home, platform="linux", env={}, load=False, program=PROGRAM, system_user="op", root=root)


@pytest.mark.parametrize(("setting", "launchd", "throttled"), [
    (ProcessType.BACKGROUND, "Background", True),
    (ProcessType.STANDARD, "Standard", False),
    (ProcessType.INTERACTIVE, "Interactive", False),
])
def test_process_type_is_a_setting(user_home, setting, launchd, throttled):
    result = install(home=user_home, platform="darwin", env={}, load=False, program=PROGRAM, process_type=setting)
    plist = plistlib.loads(result.path.read_bytes())
    assert plist["ProcessType"] == launchd
    # Nice and LowPriorityIO only hold the agent back when the owner comes first.
    assert ("Nice" in plist and "LowPriorityIO" in plist) is throttled


def test_the_systemd_unit_stops_a_crash_loop_with_the_same_limit(user_home):
    result = install(home=user_home, platform="linux", env={}, load=False, program=PROGRAM, crash_loop_limit=3,
                     crash_loop_window_s=300)
    unit = result.path.read_text()
    section = unit[unit.index("[Unit]"):unit.index("[Service]")]
    assert "StartLimitIntervalSec=300\n" in section and "StartLimitBurst=3\n" in section


def test_systemd_install_flushes_the_start_limit(user_home, bin_dir):
    # A unit stopped by StartLimitBurst stays stopped, even for `systemctl restart`, until
    # `reset-failed` (systemd.unit(5)): `service install` starts it again with the count reset.
    (bin_dir / "systemctl").write_text("#!/bin/sh\nexit 99\n")
    (bin_dir / "systemctl").chmod(0o755)
    runner = Recorder({"reset-failed": (1, "", "Unit darkbloom-provider.service not loaded.")})  # a first install
    install(home=user_home, platform="linux", env={"PATH": str(bin_dir)}, runner=runner, program=PROGRAM)
    verbs = [call[2] for call in runner.calls]
    assert verbs == ["daemon-reload", "enable", "reset-failed", "restart"]
    assert runner.calls[2][3:] == ["darkbloom-provider.service"]


def test_cli_system_needs_a_user_who_is_not_root(tmp_path):
    out = run_cli("service", "install", "--system", "--no-load", home=tmp_path, env={"SUDO_USER": "root"})
    assert out.returncode == 78 and "the agent never runs as root" in out.stderr
    out = run_cli("service", "install", "--system", "--no-load", "--user", "no-such-user-here", home=tmp_path)
    assert out.returncode == 78 and "no such user" in out.stderr


def test_install_starts_the_crash_count_afresh(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / ABNORMAL_EXITS_FILE).write_text('{"abnormal_exits": [{"at": "2026-01-01T00:00:00+00:00", "kind": "crash"}], '
                                             '"stayed_down_at": null}')
    out = run_cli("service", "install", "--no-load", "--state-dir", str(state), home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert not (state / ABNORMAL_EXITS_FILE).exists()


def test_status_shows_the_agents_own_count(tmp_path, bin_dir):
    from datetime import UTC, datetime

    state = tmp_path / "state"
    state.mkdir()
    now = datetime.now(UTC).isoformat(timespec="seconds")
    entries = [{"at": now, "kind": "crash"}, {"at": now, "kind": "memory_restart"}]
    (state / ABNORMAL_EXITS_FILE).write_text(json.dumps({"abnormal_exits": entries, "stayed_down_at": None}))
    st = status(home=tmp_path, platform="darwin", env={"PATH": str(bin_dir)},
                runner=Recorder({"print": (113, "", "Could not find service")}), state_dir=state, uid=501)
    assert st.crash_loop is not None and len(st.crash_loop.abnormal_exits) == 2 and not st.loaded


def test_recorder_is_the_one_from_test_service():
    assert isinstance(Recorder()(["launchctl", "print", "x"], capture_output=True, text=True, check=False),
                      subprocess.CompletedProcess)


def test_systemd_status_names_a_start_limit_hit_a_crash_loop(tmp_path, bin_dir):
    (bin_dir / "systemctl").write_text("#!/bin/sh\nexit 99\n")
    (bin_dir / "systemctl").chmod(0o755)
    # What `systemctl --user show` prints for a unit that StartLimitBurst stopped (Result=start-limit-hit).
    shown = ("LoadState=loaded\nActiveState=failed\nSubState=failed\nMainPID=0\nExecMainStatus=9\n"
             "Result=start-limit-hit\n")
    st = status(home=tmp_path, platform="linux", env={"PATH": str(bin_dir)}, runner=Recorder({"show": (0, shown, "")}))
    assert not st.running and st.last_error is not None and st.last_error.startswith("crash_loop: ")


def test_status_and_uninstall_find_the_daemons_user_in_its_plist(user_home, root):
    """`service status --system` needs no sudo, and neither command has --user: the daemon's own plist
    names the user whose state directory and logs they read."""
    import getpass

    from provider import cli
    from provider.config import ConfigError

    install(home=user_home, platform="darwin", env={}, load=False, program=PROGRAM, system_user="op", root=root)
    daemon = daemon_path(root)
    for action in ("status", "uninstall"):
        args = cli.build_parser().parse_args(["service", action, "--system"])
        assert cli.system_user(args, {}, daemon=daemon) == "op"
    uninstall(home=user_home, platform="darwin", env={}, load=False, system=True, root=root)
    args = cli.build_parser().parse_args(["service", "status", "--system"])
    assert cli.system_user(args, {}, daemon=daemon) == getpass.getuser()  # none installed: whoever asks
    assert cli.system_user(args, {"SUDO_USER": "op"}, daemon=daemon) == "op"
    install_args = cli.build_parser().parse_args(["service", "install", "--system"])
    with pytest.raises(ConfigError, match="never runs as root"):
        cli.system_user(install_args, {"SUDO_USER": "root"}, daemon=daemon)
