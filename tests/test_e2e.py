"""End to end: the provider agent (real engine on the tiny MLX model, real model manager and ledger) against
the coordinator double over a real WebSocket on 127.0.0.1, consumers on the `openai` SDK.

Agents run in this process (``Agent.start(harden=False)``: hardening would change the test process) with
``dev_posture`` (the double, like a self-hosted coordinator, routes only to providers reporting SIP and the
privacy capabilities). The SIGTERM drain test runs ``python -m provider.agent`` as a real subprocess, with
real hardening.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import mlx_lm
import openai
import pytest

from coordinator_double import (
    JOB_HEADER,
    Accepted,
    ChunkReceived,
    Completed,
    CoordinatorDouble,
    Dispatched,
    Evicted,
    FrameReceived,
    Registered,
    Rejected,
    Rerouted,
)
from coordinator_double.events import Disconnected, DrainAckSent, DrainBarrier
from double_fixtures import consumer_for, quick_config, sealed_request
from engine_arithmetic import assert_decisive_reply
from openai_shape import assert_openai_stream
from provider.engine import ChatRequest, Engine, SamplingParams
from provider.telemetry import capture_redacted_logs
from running_agent import (
    NO_EOS,
    agent_process,
    chat_messages,
    no_request_reservations,
)


async def engine_alone(model_path: Path, content: str, max_tokens: int) -> tuple[str, int, int]:
    """The reference: the engine by itself on the same model, greedy."""
    async with Engine() as engine:
        await engine.load("ref", model_path, eos_token_ids=NO_EOS)
        stream = engine.submit("ref", ChatRequest("ref-1", chat_messages(content),
                                                  SamplingParams(max_tokens=max_tokens, temperature=0)))
        text, finished = await stream.collect()
    # The agent computes it another way (its prefix cache splits a repeated prompt's prefill): the
    # same text only where no greedy choice is a near-tie (engine_arithmetic.py).
    assert_decisive_reply(mlx_lm.load(str(model_path)), chat_messages(content), finished.completion_ids, content)
    return text, finished.usage.prompt_tokens, finished.usage.completion_tokens


async def frames_for(double: CoordinatorDouble, request_id: str) -> list[str]:
    return [e.message.type for e in double.events.of(FrameReceived)
            if getattr(e.message, "request_id", None) == request_id]


# --- answers --------------------------------------------------------------------------------------------


async def test_openai_stream_and_non_stream_equal_the_engine(coordinator_double, openai_consumer, start_agent,
                                                             tiny_model_path):
    double = coordinator_double
    provider = await start_agent(double.ws_url)
    await double.wait_routable(model="tiny", timeout=15)
    expected_text, prompt_tokens, completion_tokens = await engine_alone(tiny_model_path, "hello there", 12)

    stream = await openai_consumer.chat.completions.create(
        model="tiny", messages=chat_messages("hello there"), max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True})
    parts, usage = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(parts) == expected_text
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, completion_tokens)

    raw = await openai_consumer.chat.completions.with_raw_response.create(
        model="tiny", messages=chat_messages("hello there"), max_tokens=12, temperature=0)
    completion = raw.parse()
    assert completion.choices[0].message.content == expected_text
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt_tokens, 12)
    request_id = raw.headers[JOB_HEADER]
    done = await double.wait_for(lambda e: isinstance(e, Completed) and e.request_id == request_id, timeout=5)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens, 12)
    types = await frames_for(double, request_id)
    assert types[0] == "inference_accepted" and types[-1] == "inference_complete"
    assert types.count("inference_complete") == 1 and "inference_error" not in types
    assert double.anomalies() == []
    assert provider.agent.stats.requests_served == 2 and provider.agent.stats.tokens_generated == 24


async def test_a_streaming_consumer_receives_openais_stream_byte_for_byte(coordinator_double, start_agent):
    """The provider sends one ``data:`` line per chunk, no [DONE] chunk; the coordinator adds a blank line per chunk and
    its own [DONE], so the consumer sees exactly one [DONE] and one blank line per event."""
    double = coordinator_double
    await start_agent(double.ws_url)
    await double.wait_routable(model="tiny", timeout=15)
    request = {"model": "tiny", "messages": chat_messages(), "max_tokens": 5, "stream": True,
               "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=double.http_url, timeout=60) as http:
        async with http.stream("POST", "/v1/chat/completions", json=request) as response:
            raw = b"".join([part async for part in response.aiter_raw()])
    assert_openai_stream(raw)
    lines = [e.event for e in double.events.of(ChunkReceived)]
    assert len(lines) >= 3 and all(line.startswith(b"data: {") and b"\n" not in line for line in lines)
    assert double.anomalies() == []


async def test_two_providers_one_full_the_request_is_rerouted(coordinator_double, start_agent, tiny_model_path,
                                                              quantized_model_path):
    """P1 holds one model slot, busy with a long request for another model: a request for the tiny model cannot
    load there (503 slot_state, no accept) and is rerouted to P2."""
    double = coordinator_double
    full = await start_agent(double.ws_url, "full", models={"tiny": tiny_model_path, "other": quantized_model_path},
                             max_model_slots=1)
    await double.wait_routable(1, model="other", timeout=15)
    spare = await start_agent(double.ws_url, "spare")
    await double.wait_routable(2, model="tiny", timeout=15)
    p1, p2 = (p.provider_id for p in double.providers)
    async with consumer_for(double) as client:
        # Both providers get one long request, so the tie on in-flight count sends the next one to P1 first.
        busy = []
        for model, provider_id in (("other", p1), ("tiny", p2)):
            busy.append(await client.chat.completions.create(
                model=model, messages=chat_messages("keep busy"), max_tokens=1900, temperature=0, stream=True))
            await double.wait_for(lambda e, p=provider_id: isinstance(e, ChunkReceived) and e.provider_id == p,
                                  timeout=10)
        assert double.provider(p1).in_flight == 1 and double.provider(p2).in_flight == 1
        # A heartbeat sent while P2 was loading says "reloading" ([A]: unroutable); wait for the next one.
        await double.wait_until(lambda: "tiny" in double.provider(p2).warm_models, timeout=10)
        mark = double.mark()
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=chat_messages("rerouted"), max_tokens=5, temperature=0)
        assert raw.parse().usage.completion_tokens == 5
        for stream in busy:
            await stream.close()  # the consumers leave: the double cancels both long jobs
    reject = next(e for e in double.events[mark:] if isinstance(e, Rejected))
    assert reject.provider_id == p1 and reject.status_code == 503 and reject.failure_code == "capacity"
    assert reject.error_reason == "capacity_busy" and not reject.internal
    assert not any(isinstance(e, Accepted) and e.request_id == reject.request_id for e in double.events)
    assert await frames_for(double, reject.request_id) == ["inference_error"]
    assert any(isinstance(e, Rerouted) and e.request_id == reject.request_id for e in double.events[mark:])
    served = raw.headers[JOB_HEADER]
    assert served != reject.request_id
    assert next(e for e in double.events[mark:] if isinstance(e, Completed)).provider_id == p2
    assert double.anomalies() == []
    assert full.agent.stats.requests_served == 0 and spare.agent.stats.requests_served == 1


async def test_a_model_folder_deleted_after_discovery_is_refused_before_the_accept_and_dropped(
        coordinator_double, openai_consumer, start_agent, tiny_model_path, tmp_path):
    """A folder deleted after discovery was accepted, then failed 503 ``model_load`` 0.04 s
    later. It is refused before ``inference_accepted`` with a permanent 404, dropped from the inventory
    (the next register does not list it), and the other model is still served."""
    import shutil

    double = coordinator_double
    doomed = tmp_path / "doomed"
    shutil.copytree(tiny_model_path, doomed)
    running = await start_agent(double.ws_url, models={"doomed": doomed, "tiny": tiny_model_path})
    await double.wait_routable(model="doomed", timeout=15)
    shutil.rmtree(doomed)
    mark = double.mark()
    with pytest.raises(openai.NotFoundError):
        await openai_consumer.chat.completions.create(model="doomed", messages=chat_messages(), max_tokens=4)
    rejects = [e for e in double.events[mark:] if isinstance(e, Rejected)]
    assert rejects and all((r.status_code, r.failure_code) == (404, "model_unavailable") for r in rejects)
    assert not any(isinstance(e, Accepted) for e in double.events[mark:])
    assert [m.id for m, _ in running.agent.manager.verdicts()] == ["tiny"]
    assert "doomed" not in running.agent.runtime.servable_now()
    done = await openai_consumer.chat.completions.create(model="tiny", messages=chat_messages(), max_tokens=4)
    assert done.usage.completion_tokens >= 1
    assert no_request_reservations(running.agent.ledger)


async def test_a_cold_model_is_accepted_within_one_second(coordinator_double, openai_consumer, start_agent,
                                                          small_model_path):
    double = coordinator_double
    provider = await start_agent(double.ws_url, models={"small": small_model_path})
    await double.wait_routable(model="small", timeout=15)
    assert provider.agent.manager.warm_models() == []
    loop = asyncio.get_running_loop()
    consumer = asyncio.create_task(openai_consumer.chat.completions.create(
        model="small", messages=chat_messages("cold start"), max_tokens=4, temperature=0))
    dispatched = await double.wait_for(lambda e: isinstance(e, Dispatched), timeout=10)
    sent_at = loop.time()
    await double.wait_for(lambda e: isinstance(e, Accepted) and e.request_id == dispatched.request_id, timeout=1)
    accepted_after = loop.time() - sent_at
    completion = await consumer
    assert accepted_after < 1.0 and completion.usage.completion_tokens == 4
    assert (await frames_for(double, dispatched.request_id))[:2] == ["inference_accepted", "inference_response_chunk"]


# --- cancels, disconnects, restarts -------------------------------------------------------------------------


async def test_cancel_on_consumer_disconnect_stops_the_job(coordinator_double, start_agent):
    double = coordinator_double
    provider = await start_agent(double.ws_url)
    await double.wait_routable(model="tiny", timeout=15)
    async with httpx.AsyncClient(base_url=double.http_url, timeout=30) as client:
        body = {"model": "tiny", "messages": chat_messages("a long answer"), "max_tokens": 1900, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            request_id = response.headers[JOB_HEADER]
            events = [line async for line in _take_data_lines(response, 3)]
            assert all(json.loads(line[len("data: "):])["object"] == "chat.completion.chunk" for line in events)
            # the consumer leaves mid-stream
    await double.wait_until(lambda: provider.agent.stats.cancellations_received == 1, timeout=10)
    await double.wait_until(lambda: no_request_reservations(provider.agent.ledger), timeout=10)
    types = await frames_for(double, request_id)
    assert "inference_complete" not in types and "inference_error" not in types
    assert provider.agent.stats.requests_served == 0 and not provider.agent.stats.serving
    # The provider keeps serving.
    async with consumer_for(double) as consumer:
        completion = await consumer.chat.completions.create(model="tiny", messages=chat_messages(), max_tokens=3)
    assert completion.usage.completion_tokens == 3


async def _take_data_lines(response: httpx.Response, n: int) -> AsyncIterator[str]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line
            n -= 1
            if n == 0:
                return


async def test_double_killed_mid_stream_then_restarted(coordinator_double, start_agent):
    double = coordinator_double
    provider = await start_agent(double.ws_url)
    await double.wait_routable(model="tiny", timeout=15)
    async with consumer_for(double) as consumer:
        streaming = asyncio.create_task(consumer.chat.completions.create(
            model="tiny", messages=chat_messages("mid stream"), max_tokens=1900, stream=True))
        await double.wait_for(lambda e: isinstance(e, ChunkReceived), timeout=10)
        assert provider.agent.stats.serving
        await double.kill()
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            stream = await streaming
            async for _ in stream:
                pass
    await double.wait_until(lambda: not provider.agent.stats.serving and no_request_reservations(provider.agent.ledger), timeout=10)
    assert provider.agent.stats.cancellations_received == 1
    mark = double.mark()
    await double.restart()
    (view,) = await double.wait_routable(model="tiny", timeout=15)  # re-registered, challenge answered
    assert view.challenge_passed and provider.agent.session.counters.registrations == 2
    async with consumer_for(double) as consumer:
        completion = await consumer.chat.completions.create(model="tiny", messages=chat_messages(), max_tokens=4)
    assert completion.usage.completion_tokens == 4
    assert double.anomalies(since=mark) == []
    assert no_request_reservations(provider.agent.ledger)


# --- hostile frames ----------------------------------------------------------------------------------------


async def test_malformed_oversized_tampered_and_unknown_frames_never_crash_the_session(coordinator_double,
                                                                                      start_agent):
    double = coordinator_double
    provider = await start_agent(double.ws_url)
    (view,) = await double.wait_routable(model="tiny", timeout=15)
    key = view.public_key
    tampered = json.dumps({"type": "inference_request", "request_id": "tampered-1", "encrypted_body": {
        "ephemeral_public_key": key, "ciphertext": "A" * 200}})
    big = json.dumps({"type": "inference_request", "request_id": "big-1", "encrypted_body": {
        "ephemeral_public_key": key, "ciphertext": "QUJD" * (6 * 1024 * 1024)}})  # 24 MiB: within our limit
    for frame in ("not json", b"\x00\xff binary", '{"type":"from_the_future","x":1}', "[]", '{"type":42}',
                  '{"type":"cancel","request_id":"nobody"}', '{"type":"inference_request"}', tampered, big,
                  '{"type":"runtime_status","verified":false,"mismatches":[{"component":"runtime"}]}'):
        await double.send_raw(view, frame)
    await double.wait_for(lambda e: isinstance(e, FrameReceived) and getattr(e.message, "request_id", "") == "big-1",
                          timeout=20)
    errors = {e.message.request_id: e.message for e in double.events.of(FrameReceived)
              if e.message.type == "inference_error"}
    assert errors["tampered-1"].status_code == 400 and errors["big-1"].status_code == 400
    assert errors["tampered-1"].failure_code == "invalid_request"
    assert provider.agent.session.counters.connection_losses == 0 and double.provider(view).connected

    # Over the 32 MiB inbound limit: the socket closes (1009) and the provider comes back by itself.
    await double.send_raw(view, "x" * (34 * 1024 * 1024))
    await double.wait_for(lambda e: isinstance(e, Disconnected), timeout=10)
    await double.wait_routable(model="tiny", timeout=15)
    assert provider.agent.session.counters.registrations == 2
    async with consumer_for(double) as consumer:
        completion = await consumer.chat.completions.create(model="tiny", messages=chat_messages(), max_tokens=2)
    assert completion.usage.completion_tokens == 2
    assert no_request_reservations(provider.agent.ledger)




async def test_a_replayed_request_is_answered_400_and_not_run_again(coordinator_double, start_agent):
    """A finished request's frame sent again is answered with one 400 and not run again."""
    double = coordinator_double
    provider = await start_agent(double.ws_url)
    (view,) = await double.wait_routable(model="tiny", timeout=15)
    frame = sealed_request(view.public_key, "replayed-1", {"model": "tiny", "messages": chat_messages(),
                                                           "max_tokens": 3})
    await double.send_raw(view, frame)
    await double.wait_for(lambda e: isinstance(e, FrameReceived) and e.message.type == "inference_complete"
                          and e.message.request_id == "replayed-1", timeout=20)
    served = provider.agent.stats.requests_served
    mark = double.mark()
    await double.send_raw(view, frame)  # the very same frame again
    error = await double.wait_for(lambda e: isinstance(e, FrameReceived) and e.message.type == "inference_error",
                                  since=mark, timeout=10)
    assert (error.message.request_id, error.message.status_code, error.message.failure_code) == \
        ("replayed-1", 400, "invalid_request")
    types = await frames_for(double, "replayed-1")
    assert types.count("inference_accepted") == 1 and types.count("inference_complete") == 1
    assert types[-2:] == ["inference_complete", "inference_error"]
    assert provider.agent.stats.requests_served == served


async def test_prompt_text_never_reaches_the_logs(coordinator_double, openai_consumer, start_agent):
    double = coordinator_double
    await start_agent(double.ws_url)
    await double.wait_routable(model="tiny", timeout=15)
    canary = "CANARY-e2e-91c4-PRIVATE"
    with capture_redacted_logs() as logs:
        with pytest.raises(openai.BadRequestError):  # longer than the context: 400, not retried
            await openai_consumer.chat.completions.create(
                model="tiny", messages=chat_messages(f"{canary} " * 2500), max_tokens=4)
        completion = await openai_consumer.chat.completions.create(
            model="tiny", messages=chat_messages(canary), max_tokens=4, stop=[canary])
    assert completion.usage.completion_tokens >= 1
    assert logs and canary not in json.dumps(logs, default=str)


# --- drain on SIGTERM, as a real process -------------------------------------------------------------------


async def test_sigterm_drains_the_job_in_flight_then_exits_0(coordinator_double, tiny_model_path, tmp_path):
    double = coordinator_double
    process = await agent_process(double.ws_url, tiny_model_path, tmp_path, DARKBLOOM_DRAIN_TIMEOUT_S="30")
    try:
        await double.wait_routable(model="tiny", timeout=60)
        async with consumer_for(double) as consumer:
            stream = await consumer.chat.completions.create(
                model="tiny", messages=chat_messages("drain test"), max_tokens=1200, temperature=0, stream=True)
            await double.wait_for(lambda e: isinstance(e, ChunkReceived), timeout=10)
            process.send_signal(signal.SIGTERM)
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        code = await asyncio.wait_for(process.wait(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    log_lines = (await process.stderr.read()).decode(errors="replace").splitlines()
    events = [json.loads(line).get("event") for line in log_lines if line.startswith("{")]
    assert code == 0, log_lines[-20:]
    assert "stop_signal" in events and "drained" in events and "drain_timeout" not in events
    assert "drain_acked" in events and "drain_ack_missing" not in events
    completed = double.events.of(Completed)
    assert len(completed) == 1 and completed[0].usage.completion_tokens == 1200 and "".join(parts)
    disconnected = await double.wait_for(lambda e: isinstance(e, Disconnected), timeout=10)
    assert disconnected.close_code == 1000
    # The barrier goes out behind the terminal frame, and is acknowledged before the close.
    (barrier,), (ack,) = double.events.of(DrainBarrier), double.events.of(DrainAckSent)
    assert completed[0].at <= barrier.at <= ack.at <= disconnected.at and ack.request_id == barrier.request_id
    assert ack.delivered
    assert double.anomalies() == []


async def test_a_drain_that_runs_out_ends_every_accepted_request_with_its_terminal(coordinator_double,
                                                                                   tiny_model_path, tmp_path):
    """SIGTERM with two long streams (the double's [A] concurrency for an 8 GB machine)
    and ``drain_timeout_s = 2``. When the drain runs
    out, each accepted request still gets exactly one terminal frame (503 ``draining``: nothing more
    will come) before the socket closes with 1000; the consumers see their streams fail, not hang."""
    double = coordinator_double
    process = await agent_process(double.ws_url, tiny_model_path, tmp_path, DARKBLOOM_DRAIN_TIMEOUT_S="2",
                                  DARKBLOOM_LOCAL_ENABLED="false")

    async def consume(consumer: openai.AsyncOpenAI, n: int) -> BaseException | None:
        stream = await consumer.chat.completions.create(
            model="tiny", messages=chat_messages(f"long drain {n}"), max_tokens=1900, temperature=0, stream=True)
        try:
            async for _ in stream:
                pass
        except (openai.APIError, httpx.HTTPError) as exc:
            return exc
        return None

    try:
        await double.wait_routable(model="tiny", timeout=60)
        async with consumer_for(double) as consumer:
            streams = [asyncio.create_task(consume(consumer, n)) for n in range(2)]
            await double.wait_for(lambda e: len({c.request_id for c in double.events.of(ChunkReceived)}) == 2,
                                  timeout=30)
            process.send_signal(signal.SIGTERM)
            ends = await asyncio.wait_for(asyncio.gather(*streams), 30)
        code = await asyncio.wait_for(process.wait(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert code == 0
    disconnected = await double.wait_for(lambda e: isinstance(e, Disconnected), timeout=10)
    assert disconnected.close_code == 1000
    accepted = [e.request_id for e in double.events.of(Accepted)]
    assert len(accepted) == 2
    for rid in accepted:
        terminals = [e for e in double.events.of(FrameReceived)
                     if getattr(e.message, "request_id", None) == rid
                     and e.message.type in ("inference_complete", "inference_error")]
        assert len(terminals) == 1, (rid, terminals)
        assert terminals[0].at < disconnected.at
        assert terminals[0].message.type == "inference_error"
        assert (terminals[0].message.status_code, terminals[0].message.error_reason) == (503, "draining")
        assert terminals[0].at <= double.events.of(DrainBarrier)[0].at  # the barrier comes after every terminal
    (barrier,), (ack,) = double.events.of(DrainBarrier), double.events.of(DrainAckSent)
    assert barrier.at <= ack.at <= disconnected.at and ack.request_id == barrier.request_id
    assert all(isinstance(end, BaseException) for end in ends)  # each consumer sees its stream fail
    assert double.anomalies() == []


async def test_an_agent_stopped_past_the_eviction_window_registers_afresh(tiny_model_path, tmp_path):
    """``kill -STOP`` until the coordinator has evicted the provider, then ``kill -CONT``:
    the socket is still open and heartbeats would be ignored for good, so the agent must notice the gap
    between its heartbeats and come back with a fresh ``register``. The window is shortened to 2 s on both
    sides (the [A] coordinator and the agent's default: 90 s)."""
    config = quick_config(eviction_timeout=2.0, eviction_sweep_interval=0.25)
    async with CoordinatorDouble(config) as double:
        process = await agent_process(double.ws_url, tiny_model_path, tmp_path, DARKBLOOM_EVICTION_WINDOW_S="2",
                                      DARKBLOOM_LOCAL_ENABLED="false")
        try:
            (first,) = await double.wait_routable(model="tiny", timeout=60)
            mark = double.mark()
            process.send_signal(signal.SIGSTOP)
            await double.wait_for(lambda e: isinstance(e, Evicted) and e.provider_id == first.provider_id,
                                  since=mark, timeout=10)
            assert double.routable() == [] and double.provider(first).connected  # forgotten, socket open
            process.send_signal(signal.SIGCONT)
            fresh = await double.wait_for(lambda e: isinstance(e, Registered), since=mark, timeout=15)
            assert fresh.provider_id != first.provider_id and not fresh.reregister  # a new socket, a new register
            await double.wait_for(lambda e: isinstance(e, Disconnected) and e.provider_id == first.provider_id,
                                  since=mark, timeout=10)
            await double.wait_routable(model="tiny", timeout=15)
            async with consumer_for(double) as consumer:
                completion = await consumer.chat.completions.create(model="tiny", messages=chat_messages(),
                                                                    max_tokens=2)
            assert completion.usage.completion_tokens == 2
            process.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(process.wait(), 60)
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
                await process.wait()
        log_lines = (await process.stderr.read()).decode(errors="replace").splitlines()
        events = [json.loads(line) for line in log_lines if line.startswith("{")]
        assert code == 0, log_lines[-20:]
        stalls = [e for e in events if e.get("event") == "stall_detected"]
        assert len(stalls) == 1 and stalls[0]["gap_s"] > 2.0 and stalls[0]["window_s"] == 2.0
        assert double.anomalies() == []


async def test_the_running_agent_answers_status_and_metrics_on_loopback(coordinator_double, openai_consumer,
                                                                        start_agent):
    """`darkbloom-provider status` reads this endpoint: it must show what the agent is doing."""
    from prometheus_client.parser import text_string_to_metric_families

    from provider.demo import free_port

    port = free_port()
    double = coordinator_double
    await start_agent(double.ws_url, local_port=port)
    await double.wait_routable(model="tiny", timeout=15)
    await openai_consumer.chat.completions.create(model="tiny", messages=chat_messages(), max_tokens=4)

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        assert (await http.get("/healthz")).status_code == 200
        status = (await http.get("/status")).json()
        metrics = (await http.get("/metrics")).text
        assert (await http.post("/v1/chat/completions", json={})).status_code == 404  # no chat beside a session
    assert status["mode"] == "coordinator"
    assert [(m["id"], m["state"]) for m in status["models"]] == [("tiny", "loaded")]
    assert status["ledger"]["bytes_by_kind"]["request_kv"] == 0
    assert status["prefix_cache"]["misses"] >= 1
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    assert "darkbloom_ledger_bytes" in families and "darkbloom_cap_bytes" in families
