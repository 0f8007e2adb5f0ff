"""Crash loops: the agent counts its own abnormal exits in the state directory; under
launchd, `crash_loop_limit` of them within `crash_loop_window_mins` keep it down (exit 0, which
`KeepAlive {SuccessfulExit: false}` does not relaunch), and `service status` and `doctor` say so.

The unit tests drive `provider/supervision.py` with explicit pids and times; the end-to-end test runs
the real `serve` in a subprocess, kills it with SIGKILL (what jetsam does) and starts it again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cli_runner import clean_env, closed_port, run_cli
from provider import cli
from provider.agent import EXIT_RESTART
from provider.config import Settings
from provider.doctor import run_doctor
from provider.service import status
from provider.session.identity import load_or_create_keys
from provider.supervision import (
    ABNORMAL_EXITS_FILE,
    RUN_MARKER_FILE,
    ExitKind,
    ExitReason,
    on_exit,
    on_start,
    read_abnormal_exits,
    read_exit_record,
    reset_abnormal_exits,
)
from service_recorder import Recorder

LAUNCHD = {"DARKBLOOM_SERVICE_MANAGER": "launchd"}
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
WINDOW_S = 600.0


def gone_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def crash(state: Path, at: datetime, *, env=LAUNCHD, limit: int = 3):
    """One start whose predecessor died without a clean exit (its pid is gone)."""
    (state / RUN_MARKER_FILE).write_text(json.dumps({"pid": gone_pid(), "created": 1.0}))
    return on_start(state, env=env, limit=limit, window_s=WINDOW_S, pid=os.getpid(), now=at)


# --- the counter


def test_a_clean_exit_is_not_counted(tmp_path):
    first = on_start(tmp_path, env=LAUNCHD, limit=3, window_s=WINDOW_S, now=T0)
    assert not first.previous_crashed and json.loads((tmp_path / RUN_MARKER_FILE).read_text())["pid"] == os.getpid()
    on_exit(tmp_path, 0, window_s=WINDOW_S)
    assert not (tmp_path / RUN_MARKER_FILE).exists()
    again = on_start(tmp_path, env=LAUNCHD, limit=3, window_s=WINDOW_S, now=T0 + timedelta(seconds=30))
    assert not again.previous_crashed and again.record.abnormal_exits == ()


def test_a_marker_left_by_a_dead_process_counts_as_an_abnormal_exit(tmp_path):
    decision = crash(tmp_path, T0)
    assert decision.previous_crashed and not decision.stay_down
    [found] = read_abnormal_exits(tmp_path, window_s=WINDOW_S, now=T0).abnormal_exits
    assert (found.at, found.kind) == (T0.isoformat(timespec="seconds"), ExitKind.CRASH)  # killed: no exit code
    assert json.loads((tmp_path / RUN_MARKER_FILE).read_text())["pid"] == os.getpid()  # this run is marked


def test_a_pid_reused_after_a_reboot_is_not_mistaken_for_the_agent(tmp_path):
    # The marker names a live process (this one) but one that started at another time: the agent
    # that wrote it is gone, and the pid belongs to someone else now.
    (tmp_path / RUN_MARKER_FILE).write_text(json.dumps({"pid": os.getppid(), "created": 1.0}))
    decision = on_start(tmp_path, env=LAUNCHD, limit=3, window_s=WINDOW_S, pid=os.getpid(), now=T0)
    assert decision.previous_crashed


def test_a_second_agent_still_running_is_neither_counted_nor_replaced(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        on_start(tmp_path, env=LAUNCHD, limit=3, window_s=WINDOW_S, pid=child.pid, now=T0)
        decision = on_start(tmp_path, env=LAUNCHD, limit=3, window_s=WINDOW_S, pid=os.getpid(), now=T0)
        assert not decision.previous_crashed
        assert json.loads((tmp_path / RUN_MARKER_FILE).read_text())["pid"] == child.pid
        on_exit(tmp_path, 0, window_s=WINDOW_S)  # not ours: left alone
        assert (tmp_path / RUN_MARKER_FILE).exists()
    finally:
        child.kill()
        child.wait()


def test_under_launchd_the_limit_within_the_window_keeps_it_down(tmp_path):
    assert not crash(tmp_path, T0).stay_down
    assert not crash(tmp_path, T0 + timedelta(minutes=2)).stay_down
    third = crash(tmp_path, T0 + timedelta(minutes=4))
    assert third.stay_down and len(third.record.abnormal_exits) == 3
    assert third.record.stayed_down_at == (T0 + timedelta(minutes=4)).isoformat(timespec="seconds")
    assert not (tmp_path / RUN_MARKER_FILE).exists()  # staying down is a clean end: nothing to count next time
    assert "stayed down after 3 abnormal exits within 10 minutes (3 crashes;" in third.message(10)
    # Started again (login, boot) while the window still holds them: still down, not counted again.
    again = on_start(tmp_path, env=LAUNCHD, limit=3, window_s=WINDOW_S, now=T0 + timedelta(minutes=5))
    assert again.stay_down and len(again.record.abnormal_exits) == 3


def test_stayed_down_is_reported_until_an_agent_starts_again(tmp_path):
    """launchd does not relaunch a stayed-down agent before the next login or boot: `doctor` says so
    even once the exits are older than the window, and no longer after a start that serves."""
    from provider.doctor import ProblemCode
    from provider.doctor.report import _crash_loop_problems

    settings = Settings(state_dir=tmp_path, crash_loop_limit=3)
    for minute in range(3):
        decision = crash(tmp_path, T0 + timedelta(minutes=minute))
    assert decision.stay_down
    later = read_abnormal_exits(tmp_path, window_s=WINDOW_S, now=T0 + timedelta(minutes=30))
    assert later.abnormal_exits == () and later.stayed_down_at is not None
    [problem] = _crash_loop_problems(settings, later)
    assert problem.code is ProblemCode.SERVICE_STAYED_DOWN
    again = on_start(tmp_path, env=LAUNCHD, limit=3, window_s=WINDOW_S, now=T0 + timedelta(minutes=40))  # a login
    assert not again.stay_down and again.record.stayed_down_at is None
    assert _crash_loop_problems(settings, read_abnormal_exits(tmp_path, window_s=WINDOW_S,
                                                              now=T0 + timedelta(minutes=41))) == ()


def test_exits_older_than_the_window_fall_out(tmp_path):
    crash(tmp_path, T0)
    crash(tmp_path, T0 + timedelta(minutes=2))
    late = crash(tmp_path, T0 + timedelta(minutes=11))  # the first is 11 minutes old now
    assert not late.stay_down and len(late.record.abnormal_exits) == 2


@pytest.mark.parametrize("env", [{}, {"DARKBLOOM_SERVICE_MANAGER": "systemd"}], ids=["terminal", "other"])
def test_only_launchd_stays_down(tmp_path, env):
    # A terminal has a person in front of it; systemd has its own StartLimitBurst.
    for minute in range(4):
        decision = crash(tmp_path, T0 + timedelta(minutes=minute), env=env)
    assert not decision.stay_down and len(decision.record.abnormal_exits) == 4


def test_service_install_starts_the_count_afresh(tmp_path):
    for minute in range(3):
        crash(tmp_path, T0 + timedelta(minutes=minute))
    reset_abnormal_exits(tmp_path)
    decision = on_start(tmp_path, env=LAUNCHD, limit=3, window_s=WINDOW_S, now=T0 + timedelta(minutes=4))
    assert not decision.stay_down and decision.record.abnormal_exits == ()


def test_a_damaged_count_is_read_as_none(tmp_path):
    (tmp_path / ABNORMAL_EXITS_FILE).write_text("{not json")
    assert read_abnormal_exits(tmp_path, window_s=WINDOW_S).abnormal_exits == ()
    (tmp_path / ABNORMAL_EXITS_FILE).write_text(json.dumps({"abnormal_exits": [
        {"at": "yesterday", "kind": "crash"}, 5, "2026-03-01T12:00:00+00:00",
        {"at": "2026-03-01T12:00:00", "kind": "crash"}, {"at": "2026-03-01T12:00:00+00:00", "kind": "boredom"}]}))
    assert read_abnormal_exits(tmp_path, window_s=WINDOW_S, now=T0).abnormal_exits == ()  # no zone: not ours


# --- the real agent, killed like jetsam kills it


def serve_env(home: Path, state: Path) -> dict[str, str]:
    return {**LAUNCHD, "DARKBLOOM_CRASH_LOOP_LIMIT": "1", "DARKBLOOM_STATE_DIR": str(state),
            "DARKBLOOM_COORDINATOR_URL": f"ws://127.0.0.1:{closed_port()}/ws/provider",
            "DARKBLOOM_DEV_POSTURE": "true", "DARKBLOOM_LOCAL_ENABLED": "false",
            "DARKBLOOM_HF_CACHE_DIR": str(home / "hub"), "DARKBLOOM_KEEP_AWAKE": "false"}


def cli_argv(*args: str, max_file_bytes: int | None = None) -> list[str]:
    """`python -m provider.cli ARGS`; with `max_file_bytes`, under that RLIMIT_FSIZE: a write that would
    make a file larger really fails (EFBIG, after a short write), as on a full disk."""
    if max_file_bytes is None:
        return [sys.executable, "-m", "provider.cli", *args]
    limit = ("import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
             "os.execv(sys.executable, [sys.executable, '-m', 'provider.cli', *sys.argv[2:]])")
    return [sys.executable, "-c", limit, str(max_file_bytes), *args]


def start_and_kill(home: Path, env: dict[str, str], *, max_file_bytes: int | None = None) -> list[str]:
    """Start the real `serve`, wait until it serves, SIGKILL it; the log lines it wrote until then."""
    base = clean_env()
    base.update(HOME=str(home), **env)
    proc = subprocess.Popen(cli_argv("serve", max_file_bytes=max_file_bytes), env=base, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        for line in proc.stderr:  # serving: the agent is up and trying the (closed) coordinator
            lines.append(line)
            if "agent_ready" in line or time.monotonic() > deadline:
                break
        assert proc.poll() is None, "the agent ended by itself"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return lines


def test_killed_the_launchd_agent_counts_a_crash_stays_down_and_says_so(tmp_path):
    home, state = tmp_path / "home", tmp_path / "state"
    (home / "hub").mkdir(parents=True)
    env = serve_env(home, state)
    start_and_kill(home, env)  # (the unit tests count several; one real kill keeps this test short)

    out = run_cli("serve", home=home, env=env)
    assert out.returncode == 0  # launchd does not relaunch it
    assert "stayed down after 1 abnormal exit within 10 minutes (1 crash;" in out.stderr
    record = read_exit_record(home)
    assert record is not None and record.reason is ExitReason.CRASH_LOOP and record.exit_code == 1

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "launchctl").write_text("#!/bin/sh\nexit 99\n")
    (bin_dir / "launchctl").chmod(0o755)
    shown = "gui/501/io.darkbloom.provider = {\n\tstate = not running\n\tlast exit code = 0\n}\n"
    st = status(home=home, platform="darwin", env={"PATH": str(bin_dir)}, runner=Recorder({"print": (0, shown, "")}),
                uid=501, state_dir=state)
    assert not st.running and st.last_error is not None and st.last_error.startswith("crash_loop at ")
    assert st.crash_loop is not None and len(st.crash_loop.abnormal_exits) == 1

    doc = json.loads(run_cli("doctor", "--json", "--no-coordinator", home=home, env=env).stdout)
    [problem] = [p for p in doc["problems"] if p["subject"] == "service"]
    assert (problem["code"], problem["severity"]) == ("service_stayed_down", "error")
    assert [e["kind"] for e in doc["crash_loop"]["abnormal_exits"]] == ["crash"] and doc["crash_loop"]["stayed_down_at"]


def test_the_guard_s_files_are_private(tmp_path):
    """abnormal-exits.json and agent.running are 0600 like the rest of the state directory."""
    old = os.umask(0o022)
    try:
        crash(tmp_path, T0)
        assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {
            ABNORMAL_EXITS_FILE: 0o600, RUN_MARKER_FILE: 0o600}
        on_exit(tmp_path, 1, window_s=WINDOW_S, now=T0)
        assert (tmp_path / ABNORMAL_EXITS_FILE).stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_a_full_disk_at_start_is_logged_leaves_no_temp_file_and_doctor_says_so(tmp_path):
    """The state directory cannot take the guard's files (a write past 16 bytes fails for real): the
    agent still serves, but says the guard is off; nothing half-written is left; `doctor` says so too."""
    home, state = tmp_path / "home", tmp_path / "state"
    (home / "hub").mkdir(parents=True)
    load_or_create_keys(state)  # an agent that ran before: only the guard writes at this start
    env = serve_env(home, state)
    lines = start_and_kill(home, env, max_file_bytes=16)

    [warning] = [line for line in lines if "crash_loop_guard_off" in line]
    assert "EFBIG" in warning and str(state) in warning
    assert [p.name for p in state.rglob("*") if p.name.endswith(".tmp")] == []
    assert not (state / ABNORMAL_EXITS_FILE).exists() and not (state / RUN_MARKER_FILE).exists()

    base = clean_env() | {"HOME": str(home), **env}
    doctor = [subprocess.run(cli_argv("doctor", *fmt, "--no-coordinator", max_file_bytes=16), env=base,
                             capture_output=True, text=True, timeout=60) for fmt in (["--json"], [])]
    [problem] = [p for p in json.loads(doctor[0].stdout)["problems"] if p["code"] == "crash_loop_guard_off"]
    assert (problem["severity"], problem["subject"]) == ("warning", "EFBIG") and str(state) in problem["detail"]
    assert "crash_loop_guard_off" in doctor[1].stdout
    assert [p.name for p in state.rglob("*") if p.name.endswith(".tmp")] == []


def test_service_status_on_the_command_line_counts_the_abnormal_exits(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    now = datetime.now(UTC).isoformat(timespec="seconds")
    (state / ABNORMAL_EXITS_FILE).write_text(json.dumps({"abnormal_exits": [{"at": now, "kind": "crash"}],
                                                         "stayed_down_at": None}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = "launchctl" if sys.platform == "darwin" else "systemctl"
    (bin_dir / fake).write_text("#!/bin/sh\nprintf 'LoadState=not-found\\nActiveState=inactive\\nSubState=dead\\n'\n"
                                if fake == "systemctl" else "#!/bin/sh\nexit 113\n")
    (bin_dir / fake).chmod(0o755)
    out = run_cli("service", "status", home=tmp_path, env={"PATH": f"{bin_dir}:/usr/bin:/bin",
                                                             "DARKBLOOM_STATE_DIR": str(state)})
    assert out.returncode == 1, out.stderr  # not running
    assert "abnormal exits: 1 in the last 10 minutes (1 crash; the service stays down at 5)" in out.stdout
    doc = json.loads(run_cli("doctor", "--json", "--no-coordinator", home=tmp_path,
                             env={"DARKBLOOM_STATE_DIR": str(state), "DARKBLOOM_HF_CACHE_DIR": str(tmp_path)}).stdout)
    [problem] = [p for p in doc["problems"] if p["subject"] == "service"]
    assert (problem["code"], problem["severity"]) == ("abnormal_exits", "warning")


@pytest.mark.parametrize(("code", "kind"), [(0, None), (78, None), (75, ExitKind.MEMORY_RESTART),
                                          (1, ExitKind.ERROR_EXIT)],
                         ids=["drained", "config-refused", "memory-restart", "failed"])
def test_which_exits_of_serve_count(tmp_path, monkeypatch, code, kind):
    """0 (a drain) and 78 (a refused configuration) are clean; a memory self-restart (75)
    counts, so a restart that does not help cannot loop either. An exit code is known at the exit:
    it is recorded then, with what it was (a kill is only found at the next start)."""
    monkeypatch.setattr(cli, "_serve", lambda args, settings: code)
    monkeypatch.delenv("DARKBLOOM_SERVICE_MANAGER", raising=False)
    settings = Settings(state_dir=tmp_path)
    assert cli.cmd_serve(cli.build_parser().parse_args(["serve"]), settings) == code
    assert not (tmp_path / RUN_MARKER_FILE).exists()  # every exit with a code is accounted for now
    exits = read_abnormal_exits(tmp_path, window_s=WINDOW_S).abnormal_exits
    assert [e.kind for e in exits] == ([] if kind is None else [kind])


def test_memory_self_restarts_that_do_not_help_stay_down_and_say_why(tmp_path, monkeypatch):
    """The memory self-restart and the guard together: launchd starts the agent again after each exit
    75; each is counted as a memory self-restart; at crash_loop_limit the agent stays down (exit 0)
    and the record, `service status` and `doctor` name the memory self-restarts as the reason."""
    home, state = tmp_path / "home", tmp_path / "state"
    home.mkdir()
    runs: list[int] = []
    monkeypatch.setattr(cli, "_serve", lambda args, settings: runs.append(1) or EXIT_RESTART)
    monkeypatch.setenv("DARKBLOOM_SERVICE_MANAGER", "launchd")
    monkeypatch.setenv("HOME", str(home))
    settings = Settings(state_dir=state, hf_cache_dir=tmp_path, crash_loop_limit=3)
    args = cli.build_parser().parse_args(["serve"])
    # launchd relaunches after every non-zero exit, and not after exit 0.
    codes = [cli.cmd_serve(args, settings) for _ in range(4)]
    assert codes == [EXIT_RESTART] * 3 + [0] and len(runs) == 3  # the fourth start did not serve

    record = read_exit_record(home)
    assert record is not None and record.reason is ExitReason.CRASH_LOOP
    assert "3 abnormal exits within 10 minutes (3 memory self-restarts;" in record.message

    shown = "gui/501/io.darkbloom.provider = {\n\tstate = not running\n\tlast exit code = 0\n}\n"
    (tmp_path / "launchctl").write_text("#!/bin/sh\nexit 99\n")  # found on PATH, never run: the recorder answers
    (tmp_path / "launchctl").chmod(0o755)
    st = status(home=home, platform="darwin", env={"PATH": str(tmp_path)}, runner=Recorder({"print": (0, shown, "")}),
                uid=501, state_dir=state)
    lines = cli.service_status_lines(st, settings)
    assert "abnormal exits: 3 in the last 10 minutes (3 memory self-restarts; the service stays down at 3)" in lines[1]
    assert any(line.startswith("last start failed: crash_loop at ") and "memory self-restarts" in line
               for line in lines)

    report = run_doctor(settings, check_coordinator_url=False, explain_routing=False, check_running_agent=False,
                        env={})
    [problem] = [p for p in report.problems if p.subject == "service"]
    assert problem.code.value == "service_stayed_down" and "3 memory self-restarts" in problem.detail


