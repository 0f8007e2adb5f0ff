"""The prefix cache's stores stay off the engine thread's critical path.

On a GPU a device→host copy between two decode steps stalls the step in flight (the SSD tier's
host copy on the engine thread took 22 % of it at 1B, c=32). Here, on the real engine with the SSD
tier and its writer thread as the runtime builds them: the host copy, the sealing and the file write run
on the writer thread only, never on the engine thread; what is written is the same bytes as the RAM
entry; and a later request served from the SSD tier alone gives the same greedy tokens as a cold one.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

from kvcache import state
from kvcache.disk import DiskBudget
from kvcache.manager import KvCacheManager
from kvcache.ssd import SsdStore
from memory.ledger import Ledger
from memory.policy import GiB, figures
from memory.snapshot import MemorySnapshot
from provider.engine import ChatRequest, Engine, Finished, SamplingParams

IDLE = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=15 * GiB)
PARAMS = SamplingParams(max_tokens=12, temperature=0.0)


def opening(n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"conversation number {n} " + "about rivers and mountains " * 16}]


def chat(n: int, answer: str) -> list[dict[str, str]]:
    """A conversation's second turn: it builds on the first (more than a template's first tokens), so
    its sequence is one the SSD tier keeps."""
    return [*opening(n), {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]


async def test_host_copies_and_writes_run_on_the_writer_thread_only(tiny_model_path: Path, tmp_path: Path,
                                                                    monkeypatch) -> None:
    where: dict[str, set[str]] = {"host_copy": set(), "write": set()}

    def recorded(name, fn):
        def wrapper(*args, **kwargs):
            where[name].add(threading.current_thread().name)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(state, "host_copy", recorded("host_copy", state.host_copy))
    monkeypatch.setattr(SsdStore, "write", recorded("write", SsdStore.write))
    written: list[tuple[tuple[int, ...], object]] = []
    write = SsdStore.write
    monkeypatch.setattr(SsdStore, "write", lambda self, model, weights, tokens, host: (
        written.append((tuple(tokens), host)), write(self, model, weights, tokens, host))[1])

    ssd = SsdStore(tmp_path, budget=DiskBudget(tmp_path, GiB))
    ledger = Ledger(figures(16 * GiB, env={}), sample=lambda: IDLE)
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-ssd-write")
    manager = KvCacheManager(ledger, ssd=ssd, write_executor=writer)

    async with Engine() as plain:
        await plain.load("tiny", tiny_model_path)
        answers = [(await plain.submit("tiny", ChatRequest(f"a{n}", opening(n), PARAMS)).collect())[0]
                   for n in range(3)]
        cold = [await plain.submit("tiny", ChatRequest(f"c{n}", chat(n, answers[n]), PARAMS)).collect()
                for n in range(3)]

    async with Engine(prefix_cache=manager.get, thread_name="mlx-engine") as engine:
        await engine.load("tiny", tiny_model_path)
        kv = manager.attach("tiny", "weights")
        for n in range(3):
            await engine.submit("tiny", ChatRequest(f"o{n}", opening(n), PARAMS)).collect()  # RAM only
            text, done = await engine.submit("tiny", ChatRequest(f"r{n}", chat(n, answers[n]), PARAMS)).collect()
            assert isinstance(done, Finished) and (text, done.completion_ids) == (cold[n][0], cold[n][1].completion_ids)
        # The worker hands the last entry over at its next loop; an idle engine gets there at once.
        await engine.reclaim()
        writer.shutdown(wait=True)
        assert ssd.entries("tiny") == 3
        # What is on disk is the RAM entry, byte for byte.
        assert len(written) == 3
        for key, host in written:
            assert host == state.host_copy(kv.ram.entry(key)) == ssd.read("tiny", "weights", key)
        # Served from the SSD tier alone, a repeat gives the cold greedy tokens.
        manager.evict_for(2**40)
        again = engine.submit("tiny", ChatRequest("again", chat(1, answers[1]), PARAMS))
        text, done = await again.collect()
        assert (text, done.completion_ids) == (cold[1][0], cold[1][1].completion_ids)
        assert manager.stats().ssd_hits == 1
        await engine.unload("tiny")
        manager.purge("tiny")

    assert where["write"] == {t for t in where["write"] if t.startswith("kv-ssd-write")} and where["write"]
    assert where["host_copy"] and all(t.startswith("kv-ssd-write") for t in where["host_copy"] - {"MainThread"})
    assert "mlx-engine" not in where["host_copy"] | where["write"]
    mx.synchronize()
