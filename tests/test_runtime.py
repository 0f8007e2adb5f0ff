"""provider/runtime: the assembly both `serve` and `serve --local` run, on the tiny model.

The startup sweep clears what an earlier process left under `state_dir/kvcache` before anything
writes there; requests through the manager reuse prefixes; `/status` (the runtime's body, served
by the status-only app) shows the hits and misses; shutdown leaves no reservation and no file.
"""

from __future__ import annotations

import os

import httpx
import mlx_lm

from engine_arithmetic import assert_decisive_reply
from provider.config import Settings
from provider.demo import free_port
from provider.engine import ChatRequest, Finished, SamplingParams
from provider.local.server import StatusEndpoint
from provider.runtime import KVCACHE_DIR, Runtime
from settings_for import settings_for

MESSAGES = [{"role": "user", "content": "a prompt we send twice, word for word"}]


async def ask(runtime: Runtime, rid: str) -> Finished:
    prompt = await runtime.counter.count("tiny", MESSAGES)
    async with runtime.manager.serve(rid, "tiny", prompt, 3) as slot:
        _, fin = await slot.submit(ChatRequest(rid, MESSAGES, SamplingParams(max_tokens=3, temperature=0))).collect()
    assert isinstance(fin, Finished)
    return fin


async def test_startup_sweep_prefix_reuse_status_and_clean_shutdown(tmp_path, tiny_model_path):
    settings = settings_for(tmp_path, {"tiny": tiny_model_path}, local_port=free_port())
    root = settings.state_dir / KVCACHE_DIR
    leftover = root / ("ab" * 16 + "." + "cd" * 8)  # a per-model dir a killed process left behind
    leftover.mkdir(parents=True)
    (leftover / "entry").write_bytes(b"unreadable without the old process's key")
    (root / "half-written.tmp").write_bytes(b"x")
    (root / "not-ours.txt").write_bytes(b"kept")  # the sweep touches only names kvcache creates

    runtime = await Runtime.start(settings)
    try:
        assert not leftover.exists() and not (root / "half-written.tmp").exists()
        assert (root / "not-ours.txt").exists()
        assert os.stat(root).st_mode & 0o777 == 0o700
        assert runtime.servable == ("tiny",) and runtime.weight_hashes.known().keys() == {"tiny"}

        endpoint = StatusEndpoint.start(runtime, settings)
        assert endpoint.serving
        try:
            first, second = await ask(runtime, "r1"), await ask(runtime, "r2")
            # Reuse splits the second prefill another way: equal tokens only where no choice is a near-tie.
            assert_decisive_reply(mlx_lm.load(str(tiny_model_path)), MESSAGES, first.completion_ids, "first")
            assert first.completion_ids == second.completion_ids  # reuse changes nothing in the output
            async with httpx.AsyncClient(base_url=settings.local_base_url) as client:
                status = (await client.get("/status")).json()
                assert (await client.get("/healthz")).json() == {"status": "ok"}
                assert (await client.post("/v1/chat/completions", json={})).status_code in (404, 405)  # chat off
            assert status["mode"] == "coordinator"
            assert [(m["id"], m["state"]) for m in status["models"]] == [("tiny", "loaded")]
            kv = status["prefix_cache"]
            assert kv["hits"] == 1 and kv["hits"] + kv["partial_hits"] + kv["misses"] == 2
            assert kv["ram_bytes"] == status["ledger"]["bytes_by_kind"]["prefix_cache"] > 0
            # The repeat builds on the first request's sequence: it goes to the SSD tier once it has
            # been quiet for SSD_QUIET_S (kvcache.manager), not yet.
            assert kv["disk_bytes"] == 0 and status["in_flight"] == 0
            assert status["cap"]["effective_cap_bytes"] == runtime.ledger.figures.effective_cap_bytes
        finally:
            await endpoint.aclose()
    finally:
        await runtime.aclose()
    assert len(runtime.ledger) == 0
    assert sorted(p.name for p in root.iterdir()) == ["not-ours.txt"]  # the unload purged the SSD tier


async def test_ssd_tier_off_keeps_the_ram_tier(tmp_path, tiny_model_path):
    runtime = await Runtime.start(settings_for(tmp_path, {"tiny": tiny_model_path}, local_port=free_port(),
                                               kv_ssd_budget_gb=0))
    try:
        await ask(runtime, "r1")
        await ask(runtime, "r2")
        stats = runtime.prefix_cache.stats()
        assert stats.hits == 1 and stats.ram_bytes > 0 and stats.disk_bytes == 0
    finally:
        await runtime.aclose()
    assert len(runtime.ledger) == 0


async def test_a_busy_port_leaves_the_status_endpoint_off(tmp_path, tiny_model_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = settings_for(tmp_path, {"tiny": tiny_model_path}, local_port=taken.getsockname()[1])
        runtime = await Runtime.start(settings)
        try:
            endpoint = StatusEndpoint.start(runtime, settings)
            assert not endpoint.serving
            await endpoint.aclose()
        finally:
            await runtime.aclose()


async def test_start_freezes_the_startup_heap_once(tmp_path, tiny_model_path):
    """After start-up the collector no longer walks the imports and tokenizers at every full
    collection (gc.freeze); a second start in the same process does not freeze again (what the
    first froze stays frozen, and later objects stay collectable)."""
    import gc

    from provider.runtime import freeze_startup_heap

    (tmp_path / "hub").mkdir()
    runtime = await Runtime.start(Settings(state_dir=tmp_path / "state", hf_cache_dir=tmp_path / "hub",
                                           model_aliases={"tiny": tiny_model_path}, kv_ssd_budget_gb=0))
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000
        freeze_startup_heap()
        assert gc.get_freeze_count() == frozen
    finally:
        await runtime.aclose()
