"""Models the coordinator asks for (issue 32 item 3): the agent (real engine on the tiny MLX models, real
model manager and ledger) against the coordinator double over a real WebSocket; the double sends the [N]
frames (coordinator_double/directed.py) and records the answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from coordinator_double import CoordinatorDouble, FrameReceived, ModelStatus
from coordinator_double.directed import load_model
from double_fixtures import coordinator_double, double_config  # noqa: F401

from provider.agent import Agent
from provider.config import Settings
from provider.slots import ModelState

NO_EOS = frozenset({10**9})


@pytest.fixture
async def start_agent(tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    running: list[tuple[Agent, asyncio.Event, asyncio.Task[int]]] = []

    async def start(url: str, models: dict[str, Path], **overrides) -> Agent:
        settings = Settings(**{
            "coordinator_url": url, "dev_posture": True, "state_dir": tmp_path / "state",
            "hf_cache_dir": tmp_path / "empty-hf-cache", "model_aliases": models, "memory_limit_gb": 8.0,
            "memory_reserve_gb": 0.5, "heartbeat_interval_s": 30.0, "drain_timeout_s": 5.0, "idle_timeout_mins": 0,
            **overrides})
        agent = await Agent.start(settings, harden=False, eos_token_ids=dict.fromkeys(models, NO_EOS))
        stop = asyncio.Event()
        running.append((agent, stop, asyncio.create_task(agent.run(stop))))
        return agent

    yield start
    for agent, stop, task in running:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0
        assert len(agent.ledger) == 0, "every reservation must be released after shutdown"


def statuses(double: CoordinatorDouble, model_id: str) -> list[tuple[str, str]]:
    return [(e.status, e.error) for e in double.events.of(ModelStatus)
            if e.kind == "load_model_status" and e.model_id == model_id]


async def test_load_model_of_a_cold_model_starts_succeeds_and_the_next_heartbeat_shows_it_running(
        coordinator_double, start_agent, tiny_model_path):
    double = coordinator_double
    agent = await start_agent(double.ws_url, {"tiny": tiny_model_path})
    await double.wait_routable(model="tiny", timeout=15)
    assert agent.manager.state("tiny") is ModelState.NOT_LOADED
    mark = double.mark()
    await double.send_frame(0, load_model("tiny"))
    await double.wait_for(lambda e: isinstance(e, ModelStatus) and e.status != "started", since=mark, timeout=30)
    assert statuses(double, "tiny") == [("started", ""), ("succeeded", "")]
    assert agent.manager.state("tiny") is ModelState.LOADED
    # The heartbeat interval is 30 s: the one that shows the slot went out because the load changed capacity.
    beat = await double.wait_for(
        lambda e: isinstance(e, FrameReceived) and e.message.type == "heartbeat" and e.message.backend_capacity
        and any(s.model == "tiny" and s.state == "running" for s in e.message.backend_capacity.slots),
        since=mark, timeout=10)
    assert list(beat.message.warm_models) == ["tiny"]
    assert double.anomalies() == []


async def test_load_model_of_a_model_too_large_fails_with_the_reason_and_loads_nothing(
        coordinator_double, start_agent, tiny_model_path, medium_model_path):
    double = coordinator_double
    # A cap of 4.2 GiB: a load needs its padded weights + 4 GiB (activation + minimum KV): the tiny model
    # fits, the ~380 MB one never does.
    agent = await start_agent(double.ws_url, {"tiny": tiny_model_path, "medium": medium_model_path},
                              memory_limit_gb=6.2, memory_reserve_gb=0.0)
    await double.wait_routable(model="tiny", timeout=15)
    mark = double.mark()
    await double.send_frame(0, load_model("medium"))
    await double.wait_for(lambda e: isinstance(e, ModelStatus) and e.status != "started", since=mark, timeout=30)
    [(first, _), (last, reason)] = statuses(double, "medium")
    assert (first, last) == ("started", "failed")
    assert reason == "request_exceeds_node"
    assert agent.manager.state("medium") is ModelState.NOT_LOADED
    assert agent.manager.warm_models() == []
    assert len(agent.ledger) == 0


async def test_load_model_of_a_model_it_does_not_have_fails_as_unavailable(coordinator_double, start_agent,
                                                                           tiny_model_path):
    double = coordinator_double
    agent = await start_agent(double.ws_url, {"tiny": tiny_model_path})
    await double.wait_routable(model="tiny", timeout=15)
    mark = double.mark()
    await double.send_frame(0, load_model("org/not-here"))
    await double.wait_for(lambda e: isinstance(e, ModelStatus) and e.status != "started", since=mark, timeout=30)
    assert statuses(double, "org/not-here") == [("started", ""), ("failed", "model_unavailable")]
    assert agent.manager.warm_models() == []
