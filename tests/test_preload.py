"""Warm models: ``preload_models`` are loaded at start through the normal load gate (never past
the cap; a refusal is logged with its reason and the start goes on), reported ``running`` from the first
heartbeat, served without a load, and not unloaded by ``idle_timeout_mins``.

A small machine is emulated with ``memory_limit_gb`` (6.25 GiB, reserve 0.5 GiB: an effective cap of
4.25 GiB). Where a model must never fit, 4.2 GiB (``NO_MEDIUM``: an effective cap of 2.2 GiB): a load
needs its padded weights + its activation reserve + 1 GiB of KV, and the medium model's (≈ 0.44 GiB
padded, its config's estimate ≈ 0.8 GiB at its 4,096 tokens of context) is ≈ 2.24 GiB, while the tiny
and small models need ≈ 1.1 and ≈ 1.45 GiB before their loads measure less.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator_double import Completed, FrameReceived, Registered
from double_fixtures import consumer_for
from provider.agent import Agent
from provider.metrics import LoadResult
from provider.runtime import Runtime
from provider.slots import ModelState
from provider.telemetry import capture_redacted_logs
from settings_for import settings_for

NO_EOS = frozenset({10**9})
# An agent of its own on a 6.25 GB machine: dev posture, quick heartbeats, no local server, no SSD tier.
AGENT = {"dev_posture": True, "heartbeat_interval_s": 0.5, "local_enabled": False, "kv_ssd_budget_gb": 0,
         "memory_limit_gb": 6.25}


NO_MEDIUM = {**AGENT, "memory_limit_gb": 4.2}


def loads(metrics) -> float:
    return metrics.model_loads_total.labels(result=LoadResult.LOADED.value)._value.get()


async def test_preloads_that_cannot_load_are_refused_with_their_reason_and_the_rest_load(
        tmp_path, tiny_model_path, small_model_path, medium_model_path):
    models = {"tiny": tiny_model_path, "small": small_model_path, "medium": medium_model_path}
    settings = settings_for(tmp_path, models, **NO_MEDIUM, max_model_slots=1,
                            preload_models=("medium", "ghost", "tiny", "small"))
    with capture_redacted_logs() as logs:
        runtime = await Runtime.start(settings)
    try:
        verdicts = {m.id: v for m, v in runtime.manager.verdicts()}
        assert not verdicts["medium"].ever_fits and verdicts["small"].ever_fits  # the premise
        assert runtime.preload_refused == {"medium": "too_large", "ghost": "unknown_model", "small": "slot_cap"}
        assert runtime.manager.warm_models() == ["tiny"] and runtime.manager.kept_warm == {"tiny"}
        refused = {e["model"]: e["reason"] for e in logs if e["event"] == "preload_refused"}
        assert refused == runtime.preload_refused  # the log says which and why
        status = runtime.status()
        assert status["preload"] == {"requested": ["medium", "ghost", "tiny", "small"],
                                     "refused": runtime.preload_refused}
        assert [m["id"] for m in status["models"] if m["preloaded"]] == ["tiny"]
        by_id = {m["id"]: m for m in status["models"]}
        loaded = [e for e in logs if e["event"] == "model_loaded"]
        # The solo-prefill threshold measured at load, in the load's log line and in /status.
        assert [e["solo_min_tokens"] for e in loaded] == [by_id["tiny"]["solo_prefill_min_tokens"]]
        assert by_id["tiny"]["solo_prefill_min_tokens"] >= 1 and by_id["small"]["solo_prefill_min_tokens"] is None
    finally:
        await runtime.aclose()


async def test_solo_prefill_off_is_said_in_status(tmp_path, tiny_model_path):
    runtime = await Runtime.start(settings_for(tmp_path, {"tiny": tiny_model_path}, **AGENT, preload_models=("tiny",),
                                               solo_prefill=False))
    try:
        assert [m["solo_prefill_min_tokens"] for m in runtime.status()["models"]] == [None]
    finally:
        await runtime.aclose()


async def test_a_preload_that_fits_only_by_evicting_an_earlier_one_is_refused(
        tmp_path, small_model_path, medium_model_path, monkeypatch):
    """The activation reserve is set so that medium loads on an otherwise empty machine with 24 MiB to
    spare, so not beside small (≈ 49 MB resident): preloading small then medium would evict small. What
    the agent counts besides (its process's bytes outside MLX) is read from a runtime started first."""
    import memory
    from provider.models import discover_models

    settings = settings_for(tmp_path, {"small": small_model_path, "medium": medium_model_path},
                            **{**AGENT, "memory_limit_gb": 7.25}, preload_models=("small", "medium"))
    weights = {m.id: m.weight_bytes for m in discover_models(settings).models}
    policy = memory.resolve_settings({}, memory_reserve_gb=0.5, memory_limit_gb=7.25)
    effective = memory.compute_figures(settings.memory_limit_bytes, policy).effective_cap_bytes
    first = await Runtime.start(settings.model_copy(update={"preload_models": ()}))
    try:
        baseline = first.probe.snapshot().counted_bytes
    finally:
        await first.aclose()
    activation = effective - memory.MIN_KV_BYTES - memory.padded_weight_bytes(weights["medium"]) - baseline - (24 << 20)
    monkeypatch.setenv("DARKBLOOM_ACTIVATION_RESERVE_GB", repr(activation / (1 << 30)))
    runtime = await Runtime.start(settings)
    try:
        assert runtime.preload_refused == {"medium": "needs_eviction"}
        assert runtime.manager.warm_models() == ["small"]
    finally:
        await runtime.aclose()


async def test_idle_timeout_unloads_other_models_but_not_a_preloaded_one(tmp_path, tiny_model_path,
                                                                          small_model_path):
    settings = settings_for(tmp_path, {"tiny": tiny_model_path, "small": small_model_path}, **AGENT,
                            idle_timeout_mins=1e-6, preload_models=("tiny",))
    runtime = await Runtime.start(settings)
    try:
        await runtime.manager.ensure_loaded("small")
        assert sorted(runtime.manager.warm_models()) == ["small", "tiny"]
        assert await runtime.manager.reap_idle() == ["small"]  # idle past the timeout (60 µs): unloaded
        assert runtime.manager.state("tiny") is ModelState.LOADED
        assert await runtime.manager.reap_idle() == []
        assert runtime.manager.warm_models() == ["tiny"]
    finally:
        await runtime.aclose()


async def test_a_preloaded_model_is_running_from_the_first_heartbeat_and_serves_without_a_load(
        coordinator_double, tmp_path, tiny_model_path, medium_model_path):
    double = coordinator_double
    settings = settings_for(tmp_path, {"tiny": tiny_model_path, "medium": medium_model_path}, **NO_MEDIUM,
                            coordinator_url=double.ws_url, preload_models=("tiny", "medium"))
    with capture_redacted_logs() as logs:
        agent = await Agent.start(settings, harden=False, eos_token_ids={"tiny": NO_EOS, "medium": NO_EOS})
    assert agent.runtime.preload_refused == {"medium": "too_large"}  # refused; the agent started anyway
    assert any(e["event"] == "preload_refused" and e["reason"] == "too_large" for e in logs)
    assert loads(agent.metrics) == 1  # tiny, before any connection
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        registered = await double.wait_for(lambda e: isinstance(e, Registered), timeout=15)
        assert registered.models == ("tiny",)
        first = await double.wait_for(lambda e: isinstance(e, FrameReceived) and e.message.type == "heartbeat",
                                      timeout=15)
        beat = first.message
        assert beat.warm_models == ("tiny",)
        assert [(s.model, s.state) for s in beat.backend_capacity.slots] == [("tiny", "running")]
        await double.wait_routable(model="tiny", timeout=15)
        async with consumer_for(double) as client:
            completion = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "warm"}], max_tokens=3)
        assert completion.usage.completion_tokens == 3
        await double.wait_for(lambda e: isinstance(e, Completed), timeout=10)
        assert loads(agent.metrics) == 1  # served by the preloaded model: no load
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0


@pytest.mark.parametrize("value", ["", " tiny"])
def test_preload_ids_are_validated(tmp_path, value):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        settings_for(tmp_path, {}, **AGENT, preload_models=(value,))
