"""Keeping the Mac awake while the agent is available: `caffeinate -i -w <pid>`.

There is no caffeinate on Linux, so a stand-in executable plays it: a real process that lives until it
is told to stop, as caffeinate does. The argv the agent would give the real one is recorded.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from pathlib import Path

import pytest

from provider.agent import Agent
from provider.config import Settings
from provider.power import CAFFEINATE, KeepAwake, caffeinate_argv


@pytest.fixture
def fake_caffeinate(tmp_path: Path) -> Path:
    exe = tmp_path / "caffeinate"
    exe.write_text("#!/bin/sh\nexec sleep 600\n")
    exe.chmod(0o755)
    return exe


class Spawner:
    def __init__(self) -> None:
        self.argvs: list[list[str]] = []
        self.processes: list[subprocess.Popen[bytes]] = []

    def __call__(self, argv):
        self.argvs.append(list(argv))
        process = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        self.processes.append(process)
        return process


def test_the_assertion_is_held_while_available_and_released_after(fake_caffeinate):
    spawn = Spawner()
    awake = KeepAwake(enabled=True, platform="darwin", pid=4321, binary=str(fake_caffeinate), spawn=spawn)
    awake.set_available(True)
    awake.set_available(True)  # held once, however often it is said
    assert awake.holding and spawn.argvs == [[str(fake_caffeinate), "-i", "-w", "4321"]]
    process = spawn.processes[0]
    awake.set_available(False)
    assert not awake.holding and process.poll() is not None  # the caffeinate process is gone
    awake.set_available(True)  # the next serving window holds it again
    assert awake.holding and len(spawn.processes) == 2
    awake.release()
    assert spawn.processes[1].poll() is not None


def test_off_when_disabled_or_not_a_mac(fake_caffeinate):
    spawn = Spawner()
    for awake in (KeepAwake(enabled=False, platform="darwin", binary=str(fake_caffeinate), spawn=spawn),
                  KeepAwake(enabled=True, platform="linux", binary=str(fake_caffeinate), spawn=spawn)):
        awake.set_available(True)
        assert not awake.holding
    assert spawn.argvs == []


def test_a_missing_caffeinate_is_a_warning_not_a_failure(tmp_path):
    awake = KeepAwake(enabled=True, platform="darwin", binary=str(tmp_path / "nope"))
    awake.set_available(True)
    assert not awake.holding


def test_the_real_command_watches_our_own_pid():
    assert caffeinate_argv(os.getpid()) == [CAFFEINATE, "-i", "-w", str(os.getpid())]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_the_agent_holds_it_from_start_until_it_has_drained(fake_caffeinate, tmp_path):
    spawn = Spawner()
    awake = KeepAwake(enabled=True, platform="darwin", binary=str(fake_caffeinate), spawn=spawn)
    settings = Settings(coordinator_url=f"ws://127.0.0.1:{closed_port()}/ws/provider", dev_posture=True,
                        state_dir=tmp_path / "state", hf_cache_dir=tmp_path / "empty", local_enabled=False,
                        heartbeat_interval_s=0.5, drain_timeout_s=1.0)
    agent = await Agent.start(settings, harden=False, keep_awake=awake)
    assert not awake.holding  # built, not yet available
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await asyncio.sleep(0)  # one turn: run() takes it before its first await (the connect)
    assert awake.holding and spawn.argvs == [[str(fake_caffeinate), "-i", "-w", str(os.getpid())]]
    stop.set()
    assert await asyncio.wait_for(task, 30) == 0
    assert not awake.holding and spawn.processes[0].poll() is not None


async def test_the_assertion_follows_the_serving_windows(fake_caffeinate, tmp_path):
    """The guest monitor decides when the agent may serve: the Mac is kept awake only then.
    Started at noon with a 22:00-07:30 window: paused, nothing held; the window opens: held; it
    closes: released (the Mac may sleep until the next one); the drain: released for good."""
    from datetime import UTC, datetime

    from provider.guest.monitor import GuestMonitor

    now = [datetime(2025, 1, 8, 12, 0, tzinfo=UTC)]
    spawn = Spawner()
    awake = KeepAwake(enabled=True, platform="darwin", binary=str(fake_caffeinate), spawn=spawn)
    settings = Settings(coordinator_url=f"ws://127.0.0.1:{closed_port()}/ws/provider", dev_posture=True,
                        state_dir=tmp_path / "state", hf_cache_dir=tmp_path / "empty", local_enabled=False,
                        heartbeat_interval_s=0.5, drain_timeout_s=1.0, serve_windows=("22:00-07:30",),
                        serve_timezone="UTC")
    guest = GuestMonitor.from_settings(settings, clock=lambda: now[0])
    agent = await Agent.start(settings, harden=False, keep_awake=awake, guest=guest)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await asyncio.sleep(0)  # one turn: run() has wired the assertion to the monitor
        assert guest.is_paused() and not awake.holding and spawn.argvs == []
        now[0] = datetime(2025, 1, 8, 22, 0, tzinfo=UTC)
        await guest.step()
        assert awake.holding and len(spawn.processes) == 1
        now[0] = datetime(2025, 1, 9, 7, 30, tzinfo=UTC)
        await guest.step()
        assert not awake.holding and spawn.processes[0].poll() is not None
        now[0] = datetime(2025, 1, 9, 22, 0, tzinfo=UTC)
        await guest.step()
        assert awake.holding and len(spawn.processes) == 2
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0
    assert not awake.holding and all(p.poll() is not None for p in spawn.processes)
