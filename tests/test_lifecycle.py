"""The coordinator lifecycle, against the coordinator double over a real WebSocket.

* ``trust_status`` ([N], diagnostics only) is kept and shown in ``/status``, `darkbloom-provider status`
  and `doctor`;
* a planned shutdown sends ``provider_drain`` behind every terminal frame and waits (bounded) for its
  ``provider_drain_ack`` before the close; a coordinator that never acknowledges costs the bound, no more,
  and the missing ack is recorded, not taken for success;
* a close with 1013 (the coordinator is restoring our state) is followed by a reconnect after the backoff
  and counted apart, not as a lost connection.

The SIGTERM drain of a real process, with the barrier, is in tests/test_e2e.py.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from coordinator_double import (
    Accepted,
    ClosedByDouble,
    CoordinatorDouble,
    Disconnected,
    DrainAckSent,
    DrainBarrier,
    FrameReceived,
    Registered,
    TrustStatusSent,
)
from double_fixtures import consumer_for, quick_config
from provider.cli import render_status
from provider.doctor import render_table, report_json, run_doctor
from provider.session.status import LinkState, SessionStatus
from running_agent import Agents, RunningAgent, agent_settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Running(RunningAgent):
    """An agent with a client of its local status endpoint."""

    http: httpx.AsyncClient | None = None

    @property
    def status(self) -> SessionStatus:
        return self.agent.session.status

    async def session(self) -> dict:
        return (await self.http.get("/status")).json()["session"]


@pytest.fixture
async def run_agent(tiny_model_path: Path, tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    agents = Agents()
    clients: list[httpx.AsyncClient] = []

    async def start(url: str, **overrides) -> Running:
        port = free_port()
        handle = await agents.start(agent_settings(url, tmp_path / "state", {"tiny": tiny_model_path},
                                                   drain_timeout_s=10.0, local_port=port, **overrides), Running)
        handle.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)
        clients.append(handle.http)
        return handle

    yield start
    await agents.stop_all(ledger_empty=False)
    for client in clients:
        await client.aclose()


async def test_trust_status_is_shown_in_status_the_status_command_and_doctor(run_agent):
    async with CoordinatorDouble(quick_config()) as double:
        provider = await run_agent(double.ws_url)
        (view,) = await double.wait_routable(model="tiny", timeout=30)
        assert provider.status.trust is None or provider.status.trust.status == "online"
        assert "trust_status:" in render_status((await provider.http.get("/status")).json())
        # The dev posture's registration attestation verifies: [N] says so (self_signed, online) at once.
        assert double.provider(view).attested
        await provider.status.wait_for(lambda s: s.trust is not None, timeout=10)
        first = (await provider.session())["trust"]
        assert (first["trust_level"], first["status"]) == ("self_signed", "online")

        await double.send_trust_status(view, "none", "untrusted", "attestation challenge failed")
        await provider.status.wait_for(lambda s: s.trust.status == "untrusted", timeout=10)
        trust = (await provider.session())["trust"]
        assert (trust["trust_level"], trust["status"], trust["reason"]) == \
            ("none", "untrusted", "attestation challenge failed")
        assert trust["at"] <= time.time()
        text = render_status((await provider.http.get("/status")).json())
        assert "trust_status: none, untrusted: attestation challenge failed" in text

        # A later word replaces it; the session stays up: it is diagnostics only.
        await double.send_trust_status(view, "self_signed", "online", "recovered after transient deroute")
        await provider.status.wait_for(lambda s: s.trust is not None and s.trust.status == "online", timeout=10)
        assert provider.status.state is LinkState.REGISTERED and double.routable()

        report = await asyncio.to_thread(run_doctor, provider.settings, check_coordinator_url=False,
                                         explain_routing=False, guest=None)
        assert report_json(report)["agent"]["trust"]["reason"] == "recovered after transient deroute"
        assert "trust_status: self_signed, online: recovered after transient deroute" in render_table(report)
        assert [e.status for e in double.events.of(TrustStatusSent)] == ["online", "untrusted", "online"]
        assert double.anomalies() == []


async def test_a_stop_sends_the_drain_barrier_after_every_terminal_and_closes_once_it_is_acknowledged(run_agent):
    async with CoordinatorDouble(quick_config()) as double:
        provider = await run_agent(double.ws_url, drain_ack_timeout_s=30.0)
        await double.wait_routable(model="tiny", timeout=30)
        async with consumer_for(double) as consumer:
            completion = await consumer.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert completion.usage.completion_tokens == 3
        started = time.monotonic()
        provider.stop.set()
        assert await asyncio.wait_for(provider.task, 30) == 0
        assert time.monotonic() - started < 10  # the ack came: the 30 s bound was not waited out

        (barrier,) = double.events.of(DrainBarrier)
        (ack,) = double.events.of(DrainAckSent)
        disconnected = await double.wait_for(lambda e: isinstance(e, Disconnected), timeout=10)
        assert ack.request_id == barrier.request_id and ack.delivered and barrier.pending == 0
        assert 0 < len(barrier.request_id) <= 64
        terminals = [e for e in double.events.of(FrameReceived) if e.message.type == "inference_complete"]
        assert len(terminals) == 1 and terminals[0].at <= barrier.at <= ack.at <= disconnected.at
        assert disconnected.close_code == 1000
        drain = provider.status.view().last_drain
        assert drain is not None and drain.acked
        assert double.anomalies() == []


async def test_a_coordinator_that_never_acknowledges_costs_the_bound_then_the_close(run_agent):
    async with CoordinatorDouble(quick_config(drain_ack=False)) as double:
        provider = await run_agent(double.ws_url, drain_ack_timeout_s=1.0)
        (view,) = await double.wait_routable(model="tiny", timeout=30)
        # The coordinator has shown the newer protocol (a trust_status): only then is a barrier sent.
        await provider.status.wait_for(lambda s: s.trust is not None, timeout=10)
        provider.stop.set()
        barrier = await double.wait_for(lambda e: isinstance(e, DrainBarrier), timeout=10)
        assert not double.provider(view).routable  # fenced from new dispatch at once
        disconnected = await double.wait_for(lambda e: isinstance(e, Disconnected), timeout=10)
        assert await asyncio.wait_for(provider.task, 30) == 0
        assert disconnected.close_code == 1000
        assert disconnected.at - barrier.at >= 1.0 * 0.95  # the bound was waited out (monotonic clocks)
        assert double.events.of(DrainAckSent) == []
        drain = provider.status.view().last_drain
        assert drain is not None and not drain.acked and drain.waited_s >= 0.95
        assert "last drain barrier: NOT acknowledged" in render_status(
            {"mode": "coordinator", "session": provider.status.view().as_json()})
        assert double.anomalies() == []


async def test_a_1013_close_is_a_wait_then_a_reconnect_not_a_failure(run_agent):
    async with CoordinatorDouble(quick_config(restore_pending_registrations=1)) as double:
        provider = await run_agent(double.ws_url)
        closed = await double.wait_for(lambda e: isinstance(e, ClosedByDouble), timeout=30)
        assert closed.code == 1013
        first = await double.wait_for(lambda e: isinstance(e, Disconnected), timeout=10)
        assert first.close_code == 1013
        await provider.status.wait_for(lambda s: s.state is LinkState.BACKING_OFF, timeout=10)
        waiting = provider.status.view()
        assert waiting.restore_waits == 1 and waiting.connection_losses == 0  # not a lost connection
        assert waiting.last_close is not None and waiting.last_close.cause.value == "state_restoring"
        assert waiting.last_close.code == 1013 and waiting.backoff_delay_s is not None
        assert 0.8 <= waiting.backoff_delay_s <= 1.2  # the ordinary first backoff delay (1 s ± 20 %)

        # After the backoff: a fresh socket and register, routable, serving.
        await double.wait_routable(model="tiny", timeout=30)
        registered = double.events.of(Registered)
        assert len(registered) == 2 and registered[1].provider_id != registered[0].provider_id
        assert registered[1].at - first.at >= 0.8 * 0.95
        async with consumer_for(double) as consumer:
            completion = await consumer.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert completion.usage.completion_tokens == 2 and len(double.events.of(Accepted)) == 1
        session = await provider.session()
        assert session["restore_waits"] == 1 and session["reconnects"] == 0 and session["registrations"] == 2
        metrics = (await provider.http.get("/metrics")).text
        assert "darkbloom_session_reconnects_total 0.0" in metrics
        assert "darkbloom_session_restore_waits_total 1.0" in metrics
        assert "coordinator restoring our state (1013, not a failure): 1 time(s)" in render_status(
            (await provider.http.get("/status")).json())
        assert double.anomalies() == []
