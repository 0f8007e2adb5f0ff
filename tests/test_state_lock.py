"""One agent per state directory, and finding the running one from there.

Two agents on one state directory registered with the same identity key, and the second's start-up
sweep deleted the first's live SSD cache files. The state directory is locked now: real processes
take the lock, a SIGKILL releases it, and a second `serve` (or `serve --local`) refuses before it
touches anything. `status` (and `doctor`) find the agent from the state directory's record, whatever
`--local-port` they were given.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runner import clean_env, closed_port, run_cli
from kvcache.disk import KVCACHE_DIR
from provider.demo import free_port, wait_ready
from provider.state_lock import LOCK_FILE, AgentMode, AlreadyRunning, StateLock, running_agent

HOLD = """
import sys
from pathlib import Path
from provider.state_lock import AgentMode, StateLock
lock = StateLock.acquire(Path(sys.argv[1]), mode=AgentMode.LOCAL, local_url="http://127.0.0.1:9", coordinator_url=None)
print("locked", flush=True)
sys.stdin.read()  # hold it until killed
"""


def hold_lock(state: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(state)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "locked"
    return child


def test_the_lock_is_held_for_the_process_life_and_a_sigkill_releases_it(tmp_path):
    state = tmp_path / "state"
    child = hold_lock(state)
    try:
        with pytest.raises(AlreadyRunning) as refused:
            StateLock.acquire(state, mode=AgentMode.COORDINATOR, local_url=None, coordinator_url="ws://x")
        assert refused.value.holder is not None and refused.value.holder.pid == child.pid
        assert str(state) in str(refused.value) and f"pid {child.pid}" in str(refused.value)
        assert "serve --local on http://127.0.0.1:9" in str(refused.value)
        found = running_agent(state)
        assert found is not None and (found.pid, found.mode, found.local_url) == (child.pid, AgentMode.LOCAL,
                                                                                   "http://127.0.0.1:9")
        assert stat.S_IMODE((state / LOCK_FILE).stat().st_mode) == 0o600
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert running_agent(state) is None  # the record names a process that is gone
    with StateLock.acquire(state, mode=AgentMode.COORDINATOR, local_url=None, coordinator_url="ws://x"):
        mine = running_agent(state)
        assert mine is not None and mine.pid == os.getpid() and mine.mode is AgentMode.COORDINATOR
        assert mine.local_url is None
    assert running_agent(state) is None  # a clean release leaves no record (the file stays, empty)
    assert (state / LOCK_FILE).exists()


def test_a_state_directory_that_cannot_hold_the_lock_costs_only_the_lock(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / LOCK_FILE).mkdir()  # a directory in the way: not lockable, as a read-only disk would be
    with StateLock.acquire(state, mode=AgentMode.LOCAL, local_url="http://127.0.0.1:9", coordinator_url=None) as lock:
        assert not lock.held
    assert running_agent(state) is None


def agent_env(home: Path, state: Path, model: Path) -> dict[str, str]:
    return {"DARKBLOOM_STATE_DIR": str(state), "DARKBLOOM_HF_CACHE_DIR": str(home / "hub"),
            "DARKBLOOM_MODEL_ALIASES": f"demo/tiny={model}", "DARKBLOOM_LOG_FORMAT": "json",
            "DARKBLOOM_COORDINATOR_URL": f"ws://127.0.0.1:{closed_port()}/ws/provider",
            "DARKBLOOM_DEV_POSTURE": "true", "DARKBLOOM_KEEP_AWAKE": "false"}


def start_local(home: Path, env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    base = clean_env()
    base.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), **env)
    with open(home / f"agent-{port}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "provider.cli", "serve", "--local", "--local-port", str(port)],
                                env=base, stdout=log, stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{port}", proc, timeout_s=60)
    return proc


def test_a_second_agent_refuses_to_start_and_the_readers_find_the_first(tmp_path, tiny_model_path):
    home, state = tmp_path / "home", tmp_path / "state"
    (home / "hub").mkdir(parents=True)
    env = agent_env(home, state, tiny_model_path)
    port = free_port()
    first = start_local(home, env, port)
    try:
        # What the first agent's SSD tier holds for a loaded model: the start-up sweep deletes such folders.
        live = state / KVCACHE_DIR / f"{'a' * 32}.{'b' * 16}"
        live.mkdir()
        for command in (["serve", "--local", "--local-port", str(free_port())], ["serve"]):
            out = run_cli(*command, env=env, home=home, timeout=30)
            assert out.returncode == 78, (command, out.stderr)
            [line] = out.stderr.strip().splitlines()  # one line, no traceback, no log lines before it
            assert f"pid {first.pid}" in line and f"serve --local on http://127.0.0.1:{port}" in line, line
            assert str(state) in line and "--state-dir" in line
        assert live.is_dir()  # no sweep
        assert not (state / "identity").exists()  # no identity key made, no register
        assert first.poll() is None

        # Commands that only read keep working, and find the agent from the state directory although
        # they were told another port.
        elsewhere = str(closed_port())
        status = run_cli("status", "--json", "--local-port", elsewhere, env=env, home=home)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["mode"] == "local"
        text = run_cli("status", "--local-port", elsewhere, env=env, home=home)
        assert text.returncode == 0 and f"pid {first.pid}" in text.stdout and f":{port}" in text.stdout
        models = run_cli("models", "--json", env=env, home=home)
        assert models.returncode == 0 and [m["id"] for m in json.loads(models.stdout)["models"]] == ["demo/tiny"]
        doctor = run_cli("doctor", "--json", "--no-coordinator", "--local-port", elsewhere, env=env, home=home)
        assert json.loads(doctor.stdout)["agent"]["running"] is True
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
    gone = run_cli("status", "--local-port", elsewhere, env=env, home=home)  # not a neighbour's default port
    assert gone.returncode == 1 and "no agent is running" in gone.stderr and str(state) in gone.stderr
