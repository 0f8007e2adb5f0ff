"""Memory with uptime: `serve --local` on the tiny preset through 10,000 (up to 50,000) varied short requests.

Run: `nice -n 10 sh tools/with-blas.sh .venv/bin/python benchmarks/soak_bench.py [--requests 50000]`

A provider that has served for a day must hold no more memory outside its model, its KV and its
prefix cache than a fresh one. This soak starts our server as `peer_bench.py` does (`start_ours`,
the tiny preset built by `provider.tinymodel`, EOS unreachable so every request generates exactly
`--max-tokens`), then sends `--requests` streaming chat requests, `--concurrency` at a time, each a
distinct prompt of 1 to `--max-words` words (so prefill and decode see many different shapes). The
server runs with `memory_limit_gb = --memory-limit-gb` and `memory_reserve_gb = 0.5` (a cap of 6 GiB
by default, which bounds the prefix cache whatever the machine's RAM) and otherwise the default
settings: the SSD tier on (`--no-ssd` turns it off, `kv_ssd_budget_gb = 0`). After every `--window`
requests the clients stop until none is in flight, and the server's memory is read twice: at once
("busy": what serving holds, the heap's free pages since its last trim included) and after `--rest-s`
seconds with nothing sent ("at rest": the engine's idle work done, next-turn preparations and SSD
writes, and the heap trimmed when it went idle: memory/heap.py):

* RSS: the server process's resident memory (psutil);
* MLX active / MLX cache: MLX's allocator, from the server's `/status` (`memory.mlx_active_bytes`,
  `mlx_cache_bytes`): the weights, KV caches and the prefix cache's RAM tier are MLX arrays, and on
  the CPU they are part of RSS;
* prefix cache: its RAM tier (`/status` `prefix_cache.ram_bytes`), which is inside MLX active and
  grows by design up to its share of the cap;
* outside: RSS - MLX active - MLX cache, what the process holds besides MLX's buffers (Python
  objects, compiled kernels and compile caches, allocator slack), busy and at rest. This is the
  column that must stay flat: the last lines give its growth from the end of the first window to
  request 10,000 and from request 10,000 to the end of the run (goal: at most 20 MiB each);
* SSD files / SSD MiB: the SSD tier's files and their bytes on disk (the server's state directory),
  whose in-memory index is part of "outside".

Also per window: p50 of the requests' latency (send to the end of the stream) and of their time to
first token, and the requests that failed (a 503 counts; the run goes on).

`--server-root DIR` runs the server from another checkout (e.g. a `git worktree` of an earlier
commit), to compare two versions of the code with the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil

import peer_bench
from peer_bench import WORDS, Request, Server, ask, model_folder, start_ours

MiB = 2**20
GOAL_MIB = 20  # growth of the memory outside MLX from the first window's end to the last's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000, help="how many requests (up to 50,000 and more)")
    parser.add_argument("--window", type=int, default=1_000, help="requests between two memory readings")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rest-s", type=float, default=10.0,
                        help="seconds with nothing sent before the second reading (the server at rest)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    parser.add_argument("--max-words", type=int, default=120, help="a prompt has 1 to this many words")
    parser.add_argument("--memory-limit-gb", type=float, default=6.5,
                        help="the server's memory_limit_gb (with memory_reserve_gb = 0.5): a cap of 6 GiB by "
                             "default, which bounds the prefix cache whatever the machine's RAM")
    parser.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--no-ssd", action="store_true", help="the SSD tier off (kv_ssd_budget_gb = 0)")
    parser.add_argument("--ours-toml", action="append", default=[], metavar="LINE",
                        help="a line for the server's config, e.g. 'kv_ssd_budget_gb = 0' (repeatable)")
    parser.add_argument("--server-root", type=Path, default=None,
                        help="run the server's code from this checkout (default: this one)")
    parser.add_argument("--work-dir", type=Path, default=None, help="the server's log, config and state")
    parser.add_argument("--json-out", type=Path, default=None, help="the windows' readings, rewritten per window")
    return parser.parse_args(argv)


def prompt(rng: random.Random, max_words: int) -> list[dict[str, str]]:
    """A distinct chat of 1 to `max_words` words: its own length, so its own prefill shape."""
    words = rng.choices(WORDS, k=rng.randint(1, max_words))
    return [{"role": "user", "content": f"{rng.randrange(10**9)} " + " ".join(words)}]


def ssd_files(state_dir: Path) -> tuple[int, int]:
    """The SSD tier's files (one per cached sequence) and their bytes, from the server's state directory."""
    count = size = 0
    for folder in (state_dir / "kvcache").glob("*.*"):
        for entry in os.scandir(folder) if folder.is_dir() else ():
            try:
                size += entry.stat().st_size
                count += 1
            except FileNotFoundError:  # evicted meanwhile
                pass
    return count, size


def server_memory(server: Server, state_dir: Path) -> dict[str, int]:
    with urllib.request.urlopen(server.status_url, timeout=30) as reply:
        status = json.loads(reply.read())
    memory = status["memory"]
    rss = psutil.Process(server.proc.pid).memory_info().rss
    active, cache = memory["mlx_active_bytes"], memory["mlx_cache_bytes"]
    files, disk = ssd_files(state_dir)
    return {"rss": rss, "mlx_active": active, "mlx_cache": cache,
            "prefix_cache": status["prefix_cache"]["ram_bytes"], "outside": rss - active - cache,
            "ssd_files": files, "ssd_bytes": disk}


async def window(server: Server, prompts: list[list[dict[str, str]]], concurrency: int,
                 max_tokens: int) -> list[Request]:
    """`prompts` sent `concurrency` at a time; returns when the last one has ended."""
    queue: asyncio.Queue[list[dict[str, str]]] = asyncio.Queue()
    for messages in prompts:
        queue.put_nowait(messages)
    done: list[Request] = []

    async def client() -> None:
        while not queue.empty():
            done.append(await ask(server, queue.get_nowait(), max_tokens))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done


def row(served: int, busy: dict[str, int], memory: dict[str, int], requests: list[Request]) -> dict:
    """A window's line: `memory` read at rest, `busy` at once when its last request ended."""
    ok = [r for r in requests if r.error is None]
    latency = statistics.median(r.end - r.start for r in ok) if ok else float("nan")
    ttft = statistics.median(r.ttft for r in ok) if ok else float("nan")
    return {"served": served, **memory, "rss_busy": busy["rss"], "outside_busy": busy["outside"],
            "latency_p50_s": latency, "ttft_p50_s": ttft,
            "failed": len(requests) - len(ok), "load1": os.getloadavg()[0]}


def print_table(args: argparse.Namespace, rows: list[dict], started: float) -> None:
    print(f"\nserve --local, {args.preset} preset, {args.requests} requests at c = {args.concurrency}, "
          f"1-{args.max_words} words, {args.max_tokens} tokens each, SSD tier {'off' if args.no_ssd else 'on'}; "
          f"memory read when a window ends (busy) and {args.rest_s:g} s later (at rest) "
          f"({time.monotonic() - started:.0f} s)\n")
    print("| requests | RSS MiB | MLX active MiB | MLX cache MiB | prefix cache MiB | SSD files | SSD MiB "
          "| outside MiB, busy | outside MiB, at rest | latency p50 ms | TTFT p50 ms | failed | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['served']:,} | {r['rss'] / MiB:.0f} | {r['mlx_active'] / MiB:.0f} | {r['mlx_cache'] / MiB:.0f} "
              f"| {r['prefix_cache'] / MiB:.1f} | {r['ssd_files']:,} | {r['ssd_bytes'] / MiB:.0f} "
              f"| {r['outside_busy'] / MiB:.1f} | {r['outside'] / MiB:.1f} | {r['latency_p50_s'] * 1e3:.0f} "
              f"| {r['ttft_p50_s'] * 1e3:.0f} | {r['failed']} | {r['load1']:.1f} |")
    print()
    for a, b in spans(rows):
        growth = (b["outside"] - a["outside"]) / MiB
        busy = (b["outside_busy"] - a["outside_busy"]) / MiB
        print(f"outside MLX, from request {a['served']:,} to {b['served']:,}: {growth:+.1f} MiB at rest "
              f"(goal <= {GOAL_MIB} MiB), {busy:+.1f} MiB busy; RSS at rest {(b['rss'] - a['rss']) / MiB:+.1f} MiB, "
              f"prefix cache {(b['prefix_cache'] - a['prefix_cache']) / MiB:+.1f} MiB, "
              f"SSD files {b['ssd_files'] - a['ssd_files']:+,}; "
              f"latency p50 x{b['latency_p50_s'] / a['latency_p50_s']:.2f}")


MILESTONE = 10_000  # the goals' split: the first window's end to here, and here to the end


def spans(rows: list[dict]) -> list[tuple[dict, dict]]:
    """The growth spans: the first window's end to request 10,000 (or the end, if sooner), then 10,000 to
    the end."""
    if len(rows) < 2:
        return []
    first, last = rows[0], rows[-1]
    middle = next((r for r in rows if r["served"] >= MILESTONE), last)
    out = [(first, middle)] if middle is not first else []
    if middle is not last:
        out.append((middle, last))
    return out


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.server_root is not None:
        peer_bench.REPO = args.server_root.resolve()  # start_ours runs `provider.cli` from there
    model_path = model_folder(argparse.Namespace(model_dir=None, preset=args.preset, no_eos=True))
    work = args.work_dir.resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="soak-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    settings = [f"memory_limit_gb = {args.memory_limit_gb}", "memory_reserve_gb = 0.5",
                *(["kv_ssd_budget_gb = 0"] if args.no_ssd else []), *args.ours_toml]
    server = start_ours(model_path, work, None, settings)
    rows: list[dict] = []
    started = time.monotonic()
    try:
        first = await ask(server, prompt(rng, 8), 1)  # the model loads on the first request
        if first.error is not None:
            raise SystemExit(f"the first request failed ({first.error}); the server's log is in {work}")
        served = 0
        while served < args.requests:
            n = min(args.window, args.requests - served)
            requests = await window(server, [prompt(rng, args.max_words) for _ in range(n)],
                                    args.concurrency, args.max_tokens)
            served += n
            busy = await asyncio.to_thread(server_memory, server, work / "state")
            await asyncio.sleep(args.rest_s)  # a real delay: the second reading is of the server at rest
            rows.append(row(served, busy, await asyncio.to_thread(server_memory, server, work / "state"), requests))
            r = rows[-1]
            errors = sorted({q.error for q in requests if q.error is not None})
            if errors:
                print(f"failed: {', '.join(errors)}", file=sys.stderr)
            print(f"{served:,} requests ({time.monotonic() - started:.0f} s): outside MLX "
                  f"{r['outside_busy'] / MiB:.1f} MiB busy, {r['outside'] / MiB:.1f} at rest, "
                  f"SSD files {r['ssd_files']:,}, latency p50 {r['latency_p50_s'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
            if args.json_out is not None:
                args.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                     "windows": rows}, indent=1))
    finally:
        code = await server.close()
    print_table(args, rows, started)
    print(f"server exit code {code}; log in {work}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
