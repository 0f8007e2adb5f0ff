"""Prefix reuse: time to first token for a long shared prefix, cold vs RAM hit vs SSD hit.

On the ~50 MB tiny model (`small` preset, float32), each request is a 2 000-token shared prefix
(a long system prompt) followed by a fresh 32-token suffix, run through mlx-lm's `BatchGenerator`
exactly as the engine does:

* ``cold``: no cache, the whole prompt is prefilled;
* ``ram``: `ModelKvCache.fetch` finds the prefix in the RAM tier (a copy is taken), only the
  suffix is prefilled;
* ``ssd``: the RAM tier was emptied first, so `fetch` reads, authenticates and decrypts the file
  (AES-256-GCM), rebuilds the MLX arrays and promotes them to RAM, then the suffix is prefilled.

TTFT = from just before `fetch` (or `insert` for cold) to the first generated token. Each row is
the median of --repeats runs, the three ways interleaved so drift hits all alike; the ratios are
against ``cold`` measured in the same run. Greedy outputs are checked to be identical.

    python benchmarks/prefix_bench.py [--prefix 2000] [--suffix 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mlx_lm  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402

from kvcache.disk import DiskBudget, startup_sweep  # noqa: E402
from kvcache.manager import KvCacheManager, ModelKvCache, Tier  # noqa: E402
from kvcache.ssd import SsdStore  # noqa: E402
from memory.ledger import Ledger  # noqa: E402
from memory.policy import GiB, figures  # noqa: E402
from memory.snapshot import MemorySnapshot  # noqa: E402
from provider.tinymodel import build_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIRST_TOKENS = 4  # generated per request: enough to compare outputs


def first_tokens(model, kv: ModelKvCache | None, ids: list[int]) -> tuple[float, list[int], Tier | None, list]:
    """(TTFT seconds, first generated tokens, tier used, the finished request's cache)."""
    gen = BatchGenerator(model, stop_tokens=None)
    try:
        t0 = time.perf_counter()
        reuse = kv.fetch(ids) if kv is not None else None
        if reuse is not None and reuse.cache is not None:
            gen.insert([reuse.rest(ids)], max_tokens=[FIRST_TOKENS], caches=[reuse.cache],
                       all_tokens=[ids[: reuse.matched]])
        else:
            gen.insert([ids], max_tokens=[FIRST_TOKENS])
        ttft, out, cache = None, [], None
        while cache is None:
            _, responses = gen.next()
            for r in responses:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                out.append(r.token)
                if r.finish_reason is not None:
                    cache = r.prompt_cache
        return ttft, out, (reuse.tier if reuse is not None else None), cache
    finally:
        gen.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=2000)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    path = build_tiny_model(REPO / ".cache" / "tiny-models" / "small-f32", preset="small")
    model, _ = mlx_lm.load(str(path))
    idle = MemorySnapshot(physical_bytes=64 * GiB, available_bytes=60 * GiB)
    ledger = Ledger(figures(64 * GiB, env={}), sample=lambda: idle)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 6000) for _ in range(args.prefix)]

    with tempfile.TemporaryDirectory(prefix="prefix-bench-") as tmp:
        root = Path(tmp)
        startup_sweep(root)
        manager = KvCacheManager(ledger, ssd=SsdStore(root, budget=DiskBudget(root, 8 * GiB)))
        kv = manager.attach("small", "bench")
        first_tokens(model, None, prefix[:64] + [5, 6])  # warm up MLX kernels

        # Seed the cache with one request that has the shared prefix.
        seed_ids = prefix + [rng.randrange(3, 6000) for _ in range(args.suffix)]
        _, _, _, cache = first_tokens(model, None, seed_ids)
        kv.store(prefix, cache)
        file_bytes = manager.stats().disk_bytes
        ram_entry = manager.stats().ram_bytes

        times: dict[str, list[float]] = {"cold": [], "ram": [], "ssd": []}
        for _ in range(args.repeats):
            ids = prefix + [rng.randrange(3, 6000) for _ in range(args.suffix)]
            t_cold, out_cold, _, _ = first_tokens(model, None, ids)
            t_ram, out_ram, tier_ram, _ = first_tokens(model, kv, ids)
            manager.evict_for(2**62)  # empty the RAM tier: the next fetch must go to disk
            t_ssd, out_ssd, tier_ssd, _ = first_tokens(model, kv, ids)
            if (tier_ram, tier_ssd) != (Tier.RAM, Tier.SSD) or not out_cold == out_ram == out_ssd:
                print("error: tiers or outputs differ", tier_ram, tier_ssd, file=sys.stderr)
                return 1
            times["cold"].append(t_cold)
            times["ram"].append(t_ram)
            times["ssd"].append(t_ssd)
        manager.purge("small")
        leftover = list(root.iterdir())

    cold = statistics.median(times["cold"])
    blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else "reference BLAS"
    print(f"prefix reuse, small-f32 (~50 MB), {args.prefix}-token shared prefix + {args.suffix}-token suffix, "
          f"median of {args.repeats}, {blas}")
    print(f"RAM entry {ram_entry / 2**20:.1f} MiB, SSD file {file_bytes / 2**20:.1f} MiB (encrypted)")
    print(f"{'path':<6} {'TTFT ms':>9} {'min ms':>8} {'max ms':>8} {'vs cold':>8}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:<6} {med * 1e3:9.1f} {min(values) * 1e3:8.1f} {max(values) * 1e3:8.1f} {cold / med:7.1f}x")
    print(f"outputs identical across paths: yes; files left after purge: {len(leftover)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
