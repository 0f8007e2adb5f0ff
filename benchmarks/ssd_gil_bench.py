"""How long the SSD tier's writer thread keeps the GIL from the engine thread: one cached sequence of
~8B-model size (KV of --tokens tokens, 131,072 bytes a token: 32 layers, 8 KV heads of 128, bf16) is
copied to host bytes, sealed and written on a thread, while this thread ticks (`time.sleep(0)` in a
loop, as the engine thread between MLX calls needs the GIL). Reported: the longest gap between two
ticks and the 99th percentile, for the tier's way (`SsdStore.write`, slices of `SLICE_BYTES`) and, as
the baseline in the same run, the one-shot way it replaced (`bytes(memoryview)` of each array,
`b"".join`, `AESGCM.encrypt` of the whole payload, one `write`).

    python benchmarks/ssd_gil_bench.py [--tokens 1500] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvcache.disk import DiskBudget
from kvcache.host import SLICE_BYTES, HostArray, HostCache, copy_sliced
from kvcache.ssd import SsdStore

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128


def ticking(work) -> tuple[float, float]:
    """(longest gap, p99 gap) in ms between this thread's ticks while `work` runs on another thread."""
    done = threading.Event()
    thread = threading.Thread(target=lambda: (work(), done.set()))
    gaps, last = [], time.perf_counter()
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        time.sleep(0)
    thread.join()
    gaps.sort()
    return 1000 * gaps[-1], 1000 * gaps[int(0.99 * (len(gaps) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)  # what the agent's Engine sets (provider/engine/engine.py)
    shape = (1, KV_HEADS, args.tokens, HEAD_DIM)
    n = HostArray.expected_nbytes("bfloat16", shape)
    device = [bytes(os.urandom(n)) for _ in range(2 * LAYERS)]  # stands in for the arrays' buffers
    key = os.urandom(64)
    rows = {"one-shot (baseline)": [], "sliced (SsdStore.write)": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = SsdStore(root, budget=DiskBudget(root, 64 * 2**30, free_bytes_fn=lambda _: 1 << 50), key=key)

        def one_shot() -> None:
            data = [bytes(memoryview(b)) for b in device]
            payload = b"".join(data)
            blob = AESGCM(key[:32]).encrypt(os.urandom(12), payload, b"")
            (root / "one-shot").write_bytes(blob)

        def sliced() -> None:
            arrays = []
            for b in device:
                out = bytearray(n)
                copy_sliced(memoryview(b), memoryview(out))
                arrays.append(HostArray("bfloat16", shape, out))
            cache = HostCache(args.tokens, tuple(zip(arrays[0::2], arrays[1::2])))
            store.open("m", "w")
            store.write("m", "w", list(range(args.tokens)), cache)
            store.purge("m")

        for _ in range(args.repeats):
            for label, work in (("one-shot (baseline)", one_shot), ("sliced (SsdStore.write)", sliced)):
                rows[label].append(ticking(work))
    mb = 2 * LAYERS * n / 2**20
    print(f"one sequence: {args.tokens} tokens, {mb:.0f} MiB of KV; slice {SLICE_BYTES >> 10} KiB; "
          f"median of {args.repeats}\n")
    print("| way | longest GIL gap ms | p99 gap ms |\n|---|---|---|")
    for label, runs in rows.items():
        print(f"| {label} | {statistics.median(r[0] for r in runs):.1f} | {statistics.median(r[1] for r in runs):.2f} |")


if __name__ == "__main__":
    main()
