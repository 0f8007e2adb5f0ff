"""provider/engine against bare mlx-lm, measured in the same run.

For 1, 4 and 8 concurrent greedy requests (all arriving at t0, EOS disabled, fixed max_tokens)
on the ~50 MB tiny model, three ways:

* ``sequential``: `mlx_lm.stream_generate` one request after another (what you get without
  batching);
* ``bare``: a plain `BatchGenerator` loop (insert all, call `next()` until done): the ceiling;
* ``engine``: `provider.engine.Engine` (worker thread, detokenisation, stop filter, asyncio
  delivery).

Columns: aggregate tok/s = all completion tokens / wall time (prefill included); decode tok/s =
tokens after each request's first / time spent decoding them (for the batched ways: from the
first token of every request in the batch to the last token); TTFT = median
time from t0 to a request's first token (first text delta for the engine). Each cell is the
median of --repeats runs; runs of the three ways are interleaved so drift hits all alike, and
the ratio columns are medians of per-repeat ratios against the `bare` run right before.
The engine should stay within 5 % of `bare`.

    python benchmarks/engine_bench.py [--max-tokens 64] [--repeats 3] [--concurrency 1 4 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mlx_lm  # noqa: E402
from mlx_lm.generate import BatchGenerator, stream_generate  # noqa: E402

from provider.engine import ChatRequest, Engine, SamplingParams, TextDelta  # noqa: E402
from provider.tinymodel import build_tiny_model, weights_bytes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOPICS = ["the river", "a blue mountain", "seven apples", "the coordinator", "memory and cache",
          "one hundred tokens", "green stream batch", "hello world"]


@dataclass(frozen=True)
class Run:
    wall: float
    tokens: int
    first: list[float]  # per request, seconds since t0
    decode_tokens: int  # tokens after each request's first one
    decode_time: float  # seconds spent producing them

    @property
    def agg_tps(self) -> float:
        return self.tokens / self.wall

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else float("nan")

    @property
    def ttft(self) -> float:
        return statistics.median(self.first)


def prompts(tok, n: int) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}],
                                    add_generation_prompt=True) for i in range(n)]


def run_sequential(model, tok, batch: list[list[int]], max_tokens: int) -> Run:
    first, count, decode_time = [], 0, 0.0
    t0 = time.perf_counter()
    for ids in batch:
        for i, _ in enumerate(stream_generate(model, tok, ids, max_tokens=max_tokens)):
            now = time.perf_counter() - t0
            if i == 0:
                first.append(now)
            count += 1
        decode_time += now - first[-1]
    end = time.perf_counter() - t0
    return Run(end, count, first, count - len(batch), decode_time)


def _batched_run(wall: float, first: list[float], stamps: list[float]) -> Run:
    """Decode rate of a batch: tokens after the last request's first token, over that span."""
    start = max(first)
    after = [t for t in stamps if t > start]
    return Run(wall, len(stamps), first, len(after), (max(after) - start) if after else 0.0)


def run_bare(model, batch: list[list[int]], max_tokens: int) -> Run:
    gen = BatchGenerator(model, stop_tokens=None)
    t0 = time.perf_counter()
    gen.insert(batch, max_tokens=[max_tokens] * len(batch))
    first: dict[int, float] = {}
    stamps: list[float] = []
    while len(stamps) < max_tokens * len(batch):
        _, responses = gen.next()
        now = time.perf_counter() - t0
        for r in responses:
            first.setdefault(r.uid, now)
            stamps.append(now)
    end = time.perf_counter() - t0
    gen.close()
    return _batched_run(end, list(first.values()), stamps)


async def run_engine(engine: Engine, batch_messages: list[list[dict]], max_tokens: int, tag: str) -> Run:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    stamps: list[float] = []  # one per text delta: at most one token each
    t0 = time.perf_counter()

    async def one(i: int, msgs) -> tuple[float, int]:
        first = None
        async for event in engine.submit("m", ChatRequest(f"{tag}-{i}", msgs, params)):
            now = time.perf_counter() - t0
            if isinstance(event, TextDelta):
                first = now if first is None else first
                stamps.append(now)
            final = event
        return first, final.usage.completion_tokens

    results = await asyncio.gather(*(one(i, m) for i, m in enumerate(batch_messages)))
    end = time.perf_counter() - t0
    run = _batched_run(end, [f for f, _ in results], stamps)
    # Tokens whose text was held back (a lone space, a partial character) have no delta of their
    # own; count every completion token, spread over the same decode span.
    tokens = sum(n for _, n in results)
    return Run(end, tokens, run.first, run.decode_tokens + (tokens - len(stamps)), run.decode_time)


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the ~50 MB tiny model)")
    args = ap.parse_args(argv)

    path = args.model or build_tiny_model(REPO / ".cache" / "tiny-models" / "small-f32", preset="small")
    model, tok = mlx_lm.load(str(path))
    tok.eos_token_ids = set()
    engine = Engine()
    await engine.load("m", path, eos_token_ids=frozenset())
    blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else "reference BLAS"
    print(f"model {path.name}: {weights_bytes(path) / 1e6:.0f} MB fp32, {blas}, "
          f"max_tokens={args.max_tokens}, median of {args.repeats}")

    # Warm-up: compile kernels and fill allocator caches for every way.
    warm = prompts(tok, 2)
    run_sequential(model, tok, warm[:1], 4)
    run_bare(model, warm, 4)
    await run_engine(engine, [[{"role": "user", "content": "warm"}]] * 2, 4, "warm")

    results: dict[tuple[str, int], list[Run]] = {}
    for rep in range(args.repeats):
        for n in args.concurrency:
            batch = prompts(tok, n)
            msgs = [[{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}] for i in range(n)]
            results.setdefault(("sequential", n), []).append(run_sequential(model, tok, batch, args.max_tokens))
            results.setdefault(("bare", n), []).append(run_bare(model, batch, args.max_tokens))
            results.setdefault(("engine", n), []).append(await run_engine(engine, msgs, args.max_tokens, f"{rep}-{n}"))
    await engine.aclose()

    def med(way: str, n: int, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in results[(way, n)])

    print()
    print("| conc | way        | agg tok/s | decode tok/s | TTFT median s | engine/bare agg | engine/bare decode |")
    print("| ---- | ---------- | --------- | ------------ | ------------- | --------------- | ------------------ |")
    worst = 1.0
    def paired(way: str, n: int, attr: str) -> float:
        # Median of per-repeat ratios: each pair ran back to back, so load from other processes
        # on this shared machine mostly cancels out.
        return statistics.median(getattr(w, attr) / getattr(b, attr)
                                 for w, b in zip(results[(way, n)], results[("bare", n)]))

    for n in args.concurrency:
        for way in ("sequential", "bare", "engine"):
            ratio_agg = paired(way, n, "agg_tps")
            ratio_dec = paired(way, n, "decode_tps")
            if way == "engine":
                worst = min(worst, ratio_agg)
            print(f"| {n:4d} | {way:10s} | {med(way, n, 'agg_tps'):9.1f} | {med(way, n, 'decode_tps'):12.1f} "
                  f"| {med(way, n, 'ttft'):13.3f} | {ratio_agg:15.3f} | {ratio_dec:18.3f} |")
    for n in args.concurrency:
        print(f"batching gain at {n}: bare/sequential agg = "
              f"{med('bare', n, 'agg_tps') / med('sequential', n, 'agg_tps'):.2f}x")
    verdict = "OK" if worst >= 0.95 else "SLOWER THAN 5 %"
    print(f"engine vs bare BatchGenerator, worst aggregate ratio: {worst:.3f} ({verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
