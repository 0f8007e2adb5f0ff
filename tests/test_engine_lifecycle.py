"""provider/engine load / unload / close: memory really freed, requests failed with typed codes."""

from __future__ import annotations

import asyncio
import threading

import mlx.core as mx
import pytest

from provider.engine import (
    ChatRequest,
    Engine,
    EngineError,
    EngineFailure,
    Failed,
    Finished,
    SamplingParams,
    TextDelta,
)
from provider.tinymodel import weights_bytes

MESSAGES = [{"role": "user", "content": "hello"}]


def long_request(rid: str) -> ChatRequest:
    return ChatRequest(rid, MESSAGES, SamplingParams(max_tokens=5000, temperature=0.0))


@pytest.fixture
async def engine():
    eng = Engine()
    yield eng
    await eng.aclose()


async def test_load_reports_measured_weights_and_config(engine, tiny_model_path):
    info = await engine.load("tiny", tiny_model_path)
    assert info.context_length == 2048
    assert info.eos_token_ids == frozenset({0, 2})
    assert info.vocab_size == 2048
    # Active-memory growth during the load is the weights (plus a little bookkeeping).
    assert abs(info.weights_bytes - weights_bytes(tiny_model_path)) < 64 * 1024


async def test_unload_fails_running_requests_releases_and_frees_mlx_memory(engine, tiny_model_path):
    baseline = mx.get_active_memory()
    await engine.load("tiny", tiny_model_path, eos_token_ids=frozenset())
    released = []
    stream = engine.submit("tiny", long_request("r"), on_released=released.append)
    assert isinstance(await anext(stream), TextDelta)

    await engine.unload("tiny")
    rest = [e async for e in stream]
    assert isinstance(rest[-1], Failed) and rest[-1].code is EngineFailure.MODEL_UNLOADED
    assert released == ["r"]
    assert engine.stats("tiny") is None
    # MLX counters are exact after clear_cache.
    assert mx.get_active_memory() - baseline < 256 * 1024
    assert mx.get_cache_memory() == 0

    late = [e async for e in engine.submit("tiny", long_request("late"))]
    assert late == [Failed(EngineFailure.MODEL_NOT_LOADED)]


async def test_two_models_decode_round_robin(engine, tiny_model_path, quantized_model_path):
    await engine.load("a", tiny_model_path, eos_token_ids=frozenset())
    await engine.load("b", quantized_model_path, eos_token_ids=frozenset())
    params = SamplingParams(max_tokens=6, temperature=0.0)
    results = await asyncio.gather(
        engine.submit("a", ChatRequest("ra", MESSAGES, params)).collect(),
        engine.submit("b", ChatRequest("rb", MESSAGES, params)).collect(),
    )
    for _, fin in results:
        assert isinstance(fin, Finished) and fin.usage.completion_tokens == 6
    assert results[0][1].completion_ids != results[1][1].completion_ids  # really two models


async def test_load_errors_are_typed(engine, tiny_model_path, tmp_path):
    from provider.telemetry import capture_redacted_logs

    with capture_redacted_logs() as logs, pytest.raises(EngineError) as missing:
        await engine.load("x", tmp_path / "nope")
    assert missing.value.code is EngineFailure.LOAD_FAILED
    [failed] = [e for e in logs if e["logger"] == "provider.engine"]
    assert (failed["event"], failed["level"], failed["model"]) == ("model_load_failed", "error", "x")
    assert failed["exc_type"] and "nope" not in repr(failed)  # the exception's type and frames, not its text
    await engine.load("tiny", tiny_model_path)
    with pytest.raises(EngineError) as twice:
        await engine.load("tiny", tiny_model_path)
    assert twice.value.code is EngineFailure.MODEL_ALREADY_LOADED
    with pytest.raises(EngineError) as unknown:
        await engine.count_prompt_tokens("other", MESSAGES)
    assert unknown.value.code is EngineFailure.MODEL_NOT_LOADED


async def test_bad_messages_are_an_invalid_request(engine, tiny_model_path):
    await engine.load("tiny", tiny_model_path)
    bad = [{"role": "user"}]  # no content: the template cannot render it
    events = [e async for e in engine.submit("tiny", ChatRequest("bad", bad, SamplingParams(max_tokens=2)))]
    assert events == [Failed(EngineFailure.INVALID_REQUEST)]
    assert EngineFailure.INVALID_REQUEST.is_client_error


async def test_close_fails_running_requests_and_ends_the_thread(tiny_model_path):
    before = set(threading.enumerate())
    engine = Engine()
    await engine.load("tiny", tiny_model_path, eos_token_ids=frozenset())
    stream = engine.submit("tiny", long_request("r"))
    assert isinstance(await anext(stream), TextDelta)
    await engine.aclose()
    rest = [e async for e in stream]
    assert rest[-1] == Failed(EngineFailure.ENGINE_CLOSED)
    assert set(threading.enumerate()) == before
    with pytest.raises(EngineError):
        engine.submit("tiny", long_request("after"))
    engine.close()  # idempotent, also from sync code


async def test_reclaim_runs_on_the_engine_thread_and_empties_the_mlx_cache(tiny_model_path):
    """A plain reclaim (the cache rule's, a load's) clears MLX's cache without a full collection —
    that holds the GIL for ~0.1 s and stalls the event loop; the settle barrier's blocking reclaim
    collects first. Both run on the engine thread; full collections are counted by the collector's
    own callbacks on that thread."""
    import gc
    import threading

    full: list[str] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2 and threading.current_thread().name == "mlx-reclaim-test":
            full.append(threading.current_thread().name)

    async with Engine(thread_name="mlx-reclaim-test") as engine:
        await engine.load("tiny", tiny_model_path)
        gc.callbacks.append(count)
        try:
            await engine.unload("tiny")  # drops the model: one full collection
            assert len(full) == 1
            await engine.reclaim()
            assert len(full) == 1 and mx.get_cache_memory() == 0
            await engine.reclaim(collect=True)
            assert len(full) == 2
            await asyncio.to_thread(engine.reclaim_blocking)
            assert len(full) == 3 and mx.get_cache_memory() == 0
        finally:
            gc.callbacks.remove(count)
