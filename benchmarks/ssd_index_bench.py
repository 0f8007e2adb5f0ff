"""The SSD tier's memory per file: `--files` conversations written through `SsdStore`, what the tier
then holds in Python objects (tracemalloc: its index and its disk budget's records), per file and per
token, and the time of a lookup and of a fetch among them.

Run: `.venv/bin/python benchmarks/ssd_index_bench.py [--files 5000] [--tokens 200-2000]`
(`PYTHONPATH=OTHER_CHECKOUT` measures another version of kvcache/ with the same load.)

Each file is a conversation of `--tokens` token ids (a third opening with one shared 300-token system
prompt), its KV a one-layer cache of 4 bytes a position, so the disk holds little and the count of
files is what the memory follows (the 16 GiB default budget holds tens of thousands of a small model's
conversations). The token ids are made fresh for each file and dropped after its write, as a request's
are, so whatever the index keeps of them is counted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from kvcache.disk import DiskBudget
from kvcache.host import HostArray, HostCache
from kvcache.ssd import SsdStore, WriteOutcome

MODEL, WEIGHTS = "bench/model", "sha256:bench"


def cache(tokens: int) -> HostCache:
    shape = (1, 1, tokens, 1)
    return HostCache(tokens, ((HostArray("float32", shape, bytes(4 * tokens)),) * 2,))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=5_000)
    parser.add_argument("--tokens", default="200-2000", help="a conversation's length: LOW-HIGH token ids")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    low, high = (int(x) for x in args.tokens.split("-"))
    rng = random.Random(args.seed)
    system = [rng.randrange(300, 150_000) for _ in range(300)]
    with tempfile.TemporaryDirectory(prefix="ssd-index-bench-") as root:
        store = SsdStore(Path(root), budget=DiskBudget(Path(root), 2**40, free_bytes_fn=lambda _: 2**42))
        store.open(MODEL, WEIGHTS)
        kept: list[list[int]] = []  # a few queries for the lookups, taken before the count starts
        for _ in range(20):
            kept.append(system + [rng.randrange(300, 150_000) for _ in range(rng.randint(low, high))])
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        tokens_total, started = 0, time.perf_counter()
        for i in range(args.files):
            n = rng.randint(low, high)
            head = system if i % 3 == 0 else []
            ids = head + [rng.randrange(300, 150_000) for _ in range(max(1, n - len(head)))]
            if i < len(kept):
                ids = kept[i]
            if store.write(MODEL, WEIGHTS, ids, cache(len(ids))) is not WriteOutcome.WRITTEN:
                raise SystemExit(f"file {i} was not written")
            tokens_total += len(ids)
            del ids
        written_s = time.perf_counter() - started
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        files = store.entries(MODEL)
        charged = getattr(store, "index_bytes", lambda _m: None)(MODEL)
        queries = [q[: len(q) - 5] + [1, 2, 3] for q in kept]
        lookup = getattr(store, "longest_match", None) or store.lookup
        t_lookup = []
        for q in queries:
            t = time.perf_counter()
            lookup(MODEL, q)
            t_lookup.append(time.perf_counter() - t)
        t_fetch = []
        fetch = getattr(store, "fetch", None)
        for q in queries if fetch is not None else ():
            t = time.perf_counter()
            hit = fetch(MODEL, WEIGHTS, q)
            t_fetch.append(time.perf_counter() - t)
            assert hit is not None and hit.common == len(q) - 3
    print(f"\nSsdStore, {files:,} files of {low}-{high} token ids ({tokens_total / files:.0f} on average), "
          f"written in {written_s:.1f} s\n")
    print("| files | held MiB | bytes a file | bytes a token | charged to the ledger, bytes a file "
          "| lookup p50 us | fetch p50 ms |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {files:,} | {held / 2**20:.1f} | {held / files:,.0f} | {held / tokens_total:.2f} "
          f"| {'-' if charged is None else f'{charged / files:,.0f}'} | {statistics.median(t_lookup) * 1e6:.0f} "
          f"| {'-' if not t_fetch else f'{statistics.median(t_fetch) * 1e3:.2f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
