"""The whole agent against a coordinator double: in the test's process (its settings for a small
machine, and the agents a test started, each stopped at the test's end with exit code 0), or as a
process of its own (`agent_process`).

``start_agent`` (a fixture) starts agents on the tiny model in the test's process:
``await start_agent(double.ws_url, name="p1", models=None, **settings)``; they stop at the test's end
with no reservation left.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from memory import Ledger, ReservationKind
from provider.agent import Agent
from provider.config import Settings
from provider.demo import free_port

REPO = Path(__file__).resolve().parent.parent
NO_EOS = frozenset({10**9})  # the tiny models never stop early: completions have exactly max_tokens


def agent_settings(url: str, state_dir: Path, models: dict[str, Path], **overrides: object) -> Settings:
    """Dev posture, no hub (an empty cache beside `state_dir`), an 8 GB machine, quick heartbeats, the
    status endpoint on a free port (not the default one, which another test's agent or command may use), loads
    that measure once and warm nothing (conftest)."""
    return Settings(**{
        "coordinator_url": url, "dev_posture": True, "state_dir": state_dir, "local_port": free_port(),
        "hf_cache_dir": state_dir.parent / "empty-hf-cache", "model_aliases": models, "memory_limit_gb": 8.0,
        "memory_reserve_gb": 0.5, "heartbeat_interval_s": 0.5, "drain_timeout_s": 5.0, "idle_timeout_mins": 0,
        "load_measure_budget_s": 0.0, **overrides})


@dataclass
class RunningAgent:
    agent: Agent
    settings: Settings
    stop: asyncio.Event
    task: asyncio.Task[int]

    async def shutdown(self) -> int:
        self.stop.set()
        return await asyncio.wait_for(self.task, 30)


class Agents:
    """The agents one test starts (`start`); `stop_all` at its end."""

    def __init__(self) -> None:
        self.running: list[RunningAgent] = []

    async def start(self, settings: Settings, kind: type[RunningAgent] = RunningAgent, *,
                    no_eos: tuple[str, ...] = ()) -> RunningAgent:
        """The agent on `settings`, running; `kind`: a RunningAgent subclass to hold it. The aliased models,
        and the model ids in `no_eos` (one a test downloads, say), never stop early."""
        agent = await Agent.start(settings, harden=False,
                                  eos_token_ids=dict.fromkeys((*settings.model_aliases, *no_eos), NO_EOS))
        stop = asyncio.Event()
        handle = kind(agent, settings, stop, asyncio.create_task(agent.run(stop)))
        self.running.append(handle)
        return handle

    async def stop_all(self, *, ledger_empty: bool = True) -> None:
        """Every agent stops (or has stopped) with exit code 0 and, with `ledger_empty`, no reservation left."""
        for handle in self.running:
            assert await handle.shutdown() == 0
            if ledger_empty:
                assert len(handle.agent.ledger) == 0, "every reservation must be released after shutdown"


async def agent_process(ws_url: str, model: Path, tmp_path: Path, *, stderr: int = asyncio.subprocess.PIPE,
                        **env: str) -> asyncio.subprocess.Process:
    """`python -m provider.agent` on `model` (as "tiny") against the double at `ws_url` (JSON logs on
    `stderr`), with `env` on top of the settings every real-process test shares."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "provider.agent", cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=stderr,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "DARKBLOOM_COORDINATOR_URL": ws_url,
             "DARKBLOOM_DEV_POSTURE": "true", "DARKBLOOM_STATE_DIR": str(tmp_path / "state"),
             "DARKBLOOM_HF_CACHE_DIR": str(tmp_path / "hf"), "DARKBLOOM_MODEL_ALIASES": f"tiny={model}",
             "DARKBLOOM_MEMORY_LIMIT_GB": "8", "DARKBLOOM_MEMORY_RESERVE_GB": "0.5",
             "DARKBLOOM_LOG_FORMAT": "json", "DARKBLOOM_HEARTBEAT_INTERVAL_S": "0.5",
             "DARKBLOOM_LOCAL_PORT": str(free_port()), **env})


@pytest.fixture
async def start_agent(tiny_model_path: Path, tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    agents = Agents()

    async def start(url: str, name: str = "p1", models: dict[str, Path] | None = None, **overrides) -> RunningAgent:
        return await agents.start(agent_settings(url, tmp_path / name, models or {"tiny": tiny_model_path}, **overrides))

    yield start
    await agents.stop_all()


def no_request_reservations(ledger: Ledger) -> bool:
    """No request KV, media or load claim outstanding (the RAM prefix cache may keep entries: it is a cache)."""
    counts = ledger.snapshot().count_by_kind
    return all(counts[kind] == 0 for kind in (ReservationKind.REQUEST_KV, ReservationKind.MEDIA,
                                              ReservationKind.PENDING_LOAD))


def chat_messages(content: str = "hello") -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]
