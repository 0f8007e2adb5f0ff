"""`serve --local` on SIGTERM / Ctrl-C, as a real process.

The owner's server drains like the agent: it keeps listening (new requests and `/healthz` get 503
`draining`, never a refused connection), lets running requests finish for `drain_timeout_s`, ends every
stream still running then with an error event and `[DONE]` (a client's SDK sees an error, not a cut
connection), logs one line that says how many requests are draining, for how long, and that a second
Ctrl-C stops at once, and exits 0. A second SIGINT stops it now.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from local_server import MODEL, start_server
from protocol.errors import Failure
from provider.local.backend import Refused
from provider.local.drain import InFlight

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 1900,
        "temperature": 0, "stream": True}


async def _stream(client: httpx.AsyncClient, url: str, started: asyncio.Event, body: dict = LONG) -> list[str]:
    """The SSE `data:` payloads of one streamed request; sets `started` at the first content."""
    events: list[str] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if len(events) >= 2:
                    started.set()
    return events


def _log_events(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


async def test_sigterm_keeps_listening_while_draining_and_ends_every_stream_with_an_error_event(
        tmp_path, tiny_model_path):
    srv = start_server(tmp_path, tiny_model_path, "--drain-timeout-s", "2")
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            started = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.create_task(_stream(client, srv.base_url, s)) for s in started]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
            srv.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # Draining: still listening, and saying so.
            health = await _until_draining(client, srv.base_url + "/healthz")
            assert health.status_code == 503 and health.json() == {"status": "draining"}
            refused = await client.post(srv.base_url + "/v1/chat/completions", json={**LONG, "stream": False})
            assert refused.status_code == 503 and refused.json()["error"]["reason"] == "draining"
            assert int(refused.headers["retry-after"]) > 0
            ends = await asyncio.wait_for(asyncio.gather(*streams), 30)
            ended_after = time.monotonic() - signalled
        code = srv.proc.wait(timeout=30)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    log = srv.log_path.read_text()
    assert code == 0
    for events in ends:
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert (error["code"], error["reason"]) == ("capacity", "draining")
        assert len(events) > 3  # content came first: the drain cut a running stream
    assert ended_after >= 1.5  # the streams had their drain time before they were ended
    events = _log_events(log)
    draining = [e for e in events if e["event"] == "local_server_draining"]
    assert len(draining) == 1
    assert draining[0]["in_flight"] == 2 and draining[0]["timeout_s"] == 2
    assert "ctrl-c" in draining[0]["hint"].lower()
    assert not [e for e in events if e["level"] in ("error", "critical")], log


async def test_a_second_ctrl_c_stops_now(tmp_path, tiny_model_path):
    srv = start_server(tmp_path, tiny_model_path, "--drain-timeout-s", "120")
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            started = asyncio.Event()
            stream = asyncio.create_task(_stream(client, srv.base_url, started))
            await asyncio.wait_for(started.wait(), 60)
            srv.proc.send_signal(signal.SIGINT)
            await _until_draining(client, srv.base_url + "/healthz")
            srv.proc.send_signal(signal.SIGINT)
            stopped = time.monotonic()
            code = await asyncio.to_thread(srv.proc.wait, 30)
            assert time.monotonic() - stopped < 20  # not the 120 s drain
            await asyncio.gather(stream, return_exceptions=True)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert code == 0
    assert any(e["event"] == "local_server_stopping_now" for e in _log_events(srv.log_path.read_text()))


async def _until_draining(client: httpx.AsyncClient, url: str) -> httpx.Response:
    """`/healthz` once the signal has reached the server (it turns 503 at the first signal). A refused
    connection fails the test: the listener must stay open while draining."""
    deadline = time.monotonic() + 10
    while True:
        response = await client.get(url)
        if response.status_code == 503 or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.05)  # the signal crosses processes: no event to wait on


def test_every_served_request_leaves_one_info_line_with_its_numbers_and_never_its_text(tmp_path, tiny_model_path):
    """As `mlx_lm.server` and Ollama give: one info line per request with the model, the
    prompt and completion tokens, TTFT, tok/s and the outcome; never text."""
    canary = "CANARY-served-line-4c1d"
    srv = start_server(tmp_path, tiny_model_path)
    try:
        client = srv.client()
        ask = {"model": MODEL, "messages": [{"role": "user", "content": canary}], "max_tokens": 12, "temperature": 0}
        whole = client.chat.completions.create(**ask)
        chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        memory = httpx.get(srv.base_url + "/status").json()["memory"]  # which memory it is
        assert memory["device_memory"] == "unified" and memory["host_physical_bytes"] is None
    finally:
        code, log = srv.stop()
    assert code == 0 and canary not in log
    lines = [e for e in _log_events(log) if e["event"] == "request_completed"]
    assert len(lines) == 2
    for line, usage in zip(lines, (whole.usage, chunks[-1].usage), strict=True):
        assert line["level"] == "info" and line["model"] == MODEL and line["outcome"] == "completed"
        assert (line["prompt_tokens"], line["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
        assert 0 < line["ttft_ms"] <= line["duration_s"] * 1000
        # The time to first output split where it went; the four parts add up to it.
        parts = [line[k] for k in ("to_engine_ms", "engine_queue_ms", "prefill_ms", "to_client_ms")]
        assert min(parts) >= 0 and line["prefill_ms"] > 0
        assert sum(parts) == pytest.approx(line["ttft_ms"], abs=0.05)
        assert line["request_id"] and (line["tokens_per_s"] > 0) == (usage.completion_tokens > 1)


async def test_the_owners_server_queues_a_request_for_a_full_batch_then_refuses_when_the_wait_runs_out(
        tmp_path, tiny_model_path):
    """With the batch full (max_batch_size 1), a second request waits for the first to end
    and is served, as `mlx_lm.server` queues (a chat's next turn must not get a 503); the wait is bounded
    (`local_queue_s`), after which the 503 stands."""
    srv = start_server(tmp_path, tiny_model_path, "--max-batch-size", "1", "--local-queue-s", "60")
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            started = asyncio.Event()
            long = asyncio.create_task(_stream(client, srv.base_url, started, {**LONG, "max_tokens": 150}))
            await asyncio.wait_for(started.wait(), 60)
            short = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            answer = await client.post(srv.base_url + "/v1/chat/completions", json=short)
            assert answer.status_code == 200 and long.done(), answer.text  # served once the first one had ended
    finally:
        srv.stop()
    brief = start_server(tmp_path, tiny_model_path, "--max-batch-size", "1", "--local-queue-s", "0.3")
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            started = asyncio.Event()
            long = asyncio.create_task(_stream(client, brief.base_url, started))
            await asyncio.wait_for(started.wait(), 60)
            asked = time.monotonic()
            refused = await client.post(brief.base_url + "/v1/chat/completions", json=short)
            assert refused.status_code == 503 and refused.json()["error"]["reason"] == "queue_full"
            assert time.monotonic() - asked >= 0.3 and not long.done()
            long.cancel()
    finally:
        brief.stop()


# --- InFlight.unless_expired: a request still opening when the drain runs out ----------------------


class _Opening:
    """A request's open that waits for `release` (admission, a model load), and says where it ran."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.cancelled = False

    async def open(self) -> str:
        self.task = asyncio.current_task()
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return "opened"


async def test_a_request_opening_when_the_drain_runs_out_is_refused_in_its_own_task():
    requests, opening = InFlight(), _Opening()
    after: list[str] = []

    async def handler() -> Failure:
        try:
            await requests.unless_expired(opening.open())
        except Refused as refused:
            await asyncio.sleep(0)  # the request's task goes on: no cancellation is left pending on it
            after.append("answered")
            return refused.failure
        raise AssertionError("opened after the drain ran out")

    task = asyncio.create_task(handler())
    await opening.entered.wait()
    assert opening.task is task  # awaited in the request's own task: no task hop
    assert requests.expire() == 0  # nothing attached yet
    assert await task == Failure.draining()
    assert opening.cancelled and after == ["answered"] and task.cancelling() == 0


async def test_an_open_that_finishes_returns_its_result_and_a_later_drain_leaves_the_request_alone():
    requests, opening = InFlight(), _Opening()
    opened = asyncio.Event()
    go_on = asyncio.Event()

    async def handler() -> str:
        result = await requests.unless_expired(opening.open())
        opened.set()
        await go_on.wait()  # streaming: the drain ends a stream through the engine, not by cancelling
        return result

    task = asyncio.create_task(handler())
    await opening.entered.wait()
    opening.release.set()
    await opened.wait()
    requests.expire()
    go_on.set()
    assert await task == "opened" and opening.task is task and not opening.cancelled


async def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    """A client that goes away cancels the request's task: that is no drain refusal, before or after
    the drain ran out."""
    for expire_too in (False, True):
        requests, opening = InFlight(), _Opening()
        task = asyncio.create_task(requests.unless_expired(opening.open()))
        await opening.entered.wait()
        task.cancel()
        if expire_too:
            requests.expire()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert opening.cancelled


async def test_after_the_drain_ran_out_an_open_is_refused_without_running():
    requests, opening = InFlight(), _Opening()
    requests.expire()
    with pytest.raises(Refused):
        await requests.unless_expired(opening.open())
    assert not opening.entered.is_set()
