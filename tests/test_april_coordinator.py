"""The agent against the April coordinator (the [A] coordinator of e515244f: the double with
``newer_protocol=False``, which sends no ``trust_status``, no ``desired_models``, no ``capacity_probe``
and drops every [N] provider frame as an unknown type), over a real WebSocket:

* an idle stop sends no ``provider_drain`` (that coordinator would log it as an unknown message and never
  acknowledge it) and so waits for no ack: the close follows the drain, as before the barrier existed;
* ``register`` lets it price a provider with nothing loaded: a memory bandwidth that is not 0 (Apple's
  figure on a Mac, measured at start elsewhere), and once a model has been measured, its decode rate,
  in every later ``register`` even after the model was unloaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from coordinator_double import CoordinatorDouble, Disconnected, FrameReceived, Registered, TrustStatusSent
from double_fixtures import consumer_for, quick_config
from protocol import Register
from provider.metrics import EvictionCause
from provider.slots import ModelState
from running_agent import Agents, RunningAgent, agent_settings

HOUR_S = 3600.0


@pytest.fixture
async def run_agent(tiny_model_path: Path, tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    agents = Agents()

    async def start(url: str, **overrides) -> RunningAgent:
        return await agents.start(agent_settings(url, tmp_path / "state", {"tiny": tiny_model_path}, **overrides))

    yield start
    await agents.stop_all(ledger_empty=False)


def registers(double: CoordinatorDouble) -> list[Register]:
    return [e.message for e in double.events.of(FrameReceived) if isinstance(e.message, Register)]


async def test_an_idle_stop_sends_no_drain_barrier_and_waits_for_no_ack(run_agent):
    async with CoordinatorDouble(quick_config(newer_protocol=False)) as double:
        # An hour's bound for the ack: waited out, the stop below could never end within its minute.
        provider = await run_agent(double.ws_url, drain_ack_timeout_s=HOUR_S)
        await double.wait_routable(model="tiny", timeout=30)
        assert double.events.of(TrustStatusSent) == []  # nothing of the newer protocol came from it
        provider.stop.set()
        assert await asyncio.wait_for(provider.task, 60) == 0
        disconnected = await double.wait_for(lambda e: isinstance(e, Disconnected), timeout=10)
        assert disconnected.close_code == 1000
        assert "provider_drain" not in [e.message.type for e in double.events.of(FrameReceived)]
        assert double.anomalies() == []  # no frame it would have logged as an unknown type
        assert provider.agent.session.status.view().last_drain is None


async def test_register_lets_it_price_a_cold_provider(run_agent):
    async with CoordinatorDouble(quick_config(newer_protocol=False)) as double:
        provider = await run_agent(double.ws_url)
        (view,) = await double.wait_routable(model="tiny", timeout=30)
        (first,) = registers(double)
        assert first.hardware.memory_bandwidth_gbs > 0  # its decode-rate estimate: sqrt(bandwidth), not 1 tok/s
        assert first.decode_tps == 0  # nothing was measured yet: no rate is made up
        async with consumer_for(double) as consumer:  # a load, its timed pass, and a request served
            done = await consumer.chat.completions.create(model="tiny", max_tokens=4,
                                                          messages=[{"role": "user", "content": "hi"}])
        assert done.usage.completion_tokens == 4
        manager = provider.agent.manager
        assert await manager.unload("tiny", cause=EvictionCause.OPERATOR)  # cold again
        assert manager.state("tiny") is not ModelState.LOADED
        mark = double.mark()
        await double.close_provider(view, 1001, "going away")  # the April coordinator reads rates only here
        await double.wait_for(lambda e: isinstance(e, Registered), timeout=30, since=mark)
        again = registers(double)[-1]
        assert manager.state("tiny") is not ModelState.LOADED  # registered cold
        assert again.decode_tps > 0 and again.prefill_tps > 0
        assert again.hardware.memory_bandwidth_gbs == first.hardware.memory_bandwidth_gbs  # measured once
        assert double.anomalies() == []


def test_the_bandwidth_is_apples_figure_on_a_mac_and_measured_elsewhere():
    from provider.hardware import detect_machine, measure_memory_bandwidth_gbs

    asked: list[int] = []

    def measure() -> float:
        asked.append(1)
        return 12.5

    sysctl = {("sysctl", "machdep.cpu.brand_string"): "machdep.cpu.brand_string: Apple M3 Max\n"}
    mac = detect_machine(platform="darwin", measure=measure,
                         run=lambda argv: sysctl.get(tuple(argv), '"gpu-core-count" = 40' if argv[0] == "ioreg" else None))
    assert (mac.memory_bandwidth_gbs, mac.bandwidth_measured, asked) == (400, False, [])  # the table's
    here = detect_machine(platform="linux", measure=measure)
    assert (here.memory_bandwidth_gbs, here.bandwidth_measured, asked) == (12.5, True, [1])
    measured = measure_memory_bandwidth_gbs()  # this machine's MLX device, for real
    assert 0 < measured <= 2000
