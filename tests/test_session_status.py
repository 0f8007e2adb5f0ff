"""The coordinator session as the operator sees it — the ``session`` section of the agent's
local ``/status``, ``darkbloom-provider status`` and ``darkbloom_session_*`` in ``/metrics`` — through a
real agent (tiny MLX model) on a real WebSocket to the coordinator double: before the first connect,
registered, after a challenge, after ``runtime_status{verified:false}``, after a dropped socket, draining.

Waits are on events (the double's event log, ``SessionStatus.wait_for``), never on sleeps.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from coordinator_double import ChunkReceived, CoordinatorDouble, FrameReceived
from double_fixtures import consumer_for, sealed_request
from provider.agent import Agent
from provider.cli import render_status
from provider.config import Settings
from provider.session.connection import websocket_connect
from provider.session.status import LinkState, SessionStatus, public_url

NO_EOS = frozenset({10**9})  # the tiny model never stops early


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Running:
    def __init__(self, agent: Agent, stop: asyncio.Event, task: asyncio.Task[int], port: int) -> None:
        self.agent, self.stop, self.task = agent, stop, task
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)

    @property
    def status(self) -> SessionStatus:
        return self.agent.session.status

    async def session(self) -> dict:
        response = await self.http.get("/status")
        assert response.status_code == 200
        return response.json()["session"]

    async def metrics(self) -> str:
        return (await self.http.get("/metrics")).text


@pytest.fixture
async def run_agent(tiny_model_path: Path, tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    running: list[Running] = []

    async def start(url: str, *, connect=None, **overrides) -> Running:
        port = free_port()
        settings = Settings(**{
            "coordinator_url": url, "dev_posture": True, "state_dir": tmp_path / "state",
            "hf_cache_dir": tmp_path / "empty-hf-cache", "model_aliases": {"tiny": tiny_model_path},
            "memory_limit_gb": 8.0, "memory_reserve_gb": 0.5, "heartbeat_interval_s": 0.5, "drain_timeout_s": 10.0,
            "idle_timeout_mins": 0, "local_port": port, **overrides})
        agent = await Agent.start(settings, harden=False, connect=connect, eos_token_ids={"tiny": NO_EOS})
        stop = asyncio.Event()
        handle = Running(agent, stop, asyncio.create_task(agent.run(stop)), port)
        running.append(handle)
        # The status endpoint is bound before the first connect attempt starts.
        await handle.status.wait_for(lambda s: s.connect_attempts >= 1, timeout=10)
        return handle

    yield start
    for handle in running:
        handle.stop.set()
        assert await asyncio.wait_for(handle.task, 30) == 0
        await handle.http.aclose()


def gated_connect(gate: asyncio.Event):
    """The production connect factory, held back until ``gate`` is set (a real WebSocket after that)."""
    real = websocket_connect(open_timeout_s=5)

    async def connect(url: str):
        await gate.wait()
        return await real(url)

    return connect


async def test_session_fields_from_first_connect_through_a_dropped_socket(coordinator_double, run_agent):
    double: CoordinatorDouble = coordinator_double
    gate = asyncio.Event()
    provider = await run_agent(double.ws_url, connect=gated_connect(gate))

    # Before the first connection: connecting, nothing registered, nothing received.
    before = await provider.session()
    assert before["state"] == "connecting" and before["url"] == double.ws_url
    assert before["registrations"] == 0 and before["connected_since"] is None and before["reconnects"] == 0
    assert before["heartbeats_sent"] == 0 and before["challenges"]["received"] == 0
    assert before["runtime_status"] == {"verified": None, "mismatches": [], "at": None}
    assert before["last_close"] is None and before["backoff_delay_s"] is None

    # Registered: the first challenge (sent at register) is answered, heartbeats flow.
    started = time.time()
    gate.set()
    (view,) = await double.wait_routable(model="tiny", timeout=15)
    registered = await provider.session()
    assert registered["state"] == "registered" and registered["registrations"] == 1
    assert started <= registered["connected_since"] <= time.time()
    assert registered["heartbeats_sent"] >= 1
    assert registered["challenges"]["answered"] == registered["challenges"]["received"] == 1
    first_answer = registered["challenges"]["last_answered_at"]
    assert registered["connected_since"] <= first_answer

    # After another challenge: counted, and the answer time moves on.
    result = await double.send_challenge(view)
    assert result.ok
    challenged = await provider.session()
    assert challenged["challenges"]["received"] == challenged["challenges"]["answered"] == 2
    assert challenged["challenges"]["last_answered_at"] >= first_answer
    assert challenged["challenges"]["last_received_at"] == challenged["challenges"]["last_answered_at"]

    # runtime_status{verified:false}: the verdict and the components it names. The reader handles frames in
    # order, so once the challenge sent after it is answered, the verdict has been taken in.
    await double.send_raw(view, json.dumps({"type": "runtime_status", "verified": False, "mismatches": [
        {"component": "runtime", "expected": "one of known-good hashes", "got": "ab" * 32},
        {"component": "template:chatml", "expected": "x", "got": "y"}]}))
    await double.send_challenge(view)
    unverified = await provider.session()
    assert unverified["runtime_status"]["verified"] is False
    assert unverified["runtime_status"]["mismatches"] == ["runtime", "template:chatml"]
    assert unverified["state"] == "registered"  # a mismatch is only reported: we stay connected
    metrics = await provider.metrics()
    assert "darkbloom_session_runtime_verified 0.0" in metrics
    assert 'darkbloom_session_runtime_mismatch{component="runtime"} 1.0' in metrics
    assert 'darkbloom_session_state{state="registered"} 1.0' in metrics
    assert "darkbloom_session_registrations_total 1.0" in metrics
    text = render_status((await provider.http.get("/status")).json())
    assert "runtime_status: NOT VERIFIED (runtime, template:chatml)" in text

    # A dropped socket (the coordinator dies without a close frame): 1006, one reconnect, backing off.
    await double.kill()
    await provider.status.wait_for(lambda s: s.state is LinkState.BACKING_OFF, timeout=30)
    dropped = await provider.session()
    assert dropped["reconnects"] == 1 and dropped["connected_since"] is None
    assert dropped["last_close"]["code"] == 1006 and dropped["last_close"]["cause"] == "connection_lost"
    assert dropped["state"] in ("backing_off", "connecting")
    if dropped["state"] == "backing_off":  # the first delay is 1 s ± 20 %, the next 2 s ± 20 %
        assert 0.8 <= dropped["backoff_delay_s"] <= 2.4 and dropped["next_attempt_at"] > dropped["last_close"]["at"]
    assert "darkbloom_session_reconnects_total 1.0" in await provider.metrics()

    # The coordinator comes back: registered again, a fresh connection (verdict cleared).
    await double.start()
    await double.wait_routable(model="tiny", timeout=30)
    back = await provider.session()
    assert back["state"] == "registered" and back["registrations"] == 2 and back["reconnects"] == 1
    assert back["runtime_status"]["verified"] is None
    assert back["connected_since"] > dropped["last_close"]["at"]


async def test_draining_refuses_new_requests_and_says_so(coordinator_double, run_agent):
    """While a job finishes under a drain: state draining, a new request is refused (503 draining) and
    counted by reason; the job that was running counts as accepted."""
    double: CoordinatorDouble = coordinator_double
    provider = await run_agent(double.ws_url)
    (view,) = await double.wait_routable(model="tiny", timeout=15)
    async with consumer_for(double) as client:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "keep going"}], max_tokens=1900, stream=True)
        await double.wait_for(lambda e: isinstance(e, ChunkReceived), timeout=15)
        provider.stop.set()
        await provider.status.wait_for(lambda s: s.state is LinkState.DRAINING, timeout=10)
        mark = double.mark()
        await double.send_raw(view, sealed_request(view.public_key, "late-1", {
            "model": "tiny", "messages": [{"role": "user", "content": "too late"}], "max_tokens": 2}))
        refused = await double.wait_for(
            lambda e: isinstance(e, FrameReceived) and getattr(e.message, "request_id", "") == "late-1",
            since=mark, timeout=10)
        assert refused.message.type == "inference_error" and refused.message.error_reason == "draining"
        draining = await provider.session()
        assert draining["state"] == "draining"
        assert draining["requests"]["accepted"] == 1 and draining["requests"]["refused"] == {"draining": 1}
        text = render_status((await provider.http.get("/status")).json())
        assert "draining" in text and "refused: draining 1" in text
        await stream.close()  # the consumer leaves: the double cancels the job and the drain completes
    assert await asyncio.wait_for(provider.task, 30) == 0
    final = provider.status.view()
    assert final.state is LinkState.STOPPED and final.cancelled == 1 and final.last_close.cause == "drained"


def test_the_url_shown_has_no_secrets():
    assert public_url("wss://user:pw@coord.example:8443/ws/provider?token=abc#x") == \
        "wss://coord.example:8443/ws/provider"
    assert public_url("ws://[::1]:9/ws") == "ws://[::1]:9/ws"


def test_status_text_for_a_backing_off_session():
    now = 1_000_000.0
    session = {
        "state": "backing_off", "url": "wss://c/ws/provider", "connected_since": None, "connect_attempts": 3,
        "connect_failures": 1, "last_connect_error": "ConnectionRefusedError", "registrations": 2, "reconnects": 2,
        "heartbeats_sent": 40, "challenges": {"received": 3, "answered": 3, "last_received_at": now - 70,
                                               "last_answered_at": now - 70},
        "runtime_status": {"verified": True, "mismatches": [], "at": now - 80},
        "last_close": {"code": 1000, "reason": "goodbye", "cause": "closed_by_coordinator", "at": now - 2},
        "backoff_delay_s": 4.0, "next_attempt_at": now + 2.5,
        "requests": {"accepted": 5, "completed": 4, "cancelled": 1, "refused": {"memory_cap": 2}, "failed": {}},
    }
    text = render_status({"mode": "coordinator", "session": session}, now=now)
    assert "coordinator wss://c/ws/provider: backing_off, next attempt in 2.5 s (delay 4.0 s)" in text
    assert "registrations 2, reconnects 2, connect attempts 3 (1 failed, last ConnectionRefusedError)" in text
    assert "answered 3 (last 70 s ago)" in text and "runtime_status: verified" in text
    assert 'last close: 1000 "goodbye", closed_by_coordinator, 2 s ago' in text
    assert "requests accepted 5 (completed 4, cancelled 1), refused: memory_cap 2, failed: none" in text
    assert "trust_status: none received" in text  # no trust_status in this session ([A])
    session["trust"] = {"trust_level": "self_signed", "status": "online", "reason": "SE attestation verified",
                        "at": now - 5}
    session["restore_waits"], session["last_drain"] = 2, {"acked": True, "waited_s": 0.2, "at": now - 1}
    text = render_status({"mode": "coordinator", "session": session}, now=now)
    assert "trust_status: self_signed, online: SE attestation verified (5 s ago)" in text
    assert "coordinator restoring our state (1013, not a failure): 2 time(s)" in text
    assert "last drain barrier: acknowledged after 0.2 s, 1 s ago" in text
