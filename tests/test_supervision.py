"""A service that behaves, through the real CLI in a subprocess with a temporary
home: `service install` carries every setting it was given, a configuration error under launchd ends
the agent without a relaunch loop and `service status` shows it, the agent's log file rotates by size."""

from __future__ import annotations

import json
import logging
import plistlib
import sys
import threading
from pathlib import Path

import pytest
import structlog

from cli_runner import run_cli
from provider.cli import build_parser, overrides_from, setting_args, settings_from
from provider.service import install
from provider.supervision import ExitReason, exit_record_path, read_exit_record
from provider.telemetry import configure_logging, get_logger

INSTALL_FLAGS = ("--memory-reserve-gb", "8", "--local-port", "9000", "--model-dirs", "/srv/models",
                 "--model-dirs", "models-here", "--model-aliases", "org/m=~/m", "--dev-posture", "true",
                 "--log-level", "debug", "--drain-timeout-s", "10")
CARRIED = ["--memory-reserve-gb", "8.0", "--local-port", "9000", "--model-dirs", "/srv/models",
           "--model-dirs", "{cwd}/models-here", "--model-aliases", "org/m={home}/m", "--dev-posture", "true",
           "--log-level", "debug", "--drain-timeout-s", "10.0"]


def expected_flags(home: Path, cwd: Path) -> list[str]:
    return [a.format(home=home, cwd=cwd) for a in CARRIED]


# --- 14.4: install carries its flags


def test_service_install_writes_every_setting_it_was_given_into_the_unit(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    out = run_cli("service", "install", "--no-load", *INSTALL_FLAGS, home=home)
    assert out.returncode == 0, out.stderr
    assert "carried settings: --memory-reserve-gb, --local-port, --model-dirs" in out.stdout
    if sys.platform == "darwin":
        plist = plistlib.loads((home / "Library/LaunchAgents/io.darkbloom.provider.plist").read_bytes())
        args = plist["ProgramArguments"]
    else:
        unit = (home / ".config/systemd/user/darkbloom-provider.service").read_text()
        exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
        args = [a.strip('"') for a in exec_start.removeprefix("ExecStart=").split(" ")]
        assert "TimeoutStopSec=25" in unit  # the drain timeout still sets the stop timeout too
    serve = args.index("serve")
    cwd = Path.cwd()  # run_cli's child runs here: a relative model dir is made absolute against it
    assert args[serve + 1:] == expected_flags(home, cwd)
    # The service's command line loads back into the same settings.
    parsed = build_parser().parse_args(args[serve:])
    settings = settings_from(parsed)
    assert settings.memory_reserve_gb == 8 and settings.local_port == 9000 and settings.dev_posture
    assert settings.model_dirs == (Path("/srv/models"), cwd / "models-here")


def test_the_launchd_plist_gets_the_same_flags(tmp_path):
    args = build_parser().parse_args(["service", "install", *INSTALL_FLAGS])
    settings = settings_from(args)
    flags = setting_args(settings, overrides_from(args))
    result = install(home=tmp_path, platform="darwin", env={"PATH": "/bin"}, load=False,
                     program=["/venv/bin/darkbloom-provider", "serve"], args=flags,
                     drain_timeout_s=settings.drain_timeout_s)
    plist = plistlib.loads(result.path.read_bytes())
    assert plist["ProgramArguments"][4:] == expected_flags(Path.home(), Path.cwd())
    assert plist["ExitTimeOut"] == 25


@pytest.mark.parametrize("action", ["status", "uninstall"])
def test_settings_given_to_status_or_uninstall_are_refused_not_ignored(tmp_path, action):
    out = run_cli("service", action, "--local-port", "9000", home=tmp_path)
    assert out.returncode == 78
    assert f"`service {action}` does not use settings (--local-port)" in out.stderr


# --- 14.6: a configuration error under launchd


LAUNCHD = {"DARKBLOOM_SERVICE_MANAGER": "launchd"}


def test_under_launchd_a_configuration_error_exits_0_and_is_recorded_for_status(tmp_path):
    home = tmp_path / "home"
    out = run_cli("serve", home=home, env={**LAUNCHD, "DARKBLOOM_MAX_MODEL_SLOTS": "zero"})
    assert out.returncode == 0  # KeepAlive {SuccessfulExit: false}: launchd does not relaunch it
    assert "DARKBLOOM_MAX_MODEL_SLOTS" in out.stderr and "Traceback" not in out.stderr  # in provider.stderr.log
    record = read_exit_record(home)
    assert record is not None and record.reason is ExitReason.CONFIGURATION and record.exit_code == 78
    assert "DARKBLOOM_MAX_MODEL_SLOTS: value 'zero' is not allowed" in record.message

    # The next start with a valid configuration clears it (runtime-hash stands in for serve: no network).
    fixed = run_cli("runtime-hash", home=home, env=LAUNCHD)
    assert fixed.returncode == 0 and read_exit_record(home) is None


def test_under_launchd_a_bad_command_line_is_recorded_too(tmp_path):
    out = run_cli("serve", "--no-such-flag", home=tmp_path, env=LAUNCHD)
    assert out.returncode == 0 and "unrecognized arguments" in out.stderr
    record = read_exit_record(tmp_path)
    assert record is not None and record.reason is ExitReason.USAGE and record.exit_code == 2


def test_elsewhere_a_configuration_error_is_still_exit_78_with_no_record(tmp_path):
    out = run_cli("serve", home=tmp_path, env={"DARKBLOOM_MAX_MODEL_SLOTS": "zero"})
    assert out.returncode == 78 and not exit_record_path(tmp_path).exists()


# --- 14.6: the agent's log file is bounded


@pytest.fixture
def restore_logging():
    saved_config, saved_hooks = structlog.get_config(), (sys.excepthook, threading.excepthook)
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in saved_handlers:
            handler.close()
    structlog.configure(**saved_config)
    sys.excepthook, threading.excepthook = saved_hooks
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)


def test_the_log_file_rotates_by_size_and_keeps_a_few_generations(tmp_path, restore_logging):
    log_file = tmp_path / "logs" / "provider.log"
    configure_logging("info", "auto", log_file=log_file, max_bytes=4096, backups=3)
    log = get_logger("provider.test")
    for i in range(400):  # ~40 KB of lines: several rotations
        log.info("heartbeat_sent", count=i, model="demo/tiny")
    files = sorted(p.name for p in log_file.parent.iterdir())
    assert files == ["provider.log", "provider.log.1", "provider.log.2", "provider.log.3"]
    assert all(p.stat().st_size <= 4096 for p in log_file.parent.iterdir())
    last = json.loads(log_file.read_text().splitlines()[-1])  # JSON lines: a file is not a terminal
    assert (last["event"], last["count"]) == ("heartbeat_sent", 399)


def test_the_cli_writes_to_the_log_file_setting(tmp_path):
    log_file = tmp_path / "provider.log"
    out = run_cli("doctor", "--no-coordinator", "--log-file", str(log_file), "--hf-cache-dir", str(tmp_path),
                  home=tmp_path, env={"DARKBLOOM_MEM_CAP_FRACTION": "abc"})
    assert "memory_env_rejected" not in out.stderr  # the log went to the file ...
    assert "memory_env_rejected" in log_file.read_text()  # ... here
