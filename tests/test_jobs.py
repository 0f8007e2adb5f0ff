"""One inference_request end to end through a real engine and model manager (no socket).

The coordinator side is played by a session key pair: it seals the request and opens each chunk, as
the Go coordinator does.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest

from job_harness import Harness, chat, sse_json
from memory import ReservationKind
from provider.engine import ChatRequest, Engine, SamplingParams
from provider.jobs import JobOutcome, JobState, run_job
from provider.jobs.job import Job
from provider.session.connection import DRAIN_EXPIRED
from provider.telemetry import capture_redacted_logs
from settings_for import settings_for
from vectors import load as load_vector
from vision_images import data_uri, png_bytes


@pytest.fixture
async def harness(tiny_model_path, tmp_path):
    engine = Engine()
    h = Harness(settings_for(tmp_path, {"tiny": tiny_model_path}), engine)
    yield h
    await h.manager.unload_all()
    await engine.aclose()
    assert len(h.ledger) == 0  # every reservation released, on every path


async def test_stream_matches_the_engine_and_usage_is_exact(harness):
    assert await harness.run(harness.coordinator.request("r1", chat(max_tokens=6))) is JobOutcome.COMPLETED
    frames = harness.of("r1")
    kinds = [f["type"] for f in frames]
    assert kinds[0] == "inference_accepted" and kinds[-1] == "inference_complete"
    assert set(kinds[1:-1]) == {"inference_response_chunk"}
    events = harness.events("r1")
    assert b"[DONE]" not in b"".join(events)  # the coordinator ends the consumer's stream itself
    chunks = [sse_json(e) for e in events]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny" for c in chunks)
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["delta"] == {}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    usage = frames[-1]["usage"]
    assert usage["completion_tokens"] == 6 and final["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert final["usage"]["completion_tokens"] == 6

    # The engine alone, same request: same text, same prompt count.
    stream = harness.engine.submit("tiny", ChatRequest("direct", chat()["messages"], SamplingParams(max_tokens=6,
                                                                                                   temperature=0)))
    direct, finished = await stream.collect()
    assert text == direct and finished.usage.prompt_tokens == usage["prompt_tokens"]
    assert harness.stats.requests_served == 1 and harness.stats.tokens_generated == 6
    assert not harness.stats.serving


async def test_accept_goes_out_before_the_model_loads(harness):
    sent_before_load: list[str] = []
    original = harness.engine.load

    async def watching_load(*args, **kwargs):
        sent_before_load.extend(f["type"] for f in harness.frames)
        return await original(*args, **kwargs)

    harness.engine.load = watching_load
    assert await harness.run(harness.coordinator.request("cold", chat())) is JobOutcome.COMPLETED
    assert sent_before_load == ["inference_accepted"]


@pytest.mark.parametrize("mutate, status, code", [
    (lambda c, r: r.model_copy(update={"encrypted_body": None}), 400, "invalid_request"),
    (lambda c, r: r.model_copy(update={"encrypted_body": r.encrypted_body.model_copy(
        update={"ciphertext": _flip(r.encrypted_body.ciphertext)})}), 400, "invalid_request"),
    (lambda c, r: r.model_copy(update={"encrypted_body": r.encrypted_body.model_copy(
        update={"ephemeral_public_key": "not-a-key"})}), 400, "invalid_request"),
    (lambda c, r: r.model_copy(update={"encrypted_body": r.encrypted_body.model_copy(
        update={"ephemeral_public_key": base64.b64encode(bytes(32)).decode()})}), 400, "invalid_request"),
    (lambda c, r: c.request("bad", b"{not json"), 400, "invalid_request"),
    (lambda c, r: c.request("bad", {"messages": []}), 400, "invalid_request"),
    (lambda c, r: c.request("bad", {**chat(), "messages": [{"role": "user"}]}), 400, "invalid_request"),
    (lambda c, r: c.request("bad", {**chat(), "messages": [{"role": "wizard", "content": "hi"}]}), 400,
     "invalid_request"),
    (lambda c, r: c.request("bad", {**chat(), "endpoint": "/v1/completions"}), 400, "invalid_request"),
    (lambda c, r: c.request("bad", chat(model="someone-elses-model") | {"model": "other"}), 404, "model_unavailable"),
    (lambda c, r: c.request("bad", chat(content="word " * 3000)), 400, "invalid_request"),  # > context 2048
    (lambda c, r: c.request("bad", chat(content=[  # an image for a text model
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": data_uri(png_bytes(8, 8))}}])), 415, "unsupported_media"),
])
async def test_fast_rejects_have_no_accept(harness, mutate, status, code):
    request = mutate(harness.coordinator, harness.coordinator.request("bad", chat()))
    assert await harness.run(request) is JobOutcome.REJECTED
    (frame,) = harness.of("bad")
    assert frame["type"] == "inference_error" and frame["status_code"] == status and frame["failure_code"] == code


async def test_an_unexpected_failure_before_the_accept_still_gets_exactly_one_answer(harness, monkeypatch):
    """Whatever goes wrong, a request whose id is known is answered once (500, no accept)."""
    async def broken_count(*args, **kwargs):
        raise RuntimeError("a bug somewhere below the job")

    monkeypatch.setattr(harness.ctx.counter, "prompt_ids", broken_count)
    with capture_redacted_logs() as logs:
        assert await harness.run(harness.coordinator.request("oops", chat())) is JobOutcome.REJECTED
    (frame,) = harness.of("oops")
    assert (frame["type"], frame["status_code"], frame["failure_code"]) == ("inference_error", 500,
                                                                           "internal_failure")
    assert any(e["event"] == "job_crashed" and e.get("exc_type") == "RuntimeError" for e in logs)


def _flip(ciphertext: str) -> str:
    raw = bytearray(base64.b64decode(ciphertext))
    raw[-1] ^= 1
    return base64.b64encode(bytes(raw)).decode()


async def test_endpoint_chat_completions_and_unknown_keys_are_fine(harness):
    body = {**chat(), "endpoint": "/v1/chat/completions", "provider_serial": "x", "tool_schema_metadata_protocol": 1}
    assert await harness.run(harness.coordinator.request("ok", body)) is JobOutcome.COMPLETED


async def test_a_model_that_can_never_fit_is_refused_with_503_and_no_accept(tiny_model_path, tmp_path):
    engine = Engine()
    try:
        h = Harness(settings_for(tmp_path, {"tiny": tiny_model_path}, memory_limit_gb=3.0), engine)
        assert await h.run(h.coordinator.request("full", chat())) is JobOutcome.REJECTED
        (frame,) = h.of("full")
        assert frame["status_code"] == 503 and frame["failure_code"] == "capacity"
        assert frame["rejection_reason"] == "memory_cap"
    finally:
        await engine.aclose()


async def test_draining_manager_refuses_with_503_draining(harness):
    harness.manager.start_draining()
    assert await harness.run(harness.coordinator.request("late", chat())) is JobOutcome.REJECTED
    (frame,) = harness.of("late")
    assert (frame["status_code"], frame["error_reason"]) == (503, "draining")


async def test_cancel_mid_stream_sends_nothing_more_and_releases_the_reservation(harness):
    first_content = asyncio.Event()

    def send(text: str) -> None:
        harness.send(text)
        if len(harness.of("c1")) >= 3:  # accepted, role, one content chunk
            first_content.set()

    job = Job(harness.coordinator.request("c1", chat(max_tokens=400)), harness.ctx, send)
    task = asyncio.create_task(job.run())
    await first_content.wait()
    assert harness.ledger.snapshot().count_by_kind[ReservationKind.REQUEST_KV] == 1  # c1's KV is reserved
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert job.state is JobState.CANCELLED
    count = len(harness.of("c1"))
    assert all(f["type"] != "inference_complete" and f["type"] != "inference_error" for f in harness.of("c1"))
    assert harness.stats.cancellations_received == 1 and not harness.stats.serving
    # The engine stopped this request: a later request runs alone and nothing more arrives for c1.
    assert await harness.run(harness.coordinator.request("after", chat())) is JobOutcome.COMPLETED
    assert len(harness.of("c1")) == count
    assert harness.ledger.snapshot().count_by_kind[ReservationKind.REQUEST_KV] == 0


async def test_cancel_while_waiting_for_the_load(harness):
    accepted = asyncio.Event()

    def send(text: str) -> None:
        harness.send(text)
        accepted.set()

    task = asyncio.create_task(run_job(harness.coordinator.request("w1", chat()), harness.ctx, send))
    await accepted.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [f["type"] for f in harness.of("w1")] == ["inference_accepted"]
    assert harness.stats.cancellations_before_output == 1


@pytest.mark.parametrize("phase", ["waiting_for_the_load", "streaming"])
async def test_a_drain_that_runs_out_ends_the_job_with_503_draining(harness, phase):
    """The connection cancels a job the drain ran out on with ``DRAIN_EXPIRED``; unlike a
    coordinator's cancel, the request then gets its one terminal frame (and the reservation goes back)."""
    reached = asyncio.Event()
    wanted = 1 if phase == "waiting_for_the_load" else 3  # the accept alone, or accept + chunks

    def send(text: str) -> None:
        harness.send(text)
        if len(harness.of("d1")) >= wanted:
            reached.set()

    task = asyncio.create_task(run_job(harness.coordinator.request("d1", chat(max_tokens=1900)), harness.ctx, send))
    await reached.wait()
    task.cancel(DRAIN_EXPIRED)
    assert await task is JobOutcome.FAILED and not task.cancelled()
    frames = harness.of("d1")
    assert frames[0]["type"] == "inference_accepted" and [f["type"] for f in frames].count("inference_error") == 1
    assert frames[-1]["type"] == "inference_error"
    assert (frames[-1]["status_code"], frames[-1]["error_reason"]) == (503, "draining")
    # The engine frees the sequence on its thread, then the KV lease goes back (no event to wait on).
    deadline = time.monotonic() + 10
    while harness.ledger.snapshot().count_by_kind[ReservationKind.REQUEST_KV]:
        assert time.monotonic() < deadline, "the drained request's KV was never released"
        await asyncio.sleep(0.01)


async def test_concurrent_jobs_each_get_their_own_box_and_stream(harness):
    outcomes = await asyncio.gather(*(harness.run(harness.coordinator.request(f"p{i}", chat(f"prompt {i}", 5)))
                                      for i in range(4)))
    assert outcomes == [JobOutcome.COMPLETED] * 4
    for i in range(4):
        frames = harness.of(f"p{i}")
        assert frames[-1]["type"] == "inference_complete" and frames[-1]["usage"]["completion_tokens"] == 5
        assert sse_json(harness.events(f"p{i}")[-1])["choices"][0]["finish_reason"] == "length"


async def test_a_completed_job_leaves_one_served_line_with_its_numbers(harness):
    """One info line per request: model, tokens, TTFT, tok/s, outcome (never text)."""
    with capture_redacted_logs() as logs:
        assert await harness.run(harness.coordinator.request("n1", chat(max_tokens=6))) is JobOutcome.COMPLETED
    (line,) = [e for e in logs if e["event"] == "request_completed"]
    usage = harness.of("n1")[-1]["usage"]
    assert line["log_level"] == "info" and line["model"] == "tiny" and line["outcome"] == "completed"
    assert (line["prompt_tokens"], line["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert 0 < line["ttft_ms"] <= line["duration_s"] * 1000 and line["tokens_per_s"] >= 0
    # The time to first output split where it went (from the frame's receipt).
    parts = [line[k] for k in ("to_engine_ms", "engine_queue_ms", "prefill_ms", "to_client_ms")]
    assert min(parts) >= 0 and line["prefill_ms"] > 0 and sum(parts) == pytest.approx(line["ttft_ms"], abs=0.05)


async def test_no_prompt_text_or_consumer_strings_in_logs(harness):
    canary = "CANARY-7f3a9-SECRET"
    with capture_redacted_logs() as logs:
        await harness.run(harness.coordinator.request("k1", chat(content=f"{canary} " * 3000)))  # exceeds context
        await harness.run(harness.coordinator.request("k2", {**chat(content=canary), "model": canary}))
        await harness.run(harness.coordinator.request("k3", chat(content=canary, max_tokens=3)))
    assert [f["type"] for f in harness.of("k1")] == ["inference_error"]
    assert harness.of("k3")[-1]["type"] == "inference_complete"
    assert logs and canary not in json.dumps(logs, default=str)


async def test_the_coordinator_path_refuses_what_it_cannot_honour_and_logs_only_the_name(harness):
    """Strict types and unsupported parameters on the coordinator's front door: the same validator (strict
    JSON types, the parameters table): a terminal 400 before any accept (the coordinator stops at once),
    the parameter's name in the log, never its value."""
    canary = "CANARY-7f3a9-SECRET"
    bad = {"p1": {"temperature": canary}, "p2": {"top_k": canary}, "p3": {"n": 2},
           "p4": {"presence_penalty": 0.7}, "p5": {"response_format": {"type": canary}}, "p6": {"stream": canary}}
    with capture_redacted_logs() as logs:
        for rid, extra in bad.items():
            assert await harness.run(harness.coordinator.request(rid, {**chat(content=canary), **extra})) \
                is JobOutcome.REJECTED
            (frame,) = harness.of(rid)
            assert (frame["status_code"], frame["failure_code"]) == (400, "invalid_request")
    refused = [e for e in logs if e.get("event") == "request_refused" and e.get("reason") == "invalid_body"]
    assert [e["kind"] for e in refused] == ["temperature", "top_k", "n", "presence_penalty", "response_format.type",
                                            "stream"]
    assert canary not in json.dumps(logs, default=str)


# --- heartbeat and register built from the same manager -------------------------------------------------


async def test_heartbeat_reflects_the_manager_and_jobs(harness):
    from protocol import decode, encode
    from provider.session.heartbeat import HeartbeatSource

    source = HeartbeatSource(stats=harness.stats, capacity=harness.manager.capacity, cpu_percent=lambda: 250.0)
    idle = json.loads(encode(source()))
    assert idle["status"] == "idle" and idle["active_model"] is None and idle["backend_capacity"]["slots"] == []
    assert idle["system_metrics"]["cpu_usage"] == 1.0 and 0 <= idle["system_metrics"]["memory_pressure"] <= 1
    assert idle["backend_capacity"]["total_memory_gb"] == 8.0

    seen: list[dict] = []

    def send(text: str) -> None:
        harness.send(text)
        if harness.of("hb")[-1]["type"] == "inference_response_chunk" and not seen:
            seen.append(json.loads(encode(source())))  # mid-stream

    await run_job(harness.coordinator.request("hb", chat(max_tokens=4)), harness.ctx, send)
    serving = seen[0]
    assert serving["status"] == "serving" and serving["active_model"] == "tiny"
    (slot,) = serving["backend_capacity"]["slots"]
    assert slot["model"] == "tiny" and slot["state"] == "running" and slot["kv_bytes_per_token"] > 0
    assert slot["active_token_budget_used"] > 0 and slot["max_concurrency"] >= 1
    after = json.loads(encode(source()))
    assert after["status"] == "idle" and after["warm_models"] == ["tiny"]
    assert after["stats"] == {"requests_served": 1, "tokens_generated": 4}
    for key in ("gpu_memory_active_gb", "gpu_memory_peak_gb", "gpu_memory_cache_gb", "total_memory_gb",
                "free_for_load_gb"):
        assert isinstance(after["backend_capacity"][key], float)
    assert after["backend_capacity"]["gpu_memory_active_gb"] > 0
    decode(encode(source()))  # what we send decodes as a heartbeat


async def test_register_advertises_only_models_that_can_ever_load(harness, tiny_model_path, tmp_path):
    from provider.session.register import advertised_models

    (model,) = advertised_models(harness.manager.verdicts(), {"tiny": "ab" * 32})
    assert model.id == "tiny" and model.fit_verdict == "fits_now" and model.weight_hash == "ab" * 32
    assert type(model.size_bytes) is int and model.size_bytes > 0 and model.required_memory_gb > 0
    engine = Engine()
    try:
        small = Harness(settings_for(tmp_path / "small", {"tiny": tiny_model_path}, memory_limit_gb=3.0), engine)
        assert advertised_models(small.manager.verdicts()) == ()
    finally:
        await engine.aclose()



# --- the official coordinator -> provider fixtures through the core and the jobs ------------------------------



async def test_every_official_coordinator_fixture_is_survived(harness):
    """Each [N] fixture plus an invented type goes through a session core; the
    requests it starts (plaintext fixture, placeholder keys) are answered with one 400 and no accept."""
    from protocol import CpuCores, Hardware, Register
    from provider.session.core import CancelJob, Log, ModelDirective, Note, Send, SessionCore, StartJob

    cases = load_vector("coordinator_to_provider.json")["cases"]
    hw = Hardware(machine_model="", chip_name="", chip_family="", chip_tier="", memory_gb=0, memory_available_gb=0.0,
                  cpu_cores=CpuCores(total=0, performance=0, efficiency=0), gpu_cores=0, memory_bandwidth_gbs=0.0)
    core = SessionCore(register=Register(hardware=hw, models=(), backend="inprocess-mlx"),
                       answer_challenge=lambda c: __import__("protocol").AttestationResponse(
                           nonce=c.nonce, signature="c2ln", public_key=harness.identity.public_key_b64))
    core.connection_made()
    started = []
    for wire in [case["wire"] for case in cases] + ['{"type":"from_the_future","x":[1,2,3]}']:
        for action in core.receive_text(wire):
            assert isinstance(action, Send | StartJob | CancelJob | Log | Note | ModelDirective)
            if isinstance(action, StartJob):
                started.append(action.request)
    # Both request fixtures use request-a: the second arrives while the first is running and is ignored.
    assert sum(case["message_type"] == "inference_request" for case in cases) == 2 and len(started) == 1
    for n, request in enumerate(started):
        request = request.model_copy(update={"request_id": f"fixture-{n}"})
        assert await harness.run(request) is JobOutcome.REJECTED
        (frame,) = harness.of(f"fixture-{n}")
        assert (frame["type"], frame["status_code"], frame["failure_code"]) == ("inference_error", 400,
                                                                                "invalid_request")


# --- first_content_budget_ms and mid-stream failures -------------------------------------------------------


async def test_first_content_budget_spent_before_admission_refuses_without_accept(harness):
    readings = iter([100.0])  # frame receipt at t=100 s, every later reading at t=105 s

    harness.ctx.monotonic = lambda: next(readings, 105.0)
    request = harness.coordinator.request("late", chat()).model_copy(update={"first_content_budget_ms": 1000})
    assert await harness.run(request) is JobOutcome.REJECTED
    (frame,) = harness.of("late")
    assert (frame["status_code"], frame["error_reason"], frame["rejection_reason"]) == \
        (503, "deadline_unreachable", "deadline")


async def test_no_content_within_the_budget_fails_before_output(harness):
    loading = asyncio.Event()
    original = harness.engine.load

    async def slow_load(*args, **kwargs):
        loading.set()
        await asyncio.sleep(0.5)  # a real delay: the model takes longer to load than the budget allows
        return await original(*args, **kwargs)

    harness.engine.load = slow_load
    # Warm the tokenizer first, as the runtime does at start: the 100 ms budget must measure the load,
    # not the tokenizer's first read (which alone can take longer than that on a loaded machine).
    await harness.ctx.counter.warm(["tiny"])
    request = harness.coordinator.request("slow", chat()).model_copy(update={"first_content_budget_ms": 100})
    assert await harness.run(request) is JobOutcome.FAILED
    assert [f["type"] for f in harness.of("slow")] == ["inference_accepted", "inference_error"]
    assert harness.of("slow")[-1]["error_reason"] == "deadline_unreachable"
    ok = harness.coordinator.request("fast", chat()).model_copy(update={"first_content_budget_ms": 60_000})
    assert await harness.run(ok) is JobOutcome.COMPLETED  # a met budget changes nothing


async def test_an_error_after_the_first_chunk_ends_the_stream_with_one_error(tiny_model_path, tmp_path):
    engine = Engine()
    h = Harness(settings_for(tmp_path, {"tiny": tiny_model_path}), engine)
    streaming = asyncio.Event()

    def send(text: str) -> None:
        h.send(text)
        if len(h.of("mid")) >= 3:
            streaming.set()

    task = asyncio.create_task(run_job(h.coordinator.request("mid", chat(max_tokens=1900)), h.ctx, send))
    await streaming.wait()
    await engine.unload("tiny")  # the model goes away under the running request
    assert await task is JobOutcome.FAILED
    types = [f["type"] for f in h.of("mid")]
    assert types[0] == "inference_accepted" and types[-1] == "inference_error"
    assert types.count("inference_error") == 1 and "inference_complete" not in types
    assert set(types[1:-1]) == {"inference_response_chunk"} and len(types) >= 4
    assert h.stats.generation_errors_after_output == 1
    # the engine released the KV reservation with the failed request
    assert h.ledger.snapshot().count_by_kind[ReservationKind.REQUEST_KV] == 0
    await engine.aclose()


async def test_a_misspelt_parameter_is_refused_before_the_accept_and_a_vendors_field_is_named_in_the_log(harness):
    """`max_token` would otherwise run to the default max_tokens: a 400 (the closed invalid_request text)
    before any accept; another vendor's field is served, named (never its value) in the request log."""
    canary = "CANARY-vendor-7d1"
    body = {k: v for k, v in chat().items() if k != "max_tokens"}
    with capture_redacted_logs() as logs:
        typo = await harness.run(harness.coordinator.request("t1", {**body, "max_token": 3}))
        vendor = await harness.run(harness.coordinator.request("t2", chat(cache_prompt=canary, top_n=2)))
    assert typo is JobOutcome.REJECTED and vendor is JobOutcome.COMPLETED
    (frame,) = harness.of("t1")
    assert (frame["type"], frame["status_code"], frame["failure_code"]) == ("inference_error", 400, "invalid_request")
    assert any(e["event"] == "request_refused" and e.get("kind") == "max_token" for e in logs)
    [warning] = [e for e in logs if e["event"] == "request_unknown_fields"]
    assert warning["kind"] == ["cache_prompt", "top_n"] and warning["request_id"] == "t2"
    assert canary not in json.dumps(logs, default=str) and canary not in json.dumps(harness.frames)
