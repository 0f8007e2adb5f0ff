"""provider/guest end to end: a serving window, with the agent (real engine on the tiny model, real manager and
ledger) against the coordinator double over a real WebSocket, consumers on the `openai` SDK, and an
injected clock that the test moves.

Windows 06:00-07:30 and 07:45-09:00 (UTC), `preload_models = ["tiny"]`, a 5-minute grace period:

* 07:20, inside a window: a request is served;
* 07:30, the window ends while a long stream is in flight: the stream finishes; a new request gets a
  503 ``draining`` without an accept, ``feasible_after_ms`` = 900 000 (the next window opens at 07:45);
  the heartbeat says ``draining`` at once; /status, /metrics and the log carry the reason;
* 07:35, the grace period is over: the model (preloaded, kept warm) is unloaded and MLX memory is back
  to what it was before the agent started;
* 07:45, the next window: the preload is loaded again, the heartbeat says ``idle``, a request is served.
"""

from __future__ import annotations

import asyncio
import gc
from datetime import UTC, datetime
from pathlib import Path

import mlx.core as mx
import openai
import pytest

from clock import Clock
from coordinator_double import ChunkReceived, FrameReceived, Rejected
from double_fixtures import consumer_for
from memory import ReservationKind
from provider.agent import Agent
from provider.config import Settings
from provider.guest import Available, Paused, PauseReason
from provider.guest.monitor import GuestMonitor
from provider.metrics import EvictionCause
from provider.telemetry import capture_redacted_logs

NO_EOS = frozenset({10**9})  # the tiny model never stops early: a stream has exactly max_tokens
DAY = (2025, 1, 8)


def at(hour: int, minute: int, second: int = 0) -> datetime:
    return datetime(*DAY, hour, minute, second, tzinfo=UTC)


def heartbeat_says(status: str):
    return lambda e: isinstance(e, FrameReceived) and e.message.type == "heartbeat" and e.message.status == status


async def stream_all(consumer: openai.AsyncOpenAI, max_tokens: int) -> tuple[int, str | None]:
    stream = await consumer.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a long answer"}], max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True})
    finish, tokens = None, 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, finish


def active_bytes_now() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


async def test_a_serving_window_end_to_end(coordinator_double, tiny_model_path: Path, tmp_path: Path):
    double = coordinator_double
    clock = Clock(at(7, 20))
    settings = Settings(
        coordinator_url=double.ws_url, dev_posture=True, state_dir=tmp_path / "state",
        hf_cache_dir=tmp_path / "empty-hf-cache", model_aliases={"tiny": tiny_model_path}, memory_limit_gb=8.0,
        memory_reserve_gb=0.5, heartbeat_interval_s=0.5, drain_timeout_s=5.0, idle_timeout_mins=0,
        kv_ssd_budget_gb=0, local_enabled=False, preload_models=("tiny",),
        serve_windows=("06:00-07:30", "07:45-09:00"), serve_timezone="UTC", pause_unload_grace_mins=5)
    baseline = active_bytes_now()
    guest = GuestMonitor.from_settings(settings, clock=clock)
    agent = await Agent.start(settings, harden=False, eos_token_ids={"tiny": NO_EOS}, guest=guest)
    assert agent.manager.warm_models() == ["tiny"]
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await double.wait_routable(model="tiny", timeout=15)
        async with consumer_for(double) as consumer:
            served = await consumer.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "inside"}], max_tokens=3)
            assert served.usage.completion_tokens == 3

            # 07:30: the window ends with a stream in flight.
            mark = double.mark()
            streaming = asyncio.create_task(stream_all(consumer, 400))
            await double.wait_for(lambda e: isinstance(e, ChunkReceived), since=mark, timeout=10)
            mark = double.mark()
            clock.now = at(7, 30)
            with capture_redacted_logs() as logs:
                assert await guest.step() == Paused(PauseReason.OUTSIDE_WINDOW, 900)
            assert agent.stats.serving, "the premise: the stream is still running when the window ends"
            changed = [e for e in logs if e["event"] == "availability_changed"]
            assert [(e["state"], e["reason"], e["retry_after_s"]) for e in changed] == [("paused", "outside_window", 900)]
            await double.wait_for(heartbeat_says("draining"), since=mark, timeout=10)  # sent at once

            with pytest.raises(openai.APIStatusError) as refused:
                await consumer.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "outside"}], max_tokens=3)
            assert refused.value.status_code == 503
            (rejected,) = double.events.of(Rejected, since=mark)
            assert (rejected.status_code, rejected.error_reason) == (503, "draining")
            frames = [e.message for e in double.events.of(FrameReceived, since=mark)
                      if getattr(e.message, "request_id", None) == rejected.request_id]
            assert [f.type for f in frames] == ["inference_error"]  # no accept before it
            assert frames[0].feasible_after_ms == 900_000  # the next window opens in 15 minutes
            assert agent.stats.serving, "the premise: refused while the stream is still running"

            assert await streaming == (400, "length")  # the in-flight stream finished

        status = agent.runtime.status()["availability"]
        assert (status["state"], status["reason"], status["retry_after_s"]) == ("paused", "outside_window", 900)
        assert status["next_window_change"] == datetime(*DAY, 7, 45, tzinfo=UTC).timestamp()
        metrics = agent.metrics.render().decode()
        assert 'darkbloom_paused{reason="outside_window"} 1.0' in metrics
        assert 'darkbloom_pauses_total{reason="outside_window"} 1.0' in metrics

        # 07:35: the grace period is over; the model goes, and its memory with it.
        clock.now = at(7, 34, 59)
        await guest.step()
        assert agent.manager.warm_models() == ["tiny"]
        clock.now = at(7, 35)
        await guest.step()
        assert agent.manager.warm_models() == [] and guest.released
        assert agent.manager.last_unload.cause is EvictionCause.PAUSED
        counts = agent.ledger.snapshot().count_by_kind
        assert all(counts[k] == 0 for k in (ReservationKind.REQUEST_KV, ReservationKind.PENDING_LOAD))
        assert active_bytes_now() - baseline < 256 * 1024

        # 07:45: the next window; the preload comes back and requests are served again.
        mark = double.mark()
        clock.now = at(7, 45)
        assert await guest.step() == Available()
        assert agent.manager.warm_models() == ["tiny"] and agent.manager.kept_warm == {"tiny"}
        await double.wait_for(heartbeat_says("idle"), since=mark, timeout=10)
        async with consumer_for(double) as consumer:
            again = await consumer.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "again"}], max_tokens=4)
        assert again.usage.completion_tokens == 4
        assert double.anomalies() == []
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0


async def test_an_agent_started_outside_its_windows_waits_to_preload(coordinator_double, tiny_model_path: Path,
                                                                     tmp_path: Path):
    """Started at 12:00 with a 22:00-07:30 window: connected, heartbeat ``draining``, nothing loaded;
    every request refused with the hint capped at an hour."""
    double = coordinator_double
    clock = Clock(at(12, 0))
    settings = Settings(
        coordinator_url=double.ws_url, dev_posture=True, state_dir=tmp_path / "state",
        hf_cache_dir=tmp_path / "empty-hf-cache", model_aliases={"tiny": tiny_model_path}, memory_limit_gb=8.0,
        memory_reserve_gb=0.5, heartbeat_interval_s=0.5, idle_timeout_mins=0, kv_ssd_budget_gb=0,
        local_enabled=False, preload_models=("tiny",), serve_windows=("22:00-07:30",), serve_timezone="UTC")
    with capture_redacted_logs() as logs:
        agent = await Agent.start(settings, harden=False, eos_token_ids={"tiny": NO_EOS},
                                  guest=GuestMonitor.from_settings(settings, clock=clock))
    assert agent.manager.warm_models() == []
    assert any(e["event"] == "preload_deferred" and e["reason"] == "outside_window" for e in logs)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await double.wait_for(heartbeat_says("draining"), timeout=15)
        await double.wait_routable(model="tiny", timeout=15)  # [A] ignores the status: it routes, we refuse
        async with consumer_for(double) as consumer:
            with pytest.raises(openai.APIStatusError):
                await consumer.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "noon"}], max_tokens=3)
        (error,) = [e.message for e in double.events.of(FrameReceived) if e.message.type == "inference_error"]
        assert error.feasible_after_ms == 3600 * 1000 and error.error_reason == "draining"
        assert agent.manager.warm_models() == []  # a refusal loads nothing
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0
