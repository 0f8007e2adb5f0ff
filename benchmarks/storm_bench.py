"""A request storm through `serve --local` on an emulated 8.5 GiB machine.

Run: `HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/storm_bench.py [--storm 100] [--singles 200]
[--max-batch-size 64]` (under `sh tools/with-blas.sh` for OpenBLAS).

The server runs the ~50 MB `small` tiny model (context 4096, 8 KiB of KV per token) with
`--memory-limit-gb 8.5` and the default reserves (memory_reserve_gb 4, activation reserve 3 GiB):
effective cap 4.5 GiB, about 1.45 GiB of KV room once the model is loaded, so about 46 requests of
the full context fit. The storm is `--storm` concurrent streaming requests that set no `max_tokens`
(each reserves the whole context) and keep streaming while the measurement runs, so the server
stays full. Then, with the server full, `--singles` requests one after another: each is a 503.

Printed: admitted / refused in the storm; time to response headers (p50, p99) for the storm's 200s
and 503s and for the single 503s on the full server; peak ledger, peak MLX active and the sampled
peak of (ledger + MLX active) as a fraction of the effective cap (the ledger's own high-water mark,
MLX's own peak counter, and /status polled every 50 ms); and the share of the KV room the admitted
requests' reservations used. Baseline in the same run: a single request alone on the idle server.
Goals: 503 p50 ≤ ½ × 200 p50; single 503 p99 ≤ 10 ms; peaks ≤ 1.00.

`--kv-quantization none,q8,q4` runs the storm once per setting (the server started with it; the same
cap), then a table of how many max-context requests each admitted at once, as a ratio to `none`, and
each run's peak (ledger + MLX active) ÷ cap. Give the storm and the batch size room for them (q4 holds
about 6x as many as `none` on this float32 model): e.g. `--storm 400 --max-batch-size 512`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from provider.demo import free_port, wait_ready
from provider.tinymodel import build_tiny_model

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tiny-models"
MODEL = "bench/small"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))] if ordered else float("nan")


def start(model_dir: Path, workdir: Path, max_batch_size: int,
          kv_quantization: str = "none") -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    (workdir / "hub").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DARKBLOOM_")}
    env.update(HOME=str(workdir), DARKBLOOM_LOG_FORMAT="json", DARKBLOOM_LOG_LEVEL="warning",
               DARKBLOOM_HF_CACHE_DIR=str(workdir / "hub"), HF_HUB_OFFLINE="1")
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "provider.cli", "serve", "--local", "--local-port", str(port),
         "--model-aliases", f"{MODEL}={model_dir}", "--memory-limit-gb", "8.5",
         "--max-batch-size", str(max_batch_size), "--idle-timeout-mins", "0", "--kv-ssd-budget-gb", "0",
         "--kv-quantization", kv_quantization, "--local-queue-s", "0"],  # a full server refuses at once
        env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, timeout_s=120)
    return proc, base


class Sampler(threading.Thread):
    """Polls /status: the highest (ledger + MLX active) seen, and the request KV high-water."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base, self.stop = base, threading.Event()
        self.peak_sum = 0
        self.peak_request_kv = 0

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=10) as client:
            while not self.stop.is_set():
                status = client.get("/status").json()
                ledger = sum(status["ledger"]["bytes_by_kind"].values())
                self.peak_sum = max(self.peak_sum, ledger + status["memory"]["mlx_active_bytes"])
                self.peak_request_kv = max(self.peak_request_kv, status["ledger"]["bytes_by_kind"]["request_kv"])
                self.stop.wait(0.05)


def body(i: int, *, stream: bool = True, max_tokens: int | None = None) -> dict:
    out = {"model": MODEL, "messages": [{"role": "user", "content": f"storm request number {i}, go on"}],
           "stream": stream, "temperature": 0}
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    return out


async def one(client: httpx.AsyncClient, payload: dict, answered: asyncio.Future, hold: asyncio.Event) -> None:
    """One request: `answered` gets (status, seconds to the response headers) as soon as they
    arrive; a 200 then keeps streaming until `hold` is set (the server stays full)."""
    started = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        answered.set_result((response.status_code, time.perf_counter() - started))
        if response.status_code != 200:
            await response.aread()
            return
        async for _ in response.aiter_raw():
            if hold.is_set():
                return


async def timed(client: httpx.AsyncClient, payload: dict) -> tuple[int, float]:
    loop = asyncio.get_running_loop()
    answered = loop.create_future()
    await one(client, payload, answered, asyncio.Event())
    return answered.result()


async def run(args: argparse.Namespace, setting: str = "none") -> dict:
    model_dir = Path(args.model_dir).resolve() if args.model_dir else build_tiny_model(CACHE / "small-f32", preset="small")
    with tempfile.TemporaryDirectory(prefix="storm-bench-") as tmp:
        proc, base = start(model_dir, Path(tmp), args.max_batch_size, setting)
        sampler = Sampler(base)
        try:
            limits = httpx.Limits(max_connections=args.storm + 16, max_keepalive_connections=args.storm + 16)
            async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
                for _ in range(3):  # load the model, warm every path
                    await timed(client, body(-1, max_tokens=2))
                alone = [(await timed(client, body(-1, max_tokens=2)))[1] for _ in range(20)]
                status = (await client.get("/status")).json()
                cap = status["cap"]["effective_cap_bytes"]
                room = status["ledger"]["available_bytes"]
                sampler.start()

                hold = asyncio.Event()
                loop = asyncio.get_running_loop()
                answers = [loop.create_future() for _ in range(args.storm)]
                streams = [asyncio.create_task(one(client, body(i), answers[i], hold)) for i in range(args.storm)]
                storm = await asyncio.gather(*answers)
                ok = [t for code, t in storm if code == 200]
                refused = [t for code, t in storm if code == 503]
                others = [code for code, _ in storm if code not in (200, 503)]

                singles = []
                for i in range(args.singles):  # the server is full: each is a 503
                    code, took = await timed(client, body(1000 + i))
                    if code == 503:
                        singles.append(took)
                status = (await client.get("/status")).json()
                hold.set()
                await asyncio.gather(*streams, return_exceptions=True)
        finally:
            sampler.stop.set()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)

    ms = 1000.0
    peak_ledger = status["ledger"]["peak_bytes"] / cap
    peak_mlx = status["memory"]["mlx_peak_bytes"] / cap
    peak_sum = sampler.peak_sum / cap
    print(f"storm through serve --local: {args.storm} concurrent max-context streams, small tiny model, "
          f"memory_limit_gb 8.5 (effective cap {cap / 2**30:.2f} GiB, KV room {room / 2**30:.2f} GiB), "
          f"max_batch_size {args.max_batch_size}, kv_quantization {setting}")
    print(f"admitted {len(ok)}, refused {len(refused)} (503), other {len(others)}; "
          f"single requests on the full server: {len(singles)} of {args.singles} refused")
    print()
    print("| answer | n | headers p50 ms | p99 ms | p50 ÷ lone request p50 |")
    print("|---|---|---|---|---|")
    base_p50 = statistics.median(alone)
    rows = [("lone request on the idle server (baseline)", alone), ("storm 200", ok), ("storm 503", refused),
            ("single 503, server full", singles)]
    for name, values in rows:
        if values:
            print(f"| {name} | {len(values)} | {pct(values, 0.5) * ms:.1f} | {pct(values, 0.99) * ms:.1f} | "
                  f"{pct(values, 0.5) / base_p50:.2f} |")
    print()
    ratio = pct(refused, 0.5) / pct(ok, 0.5) if ok and refused else float("nan")
    print(f"storm 503 p50 ÷ storm 200 p50: {ratio:.2f} (goal ≤ 0.50); single 503 p99: "
          f"{pct(singles, 0.99) * ms:.1f} ms (goal ≤ 10)")
    print(f"peak ÷ effective cap: ledger {peak_ledger:.3f}, MLX active {peak_mlx:.3f}, "
          f"ledger + MLX active (sampled every 50 ms) {peak_sum:.3f} (goal ≤ 1.00)")
    print(f"KV room used by the admitted requests' reservations: {sampler.peak_request_kv / room:.1%}")
    print()
    return {"admitted": len(ok), "refused": len(refused), "peak_sum": peak_sum, "peak_ledger": peak_ledger,
            "peak_mlx": peak_mlx}


async def run_settings(args: argparse.Namespace) -> None:
    settings = args.kv_quantization.split(",")
    results = {s: await run(args, s) for s in settings}
    if len(settings) < 2:
        return
    base = results.get("none", {}).get("admitted")
    print("| kv_quantization | max-context requests admitted at once | ÷ none | peak (ledger + MLX active) ÷ cap |")
    print("|---|---|---|---|")
    for s, r in results.items():
        ratio = f"{r['admitted'] / base:.2f}" if base else "—"
        print(f"| {s} | {r['admitted']} (refused {r['refused']}) | {ratio} | {r['peak_sum']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storm", type=int, default=100)
    parser.add_argument("--singles", type=int, default=200)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--kv-quantization", default="none", help="none, q8, q4, or several: none,q8,q4")
    asyncio.run(run_settings(parser.parse_args()))


if __name__ == "__main__":
    main()
