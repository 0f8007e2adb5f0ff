"""provider/service: install into a temporary home, read back what was written, check the commands."""

from __future__ import annotations

import plistlib
import stat
import sys
from pathlib import Path

import pytest

from cli_runner import run_cli
from provider.service import (
    LABEL,
    PLIST_TEMPLATE,
    UNIT_NAME,
    UNIT_TEMPLATE,
    ServiceError,
    ServiceKind,
    default_program,
    install,
    status,
    uninstall,
)
from service_recorder import Recorder

PROGRAM = ["/opt/darkbloom/venv/bin/darkbloom-provider", "serve"]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A PATH directory holding (never run) launchctl and systemctl executables."""
    d = tmp_path / "bin"
    d.mkdir()
    for name in ("launchctl", "systemctl"):
        exe = d / name
        exe.write_text("#!/bin/sh\nexit 99\n")
        exe.chmod(0o755)
    return d


def operator_env(path: str) -> dict[str, str]:
    return {
        "PATH": path,
        "HOME": "/ignored",
        "HF_HOME": "/Volumes/models/hf",
        "DARKBLOOM_MAX_MODEL_SLOTS": "2",
        "DARKBLOOM_MEMORY_RESERVE_GB": "6",
        "DARKBLOOM_COORDINATOR_URL": "wss://api.darkbloom.dev/ws/provider",
        "OPENAI_API_KEY": "sk-not-ours",
        "SHELL": "/bin/zsh",
    }


# --- launchd


def test_templates_in_deploy_are_what_gets_installed() -> None:
    template = plistlib.loads(PLIST_TEMPLATE.read_bytes())
    assert template["Label"] == LABEL
    assert "@EXEC_START@" in UNIT_TEMPLATE.read_text()


def test_launchd_plist_has_every_key_and_value(home: Path) -> None:
    env = operator_env("/usr/bin:/bin")
    result = install(home=home, platform="darwin", env=env, load=False, program=PROGRAM, drain_timeout_s=30)
    assert result.kind is ServiceKind.LAUNCHD
    assert result.path == home / "Library/LaunchAgents/io.darkbloom.provider.plist"
    assert result.commands == ()
    logs = home / "Library/Logs/darkbloom"
    assert result.log_dir == logs and logs.is_dir()

    plist = plistlib.loads(result.path.read_bytes())
    assert plist == {
        "Label": "io.darkbloom.provider",
        "ProgramArguments": [*PROGRAM, "--log-file", f"{logs}/provider.log"],  # the agent rotates it
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 30,
        "ExitTimeOut": 45,
        "ProcessType": "Background",
        "LowPriorityIO": True,
        "Nice": 10,
        "StandardOutPath": f"{logs}/provider.out.log",
        "StandardErrorPath": f"{logs}/provider.stderr.log",
        "EnvironmentVariables": {
            "DARKBLOOM_COORDINATOR_URL": "wss://api.darkbloom.dev/ws/provider",
            "DARKBLOOM_MAX_MODEL_SLOTS": "2",
            "DARKBLOOM_MEMORY_RESERVE_GB": "6",
            "HF_HOME": "/Volumes/models/hf",
            "PATH": "/usr/bin:/bin",
            "DARKBLOOM_SERVICE_MANAGER": "launchd",  # the agent's cue: no relaunch loop on a config error
        },
    }
    assert result.env_names == tuple(k for k in plist["EnvironmentVariables"] if k != "DARKBLOOM_SERVICE_MANAGER")
    assert stat.S_IMODE(result.path.stat().st_mode) == 0o644
    assert "@" not in result.path.read_text()


def test_exit_timeout_follows_the_drain_timeout_and_config_is_passed(home: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "p.toml"
    result = install(home=home, platform="darwin", env={"PATH": "/bin"}, load=False, program=PROGRAM,
                     config_path=cfg, drain_timeout_s=90.5)
    plist = plistlib.loads(result.path.read_bytes())
    assert plist["ExitTimeOut"] == 91 + 15
    assert plist["ProgramArguments"][:4] == [*PROGRAM, "--config", str(cfg)]
    assert plist["EnvironmentVariables"] == {"PATH": "/bin", "DARKBLOOM_SERVICE_MANAGER": "launchd"}


def test_launchd_install_boots_out_then_bootstraps(home: Path, bin_dir: Path) -> None:
    runner = Recorder({"bootout": (3, "", "Boot-out failed: 3: No such process")})  # not loaded yet: fine
    result = install(home=home, platform="darwin", env=operator_env(str(bin_dir)), runner=runner,
                     program=PROGRAM, uid=501)
    launchctl = str(bin_dir / "launchctl")
    expected = [
        [launchctl, "bootout", f"gui/501/{LABEL}"],
        [launchctl, "bootstrap", "gui/501", str(result.path)],
    ]
    assert runner.calls == expected
    assert [list(c) for c in result.commands] == expected


def test_launchd_bootstrap_failure_is_a_clear_error(home: Path, bin_dir: Path) -> None:
    runner = Recorder({"bootstrap": (5, "", "Bootstrap failed: 5: Input/output error\nmore")})
    with pytest.raises(ServiceError, match=r"^`launchctl bootstrap gui/501 .*` failed \(exit 5\): Bootstrap failed"):
        install(home=home, platform="darwin", env={"PATH": str(bin_dir)}, runner=runner, program=PROGRAM, uid=501)


def test_secret_token_makes_the_file_private(home: Path) -> None:
    env = {"PATH": "/bin", "DARKBLOOM_AUTH_TOKEN": "dbp_secret"}
    result = install(home=home, platform="darwin", env=env, load=False, program=PROGRAM)
    assert stat.S_IMODE(result.path.stat().st_mode) == 0o600
    assert plistlib.loads(result.path.read_bytes())["EnvironmentVariables"]["DARKBLOOM_AUTH_TOKEN"] == "dbp_secret"
    again = install(home=home, platform="darwin", env={"PATH": "/bin"}, load=False, program=PROGRAM)
    assert stat.S_IMODE(again.path.stat().st_mode) == 0o644
    assert "dbp_secret" not in again.path.read_text()


def test_launchd_status_parses_launchctl_print(home: Path, bin_dir: Path) -> None:
    printed = (
        f"gui/501/{LABEL} = {{\n\tactive count = 1\n\tstate = running\n\tpid = 4242\n"
        "\tenvironment = {\n\t\tpid = 1\n\t}\n}\n"
    )
    running = status(home=home, platform="darwin", env={"PATH": str(bin_dir)},
                     runner=Recorder({"print": (0, printed, "")}), uid=501)
    assert (running.loaded, running.running, running.pid, running.detail) == (True, True, 4242, "running")
    assert running.installed is False and running.last_exit_code is None and running.last_error is None
    crashed = status(home=home, platform="darwin", env={"PATH": str(bin_dir)}, uid=501, runner=Recorder(
        {"print": (0, f"gui/501/{LABEL} = {{\n\tstate = not running\n\tlast exit code = 78: EX_CONFIG\n}}\n", "")}))
    assert (crashed.running, crashed.last_exit_code) == (False, 78)
    gone = status(home=home, platform="darwin", env={"PATH": str(bin_dir)},
                  runner=Recorder({"print": (113, "", "Could not find service")}), uid=501)
    assert (gone.loaded, gone.running, gone.pid, gone.detail) == (False, False, None, "not loaded")


def test_launchd_uninstall_boots_out_and_removes(home: Path, bin_dir: Path) -> None:
    env = {"PATH": str(bin_dir)}
    path = install(home=home, platform="darwin", env=env, load=False, program=PROGRAM).path
    runner = Recorder()
    result = uninstall(home=home, platform="darwin", env=env, runner=runner, uid=501)
    assert runner.calls == [[str(bin_dir / "launchctl"), "bootout", f"gui/501/{LABEL}"]]
    assert result.removed and not path.exists()
    assert uninstall(home=home, platform="darwin", env=env, runner=Recorder(), uid=501).removed is False


# --- systemd


def test_systemd_unit_lines(home: Path) -> None:
    env = {**operator_env("/usr/bin:/bin"), "DARKBLOOM_MODEL_DIRS": '~/my "models",/srv/100%'}
    program = ["/home/op/.venv/bin/darkbloom-provider", "serve", "--config", "/home/op/a $b.toml"]
    result = install(home=home, platform="linux", env=env, load=False, program=program, drain_timeout_s=30)
    assert result.kind is ServiceKind.SYSTEMD and result.log_dir is None
    assert result.path == home / ".config/systemd/user/darkbloom-provider.service"
    lines = result.path.read_text().splitlines()
    service = lines[lines.index("[Service]") + 1 : lines.index("[Install]")]
    assert [line for line in service if line and not line.startswith("#")] == [
        "Type=exec",
        'ExecStart="/home/op/.venv/bin/darkbloom-provider" "serve" "--config" "/home/op/a $$b.toml"',
        'Environment="DARKBLOOM_COORDINATOR_URL=wss://api.darkbloom.dev/ws/provider"',
        'Environment="DARKBLOOM_MAX_MODEL_SLOTS=2"',
        'Environment="DARKBLOOM_MEMORY_RESERVE_GB=6"',
        'Environment="DARKBLOOM_MODEL_DIRS=~/my \\"models\\",/srv/100%%"',
        'Environment="HF_HOME=/Volumes/models/hf"',
        'Environment="PATH=/usr/bin:/bin"',
        "Restart=on-failure",
        "RestartSec=30",
        "RestartPreventExitStatus=78",
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        "TimeoutStopSec=45",
    ]
    assert "WantedBy=default.target" in lines
    assert "@" not in result.path.read_text()


def test_systemd_unit_without_environment_has_no_gap(home: Path) -> None:
    result = install(home=home, platform="linux", env={}, load=False, program=PROGRAM)
    text = result.path.read_text()
    assert 'ExecStart="/opt/darkbloom/venv/bin/darkbloom-provider" "serve"\nRestart=on-failure\n' in text
    assert "Environment=" not in text


def test_xdg_config_home_places_the_unit(home: Path, tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    result = install(home=home, platform="linux", env=env, load=False, program=PROGRAM)
    assert result.path == tmp_path / "xdg/systemd/user" / UNIT_NAME


def test_newline_in_a_carried_value_is_refused_without_echoing_it(home: Path) -> None:
    env = {"DARKBLOOM_AUTH_TOKEN": "dbp_line1\nline2"}
    with pytest.raises(ServiceError, match="DARKBLOOM_AUTH_TOKEN: control characters") as info:
        install(home=home, platform="linux", env=env, load=False, program=PROGRAM)
    assert "dbp_line1" not in str(info.value)


def test_systemd_install_commands(home: Path, bin_dir: Path) -> None:
    runner = Recorder()
    install(home=home, platform="linux", env={"PATH": str(bin_dir)}, runner=runner, program=PROGRAM)
    systemctl = str(bin_dir / "systemctl")
    assert runner.calls == [
        [systemctl, "--user", "daemon-reload"],
        [systemctl, "--user", "enable", UNIT_NAME],
        [systemctl, "--user", "reset-failed", UNIT_NAME],
        [systemctl, "--user", "restart", UNIT_NAME],
    ]


def test_systemd_without_a_user_manager_is_a_clear_error(home: Path, bin_dir: Path) -> None:
    runner = Recorder({"daemon-reload": (1, "", "Failed to connect to bus: No medium found")})
    with pytest.raises(ServiceError, match=r"`systemctl --user daemon-reload` failed \(exit 1\): Failed to connect"):
        install(home=home, platform="linux", env={"PATH": str(bin_dir)}, runner=runner, program=PROGRAM)


def test_systemd_status_and_uninstall(home: Path, bin_dir: Path) -> None:
    env = {"PATH": str(bin_dir)}
    path = install(home=home, platform="linux", env=env, load=False, program=PROGRAM).path
    shown = "LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=777\n"
    st = status(home=home, platform="linux", env=env, runner=Recorder({"show": (0, shown, "")}))
    assert (st.installed, st.loaded, st.running, st.pid, st.detail) == (True, True, True, 777, "active/running")
    idle = "LoadState=not-found\nActiveState=inactive\nSubState=dead\nMainPID=0\n"
    st = status(home=home, platform="linux", env=env, runner=Recorder({"show": (0, idle, "")}))
    assert (st.loaded, st.running, st.pid) == (False, False, None)

    runner = Recorder()
    result = uninstall(home=home, platform="linux", env=env, runner=runner)
    systemctl = str(bin_dir / "systemctl")
    assert runner.calls == [
        [systemctl, "--user", "disable", "--now", UNIT_NAME],
        [systemctl, "--user", "daemon-reload"],
    ]
    assert result.removed and not path.exists()


# --- refusals


@pytest.mark.parametrize(("platform", "tool"), [("darwin", "launchctl"), ("linux", "systemctl")])
def test_missing_service_manager_is_refused_before_writing(
    home: Path, tmp_path: Path, platform: str, tool: str
) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    runner = Recorder()
    with pytest.raises(ServiceError, match=rf"`{tool}` is not on PATH.*--no-load"):
        install(home=home, platform=platform, env={"PATH": str(empty)}, runner=runner, program=PROGRAM)
    assert runner.calls == []
    assert not (home / "Library").exists() and not (home / ".config").exists()
    with pytest.raises(ServiceError, match=f"`{tool}` is not on PATH"):
        status(home=home, platform=platform, env={"PATH": str(empty)}, runner=runner)


def test_unsupported_platform() -> None:
    with pytest.raises(ServiceError, match="not 'win32'"):
        install(home=Path("/tmp/x"), platform="win32", env={}, load=False)


def test_default_program_is_this_installations_console_script() -> None:
    argv = default_program({"PATH": ""})
    assert argv[-1] == "serve"
    assert Path(argv[0]).is_absolute()
    assert Path(argv[0]).name in {"darkbloom-provider", "python", "python3"} or argv[1:3] == ["-m", "provider.cli"]


# --- a failed install leaves nothing behind


def test_a_failed_launchd_bootstrap_leaves_no_plist(home: Path, bin_dir: Path) -> None:
    runner = Recorder({"bootstrap": (5, "", "Bootstrap failed: 5: Input/output error")})
    with pytest.raises(ServiceError, match=r"Nothing was installed .*removed"):
        install(home=home, platform="darwin", env={"PATH": str(bin_dir)}, runner=runner, program=PROGRAM, uid=501)
    assert not (home / "Library/LaunchAgents/io.darkbloom.provider.plist").exists()
    assert list((home / "Library/LaunchAgents").iterdir()) == []  # no temporary file either


def test_a_failed_systemd_start_leaves_no_unit_and_systemd_forgets_it(home: Path, bin_dir: Path) -> None:
    runner = Recorder({"restart": (1, "", "Job for darkbloom-provider.service failed")})
    with pytest.raises(ServiceError, match=r"`systemctl --user restart .*` failed .*Nothing was installed"):
        install(home=home, platform="linux", env={"PATH": str(bin_dir)}, runner=runner, program=PROGRAM)
    assert not (home / ".config/systemd/user" / UNIT_NAME).exists()
    systemctl = str(bin_dir / "systemctl")
    assert runner.calls[-1] == [systemctl, "--user", "daemon-reload"]  # after the removal


# --- what `service status` says about the last exit


def test_launchd_status_shows_a_recorded_configuration_error(home: Path, bin_dir: Path) -> None:
    from provider.supervision import ExitReason, exit_code_for

    code = exit_code_for(ExitReason.CONFIGURATION, 78, "environment variable DARKBLOOM_MAX_MODEL_SLOTS: value 'x' "
                         "is not allowed", home=home, env={"DARKBLOOM_SERVICE_MANAGER": "launchd"})
    assert code == 0
    printed = f"gui/501/{LABEL} = {{\n\tstate = not running\n\tlast exit code = 0\n}}\n"
    st = status(home=home, platform="darwin", env={"PATH": str(bin_dir)},
                runner=Recorder({"print": (0, printed, "")}), uid=501)
    assert (st.running, st.last_exit_code) == (False, 0)
    assert st.last_error is not None and st.last_error.startswith("configuration_error at ")
    assert "DARKBLOOM_MAX_MODEL_SLOTS" in st.last_error


def test_systemd_status_shows_a_configuration_exit(home: Path, bin_dir: Path) -> None:
    shown = "LoadState=loaded\nActiveState=failed\nSubState=failed\nMainPID=0\nExecMainStatus=78\n"
    st = status(home=home, platform="linux", env={"PATH": str(bin_dir)}, runner=Recorder({"show": (0, shown, "")}))
    assert (st.running, st.last_exit_code) == (False, 78)
    assert st.last_error is not None and "journalctl --user -u darkbloom-provider" in st.last_error


# --- the operator's first hour on Linux

NO_BUS = (1, "", "Failed to connect to bus: No medium found")  # systemctl --user without a user session


def test_systemd_without_a_user_session_says_how_to_fix_it(home: Path, bin_dir: Path) -> None:
    runner = Recorder({"daemon-reload": NO_BUS})
    with pytest.raises(ServiceError) as info:
        install(home=home, platform="linux", env={"PATH": str(bin_dir)}, runner=runner, program=PROGRAM)
    message = str(info.value)
    assert "Failed to connect to bus" in message  # what systemctl said, then the fix
    assert "loginctl enable-linger" in message and "--no-load" in message and "darkbloom-provider serve" in message
    assert not (home / ".config/systemd/user" / UNIT_NAME).exists()


@pytest.mark.parametrize(("platform", "failing"), [("linux", "daemon-reload"), ("darwin", "bootstrap")])
def test_a_failed_install_keeps_the_file_an_earlier_no_load_wrote(home: Path, bin_dir: Path, platform: str,
                                                                   failing: str) -> None:
    env = {"PATH": str(bin_dir)}
    earlier = install(home=home, platform=platform, env=env, load=False, program=PROGRAM).path
    written = earlier.read_bytes()
    runner = Recorder({failing: NO_BUS if platform == "linux" else (5, "", "Bootstrap failed: 5: Input/output error")})
    with pytest.raises(ServiceError) as info:
        install(home=home, platform=platform, env=env, runner=runner, program=[*PROGRAM, "--local"], uid=501)
    assert earlier.read_bytes() == written  # not deleted, not left half-changed
    assert f"{earlier} is as it was before" in str(info.value) and "removed" not in str(info.value)
    assert list(earlier.parent.iterdir()) == [earlier]  # no temporary file either


def test_uninstall_says_what_it_removed_when_systemd_cannot_be_asked(home: Path, bin_dir: Path) -> None:
    env = {"PATH": str(bin_dir)}
    path = install(home=home, platform="linux", env=env, load=False, program=PROGRAM).path
    result = uninstall(home=home, platform="linux", env=env, runner=Recorder({"disable": NO_BUS,
                                                                             "daemon-reload": NO_BUS}))
    assert result.removed and not path.exists()
    assert result.manager_error is not None and "loginctl enable-linger" in result.manager_error


def test_install_local_runs_the_openai_server_and_status_finds_it(home: Path, bin_dir: Path) -> None:
    env = {"PATH": str(bin_dir)}
    result = install(home=home, platform="linux", env=env, load=False, program=PROGRAM, local=True)
    exec_start = next(line for line in result.path.read_text().splitlines() if line.startswith("ExecStart="))
    assert exec_start == 'ExecStart="/opt/darkbloom/venv/bin/darkbloom-provider" "serve" "--local"'
    shown = "LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=777\n"
    st = status(home=home, platform="linux", env=env, runner=Recorder({"show": (0, shown, "")}))
    assert st.installed and st.command == "serve --local"
    plist = install(home=home, platform="darwin", env=env, load=False, program=PROGRAM, local=True).path
    assert plistlib.loads(plist.read_bytes())["ProgramArguments"][:3] == [*PROGRAM, "--local"]
    st = status(home=home, platform="darwin", env=env, runner=Recorder({"print": (113, "", "not found")}), uid=501)
    assert st.installed and st.command == "serve --local"
    assert uninstall(home=home, platform="linux", env=env, runner=Recorder()).removed


def fake_manager(tmp_path: Path, script: str) -> str:
    """A PATH whose `launchctl` or `systemctl` (this platform's) runs `script`."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    tool = bin_dir / ("launchctl" if sys.platform == "darwin" else "systemctl")
    tool.write_text(f"#!/bin/sh\n{script}\n")
    tool.chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def test_cli_install_local_status_and_uninstall(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    out = run_cli("service", "install", "--local", "--no-load", "--local-port", "9100", home=home)
    assert out.returncode == 0, out.stderr
    assert "serve --local" in out.stdout and "http://127.0.0.1:9100/v1" in out.stdout
    path = fake_manager(tmp_path, "printf 'LoadState=loaded\\nActiveState=active\\nSubState=running\\nMainPID=4242\\n'"
                        if sys.platform != "darwin" else "exit 113")
    st = run_cli("service", "status", home=home, env={"PATH": path})
    assert "serve --local" in st.stdout, st.stdout + st.stderr
    gone = run_cli("service", "uninstall", "--no-load", home=home)
    assert gone.returncode == 0 and "removed" in gone.stdout


def test_cli_uninstall_without_a_user_session_says_it_removed_the_unit(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    assert run_cli("service", "install", "--no-load", home=home).returncode == 0
    path = fake_manager(tmp_path, "echo 'Failed to connect to bus: No medium found' >&2; exit 1")
    out = run_cli("service", "uninstall", home=home, env={"PATH": path})
    unit = (home / "Library/LaunchAgents/io.darkbloom.provider.plist" if sys.platform == "darwin"
            else home / ".config/systemd/user" / UNIT_NAME)
    assert not unit.exists() and f"removed {unit}" in out.stdout
    if sys.platform != "darwin":  # launchd's bootout may fail for a job never loaded: nothing to say then
        assert out.returncode == 69 and "loginctl enable-linger" in out.stderr
