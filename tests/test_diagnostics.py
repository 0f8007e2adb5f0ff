"""Memory diagnostics and the safe self-restart, on real MLX and the tiny models.

* a 10-switch soak (tiny and small, alternating): every unload returns MLX's active memory to where
  it started (within 1 % of the model's size) with an empty cache and no reservation; the restart
  recommendation stays `none` and the baseline drift the manager reports is exactly what MLX reports;
* /status and `darkbloom-provider status` show the unloads, the baseline and the verdict;
* end to end under the coordinator double: memory that does not come back (an MLX buffer the test
  keeps alive, as a leak would) is found by the baseline after an unload; the restart is needed, so
  the agent stops taking jobs (503 draining), lets the in-flight stream finish, exits with the
  restart code, and the test's supervisor starts it again: it registers afresh.
"""

from __future__ import annotations

import asyncio

import httpx
import mlx.core as mx
import pytest

from coordinator_double import JOB_HEADER, Completed, Registered, Rejected
from double_fixtures import consumer_for, quick_config
from memory import GiB, Probe, padded_weight_bytes
from memory.diagnostics import Recommendation
from provider.agent import EXIT_OK, EXIT_RESTART, Agent, self_restart_enabled
from provider.cli import render_status
from provider.config import Settings
from provider.demo import free_port
from provider.doctor import ProblemCode, running_agent_diagnostics
from provider.doctor.report import _restart_problems
from provider.engine import ChatRequest, SamplingParams
from provider.local.server import StatusEndpoint
from provider.runtime import Runtime
from provider.tinymodel import weights_bytes

NO_EOS = frozenset({10**9})
MiB = 2**20


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


async def test_a_10_switch_soak_recommends_nothing_and_reports_what_mlx_reports(tmp_path, tiny_model_path,
                                                                               small_model_path):
    (tmp_path / "hub").mkdir()
    rt = await Runtime.start(Settings(state_dir=tmp_path / "state", hf_cache_dir=tmp_path / "hub",
                                      model_aliases={"tiny": tiny_model_path, "small": small_model_path},
                                      memory_limit_gb=8.0, memory_reserve_gb=0.5, idle_timeout_mins=0,
                                      kv_ssd_budget_gb=0, local_port=free_port()))
    try:
        start = mx.get_active_memory()
        for i in range(10):
            model = ("tiny", "small")[i % 2]
            async with rt.manager.serve(f"r{i}", model, 16, 2) as slot:
                _, done = await slot.submit(ChatRequest(f"r{i}", chat("switch"), SamplingParams(max_tokens=2))).collect()
            assert done is not None
            assert await rt.manager.unload(model)
            # each unload gives everything back: MLX active memory within 1 % of the model's size of
            # where it started, an empty buffer cache, no reservation left
            size = weights_bytes(tiny_model_path if model == "tiny" else small_model_path)
            report = rt.manager.last_unload
            assert report.model_id == model and report.settled and report.resident_bytes >= size * 0.99
            assert abs(mx.get_active_memory() - start) <= size // 100, i
            assert mx.get_cache_memory() == 0
            assert len(rt.ledger) == 0
        advice = rt.manager.restart_advice()
        assert advice.recommendation is Recommendation.NONE, advice
        assert len(rt.manager.diagnostics.baseline) == 11  # at start, then after every settle
        assert advice.drift.mlx_active_bytes == mx.get_active_memory() - start  # what MLX says, exactly
        status = rt.status()["diagnostics"]
        assert status["restart"] == {"recommendation": "none", "reason": None,
                                     "thresholds": status["restart"]["thresholds"]}
        assert [u["model"] for u in status["unloads"][:2]] == ["small", "tiny"]  # newest first
        assert all(u["settled"] and u["cause"] == "idle" for u in status["unloads"])
        assert status["baseline"]["drift_bytes"] == advice.drift.mlx_active_bytes
        text = render_status({"mode": "local", **rt.status()})
        assert "restart none" in text and "unloaded small (idle)" in text
        assert 'darkbloom_restart_recommendation{level="none"} 1.0' in rt.metrics.render().decode()
        # doctor reads the same verdict from the running agent's /status
        endpoint = StatusEndpoint.start(rt, rt.settings)
        try:
            seen = await asyncio.to_thread(running_agent_diagnostics, rt.settings)
        finally:
            await endpoint.aclose()
        assert seen is not None and seen["restart"]["recommendation"] == "none"
        assert _restart_problems(seen) == ()
    finally:
        await rt.aclose()


def test_doctor_turns_the_agents_verdict_into_a_problem():
    needed = {"restart": {"recommendation": "needed", "reason": "no_model_headroom"},
              "baseline": {"drift_bytes": 300 * MiB}}
    (problem,) = _restart_problems(needed)
    assert problem.code is ProblemCode.RESTART_NEEDED and problem.severity.value == "error"
    assert "no_model_headroom" in problem.detail and "300.0 MiB" in problem.detail
    (advised,) = _restart_problems({"restart": {"recommendation": "advised", "reason": "settle_failures"}})
    assert advised.code is ProblemCode.RESTART_ADVISED and advised.severity.value == "warning"
    assert _restart_problems(None) == ()


def test_self_restart_is_on_only_under_a_service_manager_by_default(tmp_path):
    auto = Settings(state_dir=tmp_path)
    assert not self_restart_enabled(auto, {})
    assert self_restart_enabled(auto, {"DARKBLOOM_SERVICE_MANAGER": "launchd"})
    assert self_restart_enabled(auto, {"INVOCATION_ID": "0123abcd"})  # systemd
    assert self_restart_enabled(Settings(state_dir=tmp_path, self_restart="on"), {})
    assert not self_restart_enabled(Settings(state_dir=tmp_path, self_restart="off"), {"INVOCATION_ID": "x"})


@pytest.fixture
def double_config():
    return quick_config(queue_timeout=2.0)


async def test_a_needed_restart_drains_and_the_supervisor_starts_the_agent_again(coordinator_double, tmp_path,
                                                                                  tiny_model_path, monkeypatch):
    double = coordinator_double
    # Two models (one folder), with the operator's fixed 3 GiB activation reserve. The machine: room for a
    # model's load, for what this process holds outside MLX (counted by the cap too) and 256 MiB; a buffer
    # of that much and 128 MiB more that never comes back leaves less than the largest model needs: a
    # restart is needed.
    monkeypatch.setenv("DARKBLOOM_ACTIVATION_RESERVE_GB", "3")
    outside = Probe().snapshot().outside_mlx_bytes
    required = (4 * GiB) + padded_weight_bytes(weights_bytes(tiny_model_path))  # A 3 GiB + MIN_KV 1 GiB
    limit_gb = (required + 2 * GiB + outside + 256 * MiB) / GiB  # hard cap = P − 2 GiB below 20 GiB
    settings = Settings(coordinator_url=double.ws_url, dev_posture=True, state_dir=tmp_path / "p",
                        hf_cache_dir=tmp_path / "hub", model_aliases={"a": tiny_model_path, "b": tiny_model_path},
                        memory_limit_gb=limit_gb, memory_reserve_gb=0.5, heartbeat_interval_s=0.5,
                        drain_timeout_s=30.0, idle_timeout_mins=0, kv_ssd_budget_gb=0, self_restart="on",
                        local_port=free_port())
    (tmp_path / "hub").mkdir()
    eos = {"a": NO_EOS, "b": NO_EOS}
    agent = await Agent.start(settings, harden=False, eos_token_ids=eos)
    stop = asyncio.Event()
    run = asyncio.create_task(agent.run(stop))
    leak = None
    try:
        await double.wait_routable(model="a", timeout=30)
        async with consumer_for(double) as consumer:
            done = await consumer.chat.completions.create(model="b", messages=chat("warm b"), max_tokens=2)
            assert done.usage.completion_tokens == 2
        async with httpx.AsyncClient(base_url=double.http_url, timeout=60) as client:
            body = {"model": "a", "messages": chat("a long answer"), "max_tokens": 40, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
                assert stream.status_code == 200
                in_flight = stream.headers[JOB_HEADER]
                lines = stream.aiter_lines()
                first = [line async for line in _until_data(lines)]
                assert first
                leak = mx.zeros(((outside + 384 * MiB) // 4,), dtype=mx.float32)  # memory that will not come back
                mx.eval(leak)
                mark = double.mark()
                assert await agent.manager.unload("b")  # its settle samples the baseline: + the leak
                assert agent.manager.restart_advice().needed
                assert agent.exit_code == EXIT_RESTART and agent.manager.draining
                # New work is refused: the heartbeat says draining, so the coordinator stops routing here,
                # and whatever still reaches the agent gets 503 draining before any accept.
                refused = await client.post("/v1/chat/completions", json={
                    "model": "a", "messages": chat("after"), "max_tokens": 2})
                assert refused.status_code >= 500
                rejects = [e for e in double.events[mark:] if isinstance(e, Rejected)]
                assert all(r.error_reason == "draining" and r.status_code == 503 for r in rejects)
                refusal = agent.manager.book("direct", "a", 16, 2)
                assert getattr(refusal, "failure", None) is not None and refusal.failure.reason.value == "draining"
                rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"  # the in-flight stream finished in full
            finished = await double.wait_for(lambda e: isinstance(e, Completed) and e.request_id == in_flight,
                                             timeout=30)
            assert finished.usage.completion_tokens == 40
        assert await asyncio.wait_for(run, 60) == EXIT_RESTART
        # The supervisor (launchd, systemd; here the test) starts the agent again: it registers afresh.
        del leak
        leak = None
        mark = double.mark()
        again = await Agent.start(settings, harden=False, eos_token_ids=eos)
        stop2 = asyncio.Event()
        run2 = asyncio.create_task(again.run(stop2))
        await double.wait_for(lambda e: isinstance(e, Registered), since=mark, timeout=30)
        await double.wait_routable(model="a", timeout=30)
        assert again.exit_code == EXIT_OK and not again.manager.draining
        stop2.set()
        assert await asyncio.wait_for(run2, 60) == EXIT_OK
    finally:
        del leak
        if not run.done():
            stop.set()
            await asyncio.wait_for(run, 60)


async def _until_data(lines):
    async for line in lines:
        if line.startswith("data: "):
            yield line
            return


def test_the_status_text_shows_a_restart_verdict():
    text = render_status({"mode": "agent", "diagnostics": {
        "restart": {"recommendation": "needed", "reason": "no_model_headroom"},
        "baseline": {"drift_bytes": 300 * MiB, "drift_pct": 7.1, "rss_drift_bytes": 310 * MiB, "samples": 4},
        "unloads": [{"model": "b", "cause": "idle", "freed_bytes": 5 * MiB, "resident_bytes": 5 * MiB,
                     "settled": True, "settle_s": 0.01, "at": 0.0}]}}, now=10.0)
    assert "restart needed (no_model_headroom)" in text and "300.0 MiB" in text and "unloaded b (idle)" in text
