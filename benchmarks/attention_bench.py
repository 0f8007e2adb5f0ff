"""The CPU attention (provider/engine/attention.py) against MLX's own, on the medium tiny model.

Run: `sh tools/with-blas.sh .venv/bin/python benchmarks/attention_bench.py [--repeats 5]`

For each shape, a whole forward pass of the model (prompt tokens L after S tokens already in the KV
cache, the shapes of a chat's later turn, a first prompt and a decode step) is timed with MLX's
attention and with ours, interleaved (A B A B ...), and the table gives the medians and the ratio of
medians. The model's last logits under both are compared too, so a fast wrong answer would show.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from provider.engine import attention
from provider.tinymodel import build_tiny_model

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tiny-models"
SHAPES = [  # (batch, new tokens L, cached tokens S, what it stands for)
    (1, 150, 1700, "chat turn 2-6: the answer and the next message"),
    (1, 64, 2200, "a 64-token prefill chunk late in a chat"),
    (1, 512, 0, "a first prompt"),
    (1, 1500, 0, "the chat's 1,500-token first message (in blocks of rows)"),
    (1, 1, 2000, "decode, one conversation at 2,000 tokens"),
    (8, 1, 200, "decode, a batch of 8 W1 requests"),
]


def prefix(model, b: int, cached: int) -> list | None:
    """The KV of `cached` tokens, made once per shape (a prefill of 2,000 tokens takes seconds here)."""
    if not cached:
        return None
    cache = make_prompt_cache(model)
    model(mx.full((b, cached), 5, dtype=mx.int32), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def forward(model, b: int, length: int, cached: list | None) -> tuple[float, mx.array]:
    cache = make_prompt_cache(model)
    for fresh, kept in zip(cache, cached or (), strict=False):
        keys, values, offset = kept.state
        fresh.state = mx.array(keys), mx.array(values), offset  # a private copy: every run starts from the same KV
    mx.eval([c.keys for c in cache if c.keys is not None])
    t0 = time.perf_counter()
    logits = model(mx.full((b, length), 7, dtype=mx.int32), cache=cache)[:, -1, :]
    mx.eval(logits, [c.state for c in cache])
    return time.perf_counter() - t0, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model, _ = mlx_lm.load(str(build_tiny_model(CACHE / "medium-f32", preset="medium")))
    print(f"medium-f32, {args.repeats} interleaved repeats per shape, whole forward pass, medians\n")
    print("| B | L | S | shape | MLX ms | ours ms | ours ÷ MLX | max logit diff |")
    print("|---|---|---|---|---|---|---|---|")
    for b, length, cached, what in SHAPES:
        times: dict[bool, list[float]] = {False: [], True: []}
        logits: dict[bool, mx.array] = {}
        kv = prefix(model, b, cached)
        for ours in (False, True):  # warm-up: the compiled kernels, the buffer cache
            (attention.enable if ours else attention.disable)()
            forward(model, b, length, kv)
        for _ in range(args.repeats):
            for ours in (False, True):
                (attention.enable if ours else attention.disable)()
                seconds, logits[ours] = forward(model, b, length, kv)
                times[ours].append(seconds)
        attention.disable()
        mlx_ms, ours_ms = (statistics.median(times[o]) * 1e3 for o in (False, True))
        diff = mx.abs(logits[True] - logits[False]).max().item()
        print(f"| {b} | {length} | {cached} | {what} | {mlx_ms:.0f} | {ours_ms:.0f} | {ours_ms / mlx_ms:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
