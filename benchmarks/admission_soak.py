"""Admission after a long uptime: per-request cost after 1,000 requests and after 50,000.

Run: `HF_HUB_OFFLINE=1 sh tools/with-blas.sh .venv/bin/python benchmarks/admission_soak.py [--requests 50000]`

A provider that has served for a day must admit a request as fast as a fresh one. What grows with
uptime is the RAM prefix cache: one stored sequence per finished request (tens of thousands in a
16 GiB tier). This soak takes requests through the real objects a request's admission goes through
— `ModelManager` (`precheck`, `book_when_released`, `serve` entered and left), the one `Ledger`,
the `Probe`, `KvCacheManager` — with the tiny model resident on the real `Engine`, and after each
request stores one sequence in the model's RAM tier (`ModelKvCache.store`, as the engine does when
a request finishes). No request is submitted to the engine (no MLX compute): leaving `serve` releases
its KV as for a request that ends before the engine, which wakes the admission waiters as a real
release does.

Each stored sequence is 7 tokens every request shares (a chat template's head) + 33 of its own
(prompt and completion); its KV is a small synthetic layout (1 layer, 1 head, 8 dims, float16:
1.3 KiB), because admission's cost depends on how many sequences are stored, not on their size.

Two windows of `--window` requests: after `--early` requests (the baseline, same run) and after
`--requests`. In each, every other request first drops the probe's shared reading
(`Probe.invalidate()`), so it samples the machine as a request arriving alone does; the others
arrive together and share it. Admission = precheck + booking + serve's entry and exit + the wake of
waiters its release schedules, in µs per request (p50, p90). Also shown: `Ledger.snapshot()` (read
several times per admission) and the RAM tier's store, per call.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvcache.manager import KvCacheManager
from kvcache.ram import StoreOutcome
from memory import Ledger, Probe, ReservationKind, compute_figures, resolve_settings
from provider.engine import Engine
from provider.models import discover
from provider.slots import ModelManager, Refused
from provider.tinymodel import build_tiny_model
from timing import measure

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tiny-models"
MODEL = "tiny"
HEAD = [1, 17, 29, 31, 5, 9, 13]  # the chat template's first tokens: every sequence starts with them
OWN = 33  # each request's own tokens: prompt and completion
PROMPT, MAX_TOKENS = 32, 64


def synthetic_cache(tokens: int) -> list[KVCache]:
    """A finished request's cache in a small layout: `store` keeps a copy of its first positions."""
    layer = KVCache()
    layer.keys = mx.zeros((1, 1, tokens, 8), dtype=mx.float16)
    layer.values = mx.ones((1, 1, tokens, 8), dtype=mx.float16)
    layer.offset = tokens
    mx.eval(layer.keys, layer.values)
    return [layer]


class Soak:
    def __init__(self, manager: ModelManager, probe: Probe, ledger: Ledger, kv: KvCacheManager) -> None:
        self.manager, self.probe, self.ledger, self.kv = manager, probe, ledger, kv
        self.served = 0
        self.rng = random.Random(36)
        self.finished = synthetic_cache(len(HEAD) + OWN)

    async def admit_one(self) -> float:
        """One request's admission, booking and release; seconds."""
        rid = f"r{self.served}"
        t0 = time.perf_counter()
        if self.manager.precheck(MODEL, PROMPT // 2, MAX_TOKENS) is not None:
            raise RuntimeError("refused by the precheck")
        booking = await self.manager.book_when_released(rid, MODEL, PROMPT, MAX_TOKENS)
        match booking:
            case Refused(failure=failure):
                raise RuntimeError(f"refused: {failure}")
        async with self.manager.serve(rid, MODEL, PROMPT, MAX_TOKENS, booking=booking):
            pass
        await asyncio.sleep(0)  # the release's wake of waiters runs here (call_soon_threadsafe)
        return time.perf_counter() - t0

    def store_one(self) -> float:
        """The finished request's sequence into the RAM tier; seconds."""
        tokens = HEAD + [self.rng.randrange(3, 2048) for _ in range(OWN)]
        t0 = time.perf_counter()
        outcome = self.kv.get(MODEL).store(tokens, self.finished)
        took = time.perf_counter() - t0
        if outcome is not StoreOutcome.STORED:
            raise RuntimeError(f"store {outcome}")
        return took

    async def serve(self, n: int) -> None:
        for _ in range(n):
            await self.admit_one()
            self.store_one()
            self.served += 1

    async def window(self, n: int) -> dict[str, float]:
        alone, together, stores = [], [], []
        for i in range(n):
            if i % 2 == 0:
                self.probe.invalidate()
                alone.append(await self.admit_one())
            else:
                together.append(await self.admit_one())
            stores.append(self.store_one())
            self.served += 1
        snapshot_p50, _ = measure(self.ledger.snapshot, 2000)
        return {"served": self.served, "entries": len(self.kv.get(MODEL).ram), "ledger": len(self.ledger),
                "alone": _p(alone, 50), "alone90": _p(alone, 90), "together": _p(together, 50),
                "together90": _p(together, 90), "store": _p(stores, 50), "snapshot": snapshot_p50}


def _p(samples: list[float], q: int) -> float:
    """Percentile `q` in µs."""
    if q == 50:
        return statistics.median(samples) * 1e6
    return sorted(samples)[int(q / 100 * (len(samples) - 1))] * 1e6


async def run(requests: int, early: int, window: int) -> None:
    path = build_tiny_model(CACHE / "tiny-f32", preset="tiny")
    inventory = discover(hf_cache=None, aliases={MODEL: path})
    probe = Probe(memory_limit_gb=4.0)
    figures = compute_figures(probe.machine_bytes, resolve_settings({}, memory_reserve_gb=0.5, memory_limit_gb=4.0,
                                                                    activation_reserve_gb=0.25))
    ledger = Ledger(figures, sample=probe.recent)
    kv = KvCacheManager(ledger, sample_snapshot=probe.recent)

    async def weight_hash(model_id: str) -> str:
        return f"weights-of-{model_id}"

    started = time.perf_counter()
    async with Engine(prefix_cache=kv.get) as engine:
        manager = ModelManager(engine, inventory, ledger, figures, probe, idle_timeout_s=None,
                               prefix_cache=kv, weight_hash=weight_hash)
        await manager.ensure_loaded(MODEL)
        soak = Soak(manager, probe, ledger, kv)
        await soak.serve(early)
        gc.collect()
        first = await soak.window(window)
        await soak.serve(requests - soak.served)
        gc.collect()
        last = await soak.window(window)
        prefix = ledger.snapshot().bytes_by_kind[ReservationKind.PREFIX_CACHE]
        await manager.unload_all()
        if len(ledger):
            raise RuntimeError(f"reservations left after unload: {ledger.snapshot()}")
    took = time.perf_counter() - started

    print(f"admission per request after N requests: tiny model resident, one RAM prefix entry per finished "
          f"request, window of {window} (µs; {took:.0f} s in all)")
    print(f"{'after':>8} {'prefix entries':>15} {'ledger entries':>15} {'alone p50':>10} {'alone p90':>10} "
          f"{'together p50':>13} {'together p90':>13} {'store p50':>10} {'Ledger.snapshot':>16}")
    for row in (first, last):
        print(f"{row['served'] - window:>8,} {row['entries']:>15,} {row['ledger']:>15,} {row['alone']:>10.1f} "
              f"{row['alone90']:>10.1f} {row['together']:>13.1f} {row['together90']:>13.1f} {row['store']:>10.1f} "
              f"{row['snapshot']:>16.2f}")
    ratio = {k: last[k] / first[k] for k in ("alone", "alone90", "together", "together90", "store", "snapshot")}
    print(f"{'ratio':>8} {'':>15} {'':>15} {ratio['alone']:>10.2f} {ratio['alone90']:>10.2f} "
          f"{ratio['together']:>13.2f} {ratio['together90']:>13.2f} {ratio['store']:>10.2f} {ratio['snapshot']:>16.2f}")
    print(f"goal: p50 ratio ≤ 1.2 (alone {ratio['alone']:.2f}, together {ratio['together']:.2f}); "
          f"RAM tier at the end: {prefix / 2**20:.1f} MiB charged to the ledger")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=50_000, help="requests served before the late window")
    parser.add_argument("--early", type=int, default=1_000, help="requests served before the baseline window")
    parser.add_argument("--window", type=int, default=1_000, help="requests timed in each window")
    args = parser.parse_args()
    if not 0 < args.early < args.requests - args.window:
        parser.error("need 0 < --early < --requests - --window")
    asyncio.run(run(args.requests, args.early, args.window))


if __name__ == "__main__":
    main()
