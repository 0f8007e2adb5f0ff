"""The session's asyncio shell with an injected in-memory transport: register per connection, send
queue, heartbeats, drain, connection loss, reconnect with backoff. (End to end over a real WebSocket:
tests/test_e2e*.py.)"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
from websockets.asyncio.server import serve

from protocol import (
    AttestationResponse,
    CpuCores,
    Hardware,
    Heartbeat,
    HeartbeatStats,
    InferenceAccepted,
    InferenceComplete,
    InferenceRequest,
    Register,
    SystemMetrics,
    Usage,
    encode,
)
from provider.session.connection import Session, SessionConfig, websocket_connect
from provider.telemetry import capture_redacted_logs

KEY = "tHFZkLURE4Ne6qGImKWQ5P0vHEfBq17lkLkV/Wm2rSU="
HW = Hardware(machine_model="m", chip_name="c", chip_family="Unknown", chip_tier="Unknown", memory_gb=16,
              memory_available_gb=8.0, cpu_cores=CpuCores(total=2, performance=2, efficiency=0), gpu_cores=0,
              memory_bandwidth_gbs=0.0)
_CLOSE = object()


class MemoryTransport:
    """One connection: the test pushes inbound frames; the session's sends are recorded."""

    def __init__(self, stall_on_register_s: float = 0.0) -> None:
        self.inbound: asyncio.Queue = asyncio.Queue()
        self.sent: list[dict] = []
        self.sent_changed = asyncio.Condition()
        self.close_code: int | None = None
        self.stall_on_register_s = stall_on_register_s  # the loop stalls as the register goes out

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.inbound.get()
        if item is _CLOSE:
            raise StopAsyncIteration
        return item

    async def send(self, message: str) -> None:
        if self.close_code is not None:
            from websockets.exceptions import ConnectionClosedOK

            raise ConnectionClosedOK(None, None)
        self.sent.append(json.loads(message))
        if self.sent[-1]["type"] == "register" and self.stall_on_register_s:
            time.sleep(self.stall_on_register_s)  # the whole event loop, as under SIGSTOP
        async with self.sent_changed:
            self.sent_changed.notify_all()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        if self.close_code is None:
            self.close_code = code
        self.inbound.put_nowait(_CLOSE)

    def drop(self) -> None:
        """The peer went away."""
        self.inbound.put_nowait(_CLOSE)

    async def wait_for(self, predicate) -> None:
        async with self.sent_changed:
            await self.sent_changed.wait_for(lambda: predicate(self.sent))

    def types(self) -> list[str]:
        return [f["type"] for f in self.sent]


class Harness:
    def __init__(self, *, fail_first: int = 0, drain_timeout_s: float = 5.0,
                 heartbeat_interval_s: float = 0.05, eviction_window_s: float = 90.0,
                 stall_on_first_register_s: float = 0.0, drain_ack_timeout_s: float = 0.05) -> None:
        self.transports: list[MemoryTransport] = []
        self.stall_on_first_register_s = stall_on_first_register_s
        self.connected = asyncio.Condition()
        self.fail_first = fail_first
        self.attempts = 0
        self.retried = asyncio.Event()  # set at the second connect attempt
        self.delays_used: list[float] = []
        self.jobs_started: list[str] = []
        self.jobs_cancelled: list[str] = []
        self.release = asyncio.Event()
        self.session = Session(
            SessionConfig(url="ws://127.0.0.1:1/ws/provider", heartbeat_interval_s=heartbeat_interval_s,
                          drain_timeout_s=drain_timeout_s, eviction_window_s=eviction_window_s,
                          drain_ack_timeout_s=drain_ack_timeout_s, backoff=self._backoff),
            build_register=lambda: Register(hardware=HW, models=(), backend="inprocess-mlx", public_key=KEY,
                                            encrypted_response_chunks=True),
            answer_challenge=lambda c: AttestationResponse(nonce=c.nonce, signature="c2ln", public_key=KEY),
            build_heartbeat=lambda draining: Heartbeat(
                status="draining" if draining else "idle", stats=HeartbeatStats(requests_served=0, tokens_generated=0),
                system_metrics=SystemMetrics(memory_pressure=0.1, cpu_usage=0.1, thermal_state="nominal")),
            run_job=self._job,
            connect=self._connect,
        )

    def _backoff(self) -> Iterator[float]:
        while True:
            self.delays_used.append(0.01)
            yield 0.01

    async def _connect(self, url: str) -> MemoryTransport:
        self.attempts += 1
        if self.attempts >= 2:
            self.retried.set()
        if self.attempts <= self.fail_first:
            raise OSError("connection refused")
        transport = MemoryTransport(0.0 if self.transports else self.stall_on_first_register_s)
        self.transports.append(transport)
        async with self.connected:
            self.connected.notify_all()
        return transport

    async def _job(self, request: InferenceRequest, send) -> None:
        rid = request.request_id
        self.jobs_started.append(rid)
        send(encode(InferenceAccepted(request_id=rid)))
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.jobs_cancelled.append(rid)
            raise
        send(encode(InferenceComplete(request_id=rid, usage=Usage(prompt_tokens=1, completion_tokens=1))))

    async def connection(self, n: int) -> MemoryTransport:
        async with self.connected:
            await self.connected.wait_for(lambda: len(self.transports) >= n)
        transport = self.transports[n - 1]
        await transport.wait_for(lambda sent: sent)  # register is out
        return transport


def request(rid: str) -> str:
    return json.dumps({"type": "inference_request", "request_id": rid,
                       "encrypted_body": {"ephemeral_public_key": KEY, "ciphertext": "AAAA"}})


async def test_register_first_then_heartbeats_and_challenge_answers():
    h = Harness()
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    conn = await h.connection(1)
    assert conn.types()[0] == "register"
    conn.inbound.put_nowait('{"type":"attestation_challenge","nonce":"bm9uY2U=","timestamp":"2026-04-30T10:41:07Z"}')
    await conn.wait_for(lambda sent: sum(f["type"] == "heartbeat" for f in sent) >= 3
                        and any(f["type"] == "attestation_response" for f in sent))
    assert conn.types().count("register") == 1
    stop.set()
    await task
    assert conn.close_code == 1000


async def test_a_capacity_change_sends_a_heartbeat_at_once_not_at_the_next_tick():
    h = Harness(heartbeat_interval_s=3600.0)  # only the first tick would ever come on its own
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    conn = await h.connection(1)
    await conn.wait_for(lambda sent: sum(f["type"] == "heartbeat" for f in sent) == 1)
    h.session.capacity_changed()  # e.g. the manager published a model
    await conn.wait_for(lambda sent: sum(f["type"] == "heartbeat" for f in sent) == 2)
    stop.set()
    await task


async def test_drain_lets_the_running_job_finish_and_refuses_new_ones():
    h = Harness()
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    conn = await h.connection(1)
    conn.inbound.put_nowait(request("running"))
    await conn.wait_for(lambda sent: any(f["type"] == "inference_accepted" for f in sent))
    stop.set()
    await conn.wait_for(lambda sent: any(f.get("status") == "draining" for f in sent))
    conn.inbound.put_nowait(request("late"))
    await conn.wait_for(lambda sent: any(f.get("request_id") == "late" for f in sent))
    assert not task.done()
    h.release.set()
    await task
    late = [f for f in conn.sent if f.get("request_id") == "late"]
    assert [(f["type"], f["status_code"], f["error_reason"]) for f in late] == [("inference_error", 503, "draining")]
    assert [f["type"] for f in conn.sent if f.get("request_id") == "running"] == \
        ["inference_accepted", "inference_complete"]
    assert conn.close_code == 1000 and h.jobs_cancelled == [] and h.jobs_started == ["running"]


async def test_drain_timeout_cancels_jobs_then_closes_1000():
    h = Harness(drain_timeout_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    conn = await h.connection(1)
    conn.inbound.put_nowait(request("slow"))
    await conn.wait_for(lambda sent: any(f["type"] == "inference_accepted" for f in sent))
    stop.set()
    await task
    assert h.jobs_cancelled == ["slow"] and conn.close_code == 1000
    assert [f["type"] for f in conn.sent if f.get("request_id") == "slow"] == ["inference_accepted"]


async def test_lost_connection_cancels_jobs_and_reconnects_with_a_fresh_register():
    h = Harness()
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    first = await h.connection(1)
    first.inbound.put_nowait(request("r1"))
    await first.wait_for(lambda sent: any(f["type"] == "inference_accepted" for f in sent))
    first.drop()
    second = await h.connection(2)
    assert h.jobs_cancelled == ["r1"]
    assert second.types()[0] == "register" and second.types().count("register") == 1
    assert h.session.counters.connection_losses == 1 and h.session.counters.registrations == 2
    second.inbound.put_nowait('{"type":"cancel","request_id":"r1"}')  # old id: ignored
    second.inbound.put_nowait(request("r2"))
    await second.wait_for(lambda sent: any(f.get("request_id") == "r2" for f in sent))
    h.release.set()
    await second.wait_for(lambda sent: any(f["type"] == "inference_complete" for f in sent))
    stop.set()
    await task


async def test_connect_failures_back_off_then_succeed():
    h = Harness(fail_first=3)
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    await h.connection(1)
    assert h.attempts == 4 and len(h.delays_used) >= 3
    stop.set()
    await task


async def test_stop_while_disconnected_returns_at_once():
    h = Harness(fail_first=10**6)
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    await h.retried.wait()
    stop.set()
    await asyncio.wait_for(task, 2)


@pytest.mark.parametrize("frame", ["garbage", '{"type":"nope"}', b"\x00\x01", '{"type":"cancel","request_id":"x"}'])
async def test_bad_frames_do_not_end_the_connection(frame):
    h = Harness()
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    conn = await h.connection(1)
    conn.inbound.put_nowait(frame)
    conn.inbound.put_nowait('{"type":"attestation_challenge","nonce":"bm9uY2U=","timestamp":"t"}')
    await conn.wait_for(lambda sent: any(f["type"] == "attestation_response" for f in sent))
    assert len(h.transports) == 1 and h.session.counters.connection_losses == 0
    stop.set()
    await task


async def test_over_long_echoed_fields_are_not_answered_and_the_session_stays_up():
    """An 11 MiB nonce or request id cannot be echoed (the answer would exceed the
    coordinator's 10 MiB frame limit); the frame is refused, nothing is sent, the connection stays."""
    h = Harness()
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    conn = await h.connection(1)
    huge = "n" * (11 * 1024 * 1024)
    conn.inbound.put_nowait(json.dumps({"type": "attestation_challenge", "nonce": huge, "timestamp": "t"}))
    conn.inbound.put_nowait(json.dumps({"type": "inference_request", "request_id": huge, "encrypted_body": 1}))
    conn.inbound.put_nowait(request(huge))
    conn.inbound.put_nowait('{"type":"attestation_challenge","nonce":"bm9uY2U=","timestamp":"t"}')
    await asyncio.wait_for(conn.wait_for(lambda sent: any(f["type"] == "attestation_response" for f in sent)), 10)
    assert [f["nonce"] for f in conn.sent if f["type"] == "attestation_response"] == ["bm9uY2U="]
    assert not any("request_id" in f for f in conn.sent) and h.jobs_started == []
    assert len(h.transports) == 1 and h.session.counters.connection_losses == 0
    stop.set()
    await task


async def test_a_stall_longer_than_the_eviction_window_reconnects_with_a_fresh_register():
    """A process stalled past the coordinator's eviction window has been forgotten by it
    although its socket is open; the gap between two heartbeats (monotonic) shows it."""
    h = Harness(heartbeat_interval_s=0.05, eviction_window_s=0.3)
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    first = await h.connection(1)
    await first.wait_for(lambda sent: sum(f["type"] == "heartbeat" for f in sent) >= 2)
    assert len(h.transports) == 1  # heartbeats on time: no reconnect
    time.sleep(0.5)  # the whole event loop stalls, as under SIGSTOP
    second = await asyncio.wait_for(h.connection(2), 10)
    assert second.types()[0] == "register" and first.close_code == 1000
    assert h.session.counters.connection_losses == 1 and h.session.counters.registrations == 2
    stop.set()
    await task


async def test_a_stall_right_after_register_before_any_heartbeat_also_reconnects():
    """The gap is counted from the register, not from the first heartbeat: a process stopped as its register
    went out (before the heartbeat task first ran) has been evicted too, having sent no heartbeat at all."""
    h = Harness(heartbeat_interval_s=0.05, eviction_window_s=0.3, stall_on_first_register_s=0.5)
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    first = await h.connection(1)
    second = await asyncio.wait_for(h.connection(2), 10)
    assert second.types()[0] == "register" and first.close_code == 1000
    assert h.session.counters.connection_losses == 1
    stop.set()
    await task


# --- redirects, over a real WebSocket ----------------------------------------------------------------------


@pytest.mark.parametrize("where", ["other_port", "any_address", "same_origin"])
async def test_a_redirect_on_the_upgrade_is_never_followed(where):
    """A coordinator URL answering the upgrade with 302 is not followed (register carries
    the auth token and posture claims); the agent retries the configured URL with backoff instead."""
    target_frames: list[str] = []
    attempts = asyncio.Queue()

    async def record(ws) -> None:
        async for frame in ws:
            target_frames.append(frame)

    target = await serve(record, "127.0.0.1", 0)
    port = target.sockets[0].getsockname()[1]
    location = {"other_port": f"ws://127.0.0.1:{port}/ws/provider",
                "any_address": f"ws://0.0.0.0:{port}/ws/provider", "same_origin": "/elsewhere"}[where]

    def redirect(connection, request):
        if request.path != "/ws/provider":
            return None  # /elsewhere on the redirecting server itself: accepted (record() sees the frames)
        attempts.put_nowait(request.path)
        response = connection.respond(302, "")
        response.headers["Location"] = location
        return response

    redirector = await serve(record, "127.0.0.1", 0, process_request=redirect)
    url = f"ws://127.0.0.1:{redirector.sockets[0].getsockname()[1]}/ws/provider"
    h = Harness()
    session = Session(SessionConfig(url=url, backoff=h._backoff), build_register=h.session._build_register,
                      answer_challenge=h.session._answer, build_heartbeat=h.session._build_heartbeat,
                      run_job=h.session._run_job, connect=websocket_connect(open_timeout_s=5))
    stop = asyncio.Event()
    with capture_redacted_logs() as logs:
        task = asyncio.create_task(session.run(stop))
        for _ in range(3):  # three connects, each one upgrade answered 302 and not followed
            assert await asyncio.wait_for(attempts.get(), 10) == "/ws/provider"
        stop.set()
        await asyncio.wait_for(task, 10)
    target.close()
    redirector.close()
    assert target_frames == [] and session.counters.registrations == 0 and session.counters.connects == 0
    refused = [e for e in logs if e["event"] == "coordinator_redirect_refused"]
    assert len(refused) >= 3 and refused[0]["status_code"] == 302


async def test_doctor_reports_a_redirecting_coordinator_as_rejecting_the_handshake():
    """`doctor` checks the coordinator with the agent's own client: a 302 is not "reachable"."""
    from provider.doctor import Reach, check_coordinator

    async def record(ws) -> None:
        async for _ in ws:
            pass

    target = await serve(record, "127.0.0.1", 0)

    def redirect(connection, request):
        if request.path != "/ws/provider":
            return None
        response = connection.respond(302, "")
        response.headers["Location"] = "/elsewhere"
        return response

    redirector = await serve(record, "127.0.0.1", 0, process_request=redirect)
    check = await check_coordinator(f"ws://127.0.0.1:{redirector.sockets[0].getsockname()[1]}/ws/provider", 5)
    target.close()
    redirector.close()
    assert (check.reachable, check.detail, check.http_status) == (False, Reach.HANDSHAKE_REJECTED, 302)


TRUST_STATUS = '{"type":"trust_status","trust_level":"none","status":"online","reason":""}'  # the newer protocol


async def test_the_drain_barrier_follows_the_terminal_frames_and_its_ack_ends_the_wait():
    h = Harness(drain_ack_timeout_s=60.0)
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    conn = await h.connection(1)
    conn.inbound.put_nowait(TRUST_STATUS)
    conn.inbound.put_nowait(request("running"))
    await conn.wait_for(lambda sent: any(f["type"] == "inference_accepted" for f in sent))
    stop.set()
    h.release.set()
    await conn.wait_for(lambda sent: any(f["type"] == "provider_drain" for f in sent))
    types = conn.types()
    assert types.index("inference_complete") < types.index("provider_drain")
    barrier = next(f for f in conn.sent if f["type"] == "provider_drain")
    assert not task.done()  # waiting for the ack, bounded by 60 s
    conn.inbound.put_nowait(json.dumps({"type": "provider_drain_ack", "request_id": "someone-else"}))  # ignored
    conn.inbound.put_nowait(json.dumps({"type": "provider_drain_ack", "request_id": barrier["request_id"]}))
    await asyncio.wait_for(task, 10)
    assert conn.close_code == 1000 and h.session.status.view().last_drain.acked


async def test_without_an_ack_the_drain_waits_its_bound_then_closes():
    h = Harness(drain_ack_timeout_s=0.3)
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    conn = await h.connection(1)
    conn.inbound.put_nowait(TRUST_STATUS)
    await h.session.status.wait_for(lambda s: s.trust is not None, timeout=10)
    started = time.monotonic()
    stop.set()
    await asyncio.wait_for(task, 10)
    assert time.monotonic() - started >= 0.3 and conn.close_code == 1000
    assert "provider_drain" in conn.types()
    drain = h.session.status.view().last_drain
    assert not drain.acked and drain.waited_s >= 0.3


async def test_a_coordinator_that_never_spoke_the_newer_protocol_gets_no_barrier_and_no_wait():
    """The April coordinator logs provider_drain as an unknown type and never answers it: the close
    follows the drain at once, as before the barrier existed (an hour's bound is never waited out)."""
    h = Harness(drain_ack_timeout_s=3600.0)
    stop = asyncio.Event()
    task = asyncio.create_task(h.session.run(stop))
    conn = await h.connection(1)
    conn.inbound.put_nowait('{"type":"attestation_challenge","nonce":"bm9uY2U=","timestamp":"2026-04-30T10:41:07Z"}')
    await conn.wait_for(lambda sent: any(f["type"] == "attestation_response" for f in sent))
    stop.set()
    await asyncio.wait_for(task, 60)
    assert conn.close_code == 1000 and "provider_drain" not in conn.types()
    assert h.session.status.view().last_drain is None
