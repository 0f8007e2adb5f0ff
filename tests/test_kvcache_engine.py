"""The engine hook: `Engine(prefix_cache=KvCacheManager.get)` reuses cached prompt prefixes.

Runs the real engine on the tiny model. A multi-turn chat and a shared system prompt must give the
same greedy completions with reuse on as with it off, and the stats must show the hits."""

from __future__ import annotations

from pathlib import Path

import mlx_lm
import pytest

from engine_arithmetic import assert_decisive_reply
from kvcache.disk import DiskBudget
from kvcache.manager import KvCacheManager
from kvcache.ssd import SsdStore
from memory.ledger import Ledger, ReservationKind
from memory.policy import GiB, figures
from memory.snapshot import MemorySnapshot
from provider.engine import ChatRequest, Engine, Finished, SamplingParams

IDLE = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=15 * GiB)
SYSTEM = {"role": "system", "content": " ".join(["the river model token batch stream is blue"] * 12)}
CHATS = [
    [SYSTEM, {"role": "user", "content": "hello there"}],
    [SYSTEM, {"role": "user", "content": "hello there"}],  # exact repeat: a hit
    [SYSTEM, {"role": "user", "content": "seven apples and a mountain"}],  # system prompt only: partial
    # Only the template's leading "<|im_start|>user" is shared: too short to reuse, a miss
    # (kvcache.manager.REUSE_MIN_TOKENS).
    [{"role": "user", "content": "no shared prefix at all"}],
]


async def completions(engine: Engine, chats, params: SamplingParams) -> list[tuple[int, ...]]:
    return [ids for ids, _ in await completions_and_text(engine, chats, params)]


async def completions_and_text(engine: Engine, chats, params: SamplingParams) -> list[tuple[tuple[int, ...], str]]:
    out = []
    for i, chat in enumerate(chats):
        text, fin = await engine.submit("tiny", ChatRequest(f"r{i}", chat, params)).collect()
        assert isinstance(fin, Finished)
        out.append((fin.completion_ids, text))
    return out


@pytest.mark.parametrize("stop", [False, True], ids=["natural-end", "stop-string"])
async def test_engine_reuses_prefixes_with_identical_greedy_output(tiny_model_path: Path, tmp_path: Path,
                                                                   stop: bool) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0)
    async with Engine() as plain:
        await plain.load("tiny", tiny_model_path)
        if stop:
            # A stop string taken from the middle of the first chat's own completion: the worker
            # ends that request itself and takes its cache back through remove(return_prompt_caches).
            natural = (await completions_and_text(plain, CHATS[:1], params))[0][1]
            params = SamplingParams(max_tokens=16, temperature=0.0, stop=(natural[len(natural) // 2:][:2],))
        expected = await completions(plain, CHATS, params)
    reference = mlx_lm.load(str(tiny_model_path))
    for chat, ids in zip(CHATS, expected):  # reuse splits the prefill another way: no near-tie allowed
        assert_decisive_reply(reference, chat, ids, chat[-1]["content"])
    # In the stop-string case the first chat (whose cache the second one hits) really ends early, so
    # its cache came back through remove(); otherwise it runs to max_tokens.
    assert (len(expected[0]) < 16) == stop

    ledger = Ledger(figures(16 * GiB, env={}), sample=lambda: IDLE)
    manager = KvCacheManager(ledger, ssd=SsdStore(tmp_path, budget=DiskBudget(tmp_path, GiB)))
    async with Engine(prefix_cache=manager.get) as engine:
        await engine.load("tiny", tiny_model_path)
        manager.attach("tiny", "weights")
        assert await completions(engine, CHATS, params) == expected
        stats = manager.stats()
        assert (stats.hits, stats.partial_hits, stats.misses) == (1, 1, 2)
        assert stats.ram_bytes == ledger.snapshot().bytes_by_kind[ReservationKind.PREFIX_CACHE] > 0
        assert stats.disk_bytes > 0
        await engine.unload("tiny")
        manager.purge("tiny")  # what the model manager's kv_purge hook does on every unload
    assert len(ledger) == 0 and list(tmp_path.iterdir()) == []
