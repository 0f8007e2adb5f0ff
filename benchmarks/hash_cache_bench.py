"""Weight hashing at agent start: the first start against the second, with the persisted digest cache.

Every start of the agent advertises each model's weight hash (a SHA-256 over every weight file). It
used to be computed from every byte at every start; the per-file digests now persist in the state
dir (`weight-hashes.json`, keyed by real path, size and mtime), so a restart reads only files that
changed. This measures exactly that step as a start runs it: a fresh process opens the state dir's
cache and hashes the model (`DigestCache.open` + `weight_hash_sync`, which saves the cache).

A model of --gib GiB of weight files (4 shards of random bytes, written once into a temp dir, removed
at the end) is hashed by, in each of --repeats rounds with a new empty state dir:

* ``first``: a fresh process, empty state dir (the baseline, measured in the same run: what every
  start cost before the cache persisted);
* ``second``: a fresh process, the state dir the first one left;
* ``one shard changed``: one shard rewritten in between (a partial re-read).

Columns: ``hash ms`` is the step (median, min, max over the rounds) and ``vs first`` its ratio to the
baseline; ``process ms`` is the whole child process for context (interpreter and imports included).

Timed inside the child from before opening the cache to after saving it (interpreter start-up and
imports are not part of either: the agent pays them whatever the cache holds). The weights were just written, so the first start reads them from the page
cache: that favours the baseline, and a real cold start from disk is slower still.

    python benchmarks/hash_cache_bench.py [--gib 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARDS = 4
_CHILD = """
import sys, time
from pathlib import Path
from provider.models.hashing import DigestCache, weight_hash_sync
t0 = time.perf_counter()
cache = DigestCache.open(Path(sys.argv[2]))
digest = weight_hash_sync(Path(sys.argv[1]), cache=cache)
print(time.perf_counter() - t0, digest)
"""


def write_model(directory: Path, total_bytes: int) -> list[Path]:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    block = os.urandom(64 << 20)
    shards = []
    for i in range(SHARDS):
        path = directory / f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        with path.open("wb") as f:
            left = total_bytes // SHARDS
            while left > 0:
                chunk = block[: min(left, len(block))]
                f.write(bytes([i]) + chunk[1:])  # shards differ from each other
                left -= len(chunk)
        shards.append(path)
    return shards


def start(model: Path, cache_file: Path) -> tuple[float, float, str]:
    """(seconds of the hashing step, seconds of the whole process, digest)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(cache_file)], capture_output=True,
                         text=True, check=True)
    wall = time.perf_counter() - t0
    seconds, digest = out.stdout.split()
    return float(seconds), wall, digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="weight bytes of the model (GiB)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    total = int(args.gib * 2**30)
    rows: dict[str, list[float]] = {"first": [], "second": [], "one shard changed": []}
    walls: dict[str, list[float]] = {name: [] for name in rows}
    with tempfile.TemporaryDirectory(prefix="darkbloom-hash-bench-") as tmp:
        model = Path(tmp) / "model"
        shards = write_model(model, total)
        digests = set()
        for r in range(args.repeats):
            state = Path(tmp) / f"state-{r}"
            cache_file = state / "weight-hashes.json"
            for name in ("first", "second"):
                seconds, wall, digest = start(model, cache_file)
                rows[name].append(seconds)
                walls[name].append(wall)
                digests.add(digest)
            original = shards[0].read_bytes()
            shards[0].write_bytes(b"\xff" + original[1:])
            seconds, wall, _ = start(model, cache_file)
            rows["one shard changed"].append(seconds)
            walls["one shard changed"].append(wall)
            shards[0].write_bytes(original)  # back as it was (new mtime: the next round starts cold anyway)
        shutil.rmtree(model)
    if len(digests) != 1:
        print("error: the starts disagree on the weight hash", file=sys.stderr)
        sys.exit(1)
    first = statistics.median(rows["first"])
    print(f"weight hash at start, {SHARDS} shards, {total / 2**30:.1f} GiB of weights, median of {args.repeats} "
          f"rounds (fresh process each, page-cache warm)")
    print(f"{'start':<18} {'hash ms':>9} {'min ms':>9} {'max ms':>9} {'vs first':>9} {'process ms':>11}")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"{name:<18} {med * 1e3:9.1f} {min(values) * 1e3:9.1f} {max(values) * 1e3:9.1f} "
              f"{first / med:8.1f}x {statistics.median(walls[name]) * 1e3:11.0f}")
    ratio = first / statistics.median(rows["second"])
    print(f"second start {ratio:.0f}x faster than the first ({'meets' if ratio >= 10 else 'MISSES'} the 10x goal)")


if __name__ == "__main__":
    main()
