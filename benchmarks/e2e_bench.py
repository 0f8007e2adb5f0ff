"""End to end through the coordinator double vs the engine alone, measured in the same run.

8 concurrent streaming consumers (greedy, the same prompts both ways) on the small tiny model
(~50 MB, context 4096), two ways, interleaved per repeat so drift hits both alike:

* ``engine``: `provider.engine.Engine` in this process, the 8 requests submitted at t0 — the ceiling.
* ``e2e``: the `openai` SDK (AsyncOpenAI, stream=True) → the coordinator double's HTTP API → WebSocket
  → the provider agent (`python -m provider.agent`, its own process, as deployed) → engine → sealed
  chunks back → double decrypts → SSE to the consumer. Everything real: NaCl boxes, JSON frames, the
  model manager's admission and KV reservations.

* ``engine, N at once``: the engine alone again, but at most N requests in it at a time, N being what the
  double (like [A]) sends this machine concurrently (2 for a ≤ 24 GB machine): the
  like-for-like baseline, since through the double the other consumers wait in the coordinator's queue.

Columns: aggregate tok/s = all completion tokens / wall time from t0 to the last stream's end; TTFT =
time from t0 to a stream's first content delta (median and p90 over the 8 streams, then median over
repeats). Ratios are medians of per-repeat ratios.

    python benchmarks/e2e_bench.py [--concurrency 8] [--max-tokens 64] [--repeats 5] [--preset small]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the coordinator double lives under tests/

from openai import AsyncOpenAI  # noqa: E402

from provider.engine import ChatRequest, Engine, SamplingParams, TextDelta  # noqa: E402
from provider.tinymodel import build_tiny_model  # noqa: E402

TOPICS = ["the river", "a blue mountain", "seven apples", "the coordinator", "memory and cache",
          "one hundred tokens", "green stream batch", "hello world", "late trains", "quiet rooms",
          "copper wire", "small models", "north wind", "paper boats", "open windows", "salt and stone"]
MODEL_ID = "bench-model"


@dataclass(frozen=True)
class Run:
    wall: float
    tokens: int
    first: list[float]  # per stream, seconds since t0 to the first content

    @property
    def agg_tps(self) -> float:
        return self.tokens / self.wall

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.first)

    @property
    def ttft_p90(self) -> float:
        ordered = sorted(self.first)
        return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}]


async def engine_run(engine: Engine, n: int, max_tokens: int, tag: str, cap: int | None = None) -> Run:
    """``cap``: at most this many in the engine at once (the rest wait, as at the coordinator's queue)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    gate = asyncio.Semaphore(cap or n)
    t0 = time.perf_counter()
    first: list[float] = [0.0] * n

    async def one(i: int) -> int:
        async with gate:
            stream = engine.submit(MODEL_ID, ChatRequest(f"{tag}-{i}", messages(i), params))
            seen = False
            async for event in stream:
                if isinstance(event, TextDelta) and not seen:
                    first[i], seen = time.perf_counter() - t0, True
                elif not isinstance(event, TextDelta):
                    return event.usage.completion_tokens
        return 0

    tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
    return Run(time.perf_counter() - t0, tokens, first)


async def e2e_run(client: AsyncOpenAI, n: int, max_tokens: int) -> Run:
    t0 = time.perf_counter()
    first: list[float] = [0.0] * n

    async def one(i: int) -> int:
        stream = await client.chat.completions.create(
            model=MODEL_ID, messages=messages(i), max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        seen = False
        usage = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and not seen:
                first[i], seen = time.perf_counter() - t0, True
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return usage

    tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
    return Run(time.perf_counter() - t0, tokens, first)


def start_agent(ws_url: str, model_path: Path, state: Path) -> subprocess.Popen:
    env = {**os.environ,
           "DARKBLOOM_COORDINATOR_URL": ws_url, "DARKBLOOM_DEV_POSTURE": "true",
           "DARKBLOOM_STATE_DIR": str(state), "DARKBLOOM_HF_CACHE_DIR": str(state / "hf"),
           "DARKBLOOM_MODEL_ALIASES": f"{MODEL_ID}={model_path}", "DARKBLOOM_MEMORY_RESERVE_GB": "0.5",
           "DARKBLOOM_LOG_LEVEL": "warning", "DARKBLOOM_LOG_FORMAT": "json", "DARKBLOOM_IDLE_TIMEOUT_MINS": "0"}
    log = (state / "agent.log").open("wb")
    return subprocess.Popen([sys.executable, "-m", "provider.agent"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=log)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    args = parser.parse_args()

    from coordinator_double import CoordinatorDouble, DoubleConfig

    model_path = build_tiny_model(REPO / ".cache" / "tiny-models" / f"{args.preset}-f32", preset=args.preset)
    engine = Engine()
    await engine.load(MODEL_ID, model_path)
    double = CoordinatorDouble(DoubleConfig())
    await double.start()
    state = Path(tempfile.mkdtemp(prefix="e2e-bench-"))
    agent = start_agent(double.ws_url, model_path, state)
    client = AsyncOpenAI(base_url=f"{double.http_url}/v1", api_key="bench", max_retries=0, timeout=120)
    try:
        await double.wait_routable(model=MODEL_ID, timeout=60)
        await e2e_run(client, args.concurrency, 4)  # warm-up: the agent loads the model
        await engine_run(engine, args.concurrency, 4, "warm")
        cap = double.providers[0].max_concurrency  # [A]: requests the coordinator sends this machine at once
        engine_runs, capped_runs, e2e_runs = [], [], []
        for r in range(args.repeats):
            engine_runs.append(await engine_run(engine, args.concurrency, args.max_tokens, f"r{r}"))
            capped_runs.append(await engine_run(engine, args.concurrency, args.max_tokens, f"c{r}", cap=cap))
            e2e_runs.append(await e2e_run(client, args.concurrency, args.max_tokens))
    finally:
        agent.terminate()
        code = agent.wait(60)
        await client.close()
        await double.stop()
        await engine.aclose()
    # Greedy, same prompts, same model: both paths must produce the same completions, token for token.
    assert len({run.tokens for run in engine_runs + capped_runs + e2e_runs}) == 1, "token counts differ"

    def med(values):
        return statistics.median(values)

    print(f"\n{args.concurrency} concurrent streaming requests x {args.max_tokens} tokens, {args.preset} model, "
          f"{args.repeats} repeats (medians); agent exit code {code}\n")
    def ratio(base: list[Run], other: list[Run], key) -> float:
        return med([key(b) / key(o) for b, o in zip(base, other, strict=True)])

    print(f"{'path':<16} {'agg tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'tok/s vs engine':>16}")
    rows = (("engine", engine_runs), (f"engine, {cap} at once", capped_runs), ("e2e (double)", e2e_runs))
    for name, runs in rows:
        print(f"{name:<16} {med([r.agg_tps for r in runs]):>10.1f} {med([r.ttft_p50 for r in runs]) * 1000:>12.1f} "
              f"{med([r.ttft_p90 for r in runs]) * 1000:>12.1f} "
              f"{ratio(runs, engine_runs, lambda r: r.agg_tps):>16.3f}")
    tps = ratio(capped_runs, e2e_runs, lambda r: r.agg_tps)
    ttft = ratio(e2e_runs, capped_runs, lambda r: r.ttft_p50)
    print(f"\noverhead of the whole path vs the engine under the same {cap}-at-once admission: "
          f"throughput engine/e2e = {tps:.3f}, TTFT p50 e2e/engine = {ttft:.2f}")
    print(f"vs the engine with all {args.concurrency} at once: throughput engine/e2e = "
          f"{ratio(engine_runs, e2e_runs, lambda r: r.agg_tps):.3f}")


if __name__ == "__main__":
    asyncio.run(main())
