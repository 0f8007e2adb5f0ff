"""Peer benchmark: `darkbloom-provider serve --local` against `mlx_lm.server`, same model folder, same run.

Both servers run as their own processes on the same tiny model folder (`provider.tinymodel`, the
~394 MB `medium` preset by default) and are driven by the same async client code (the `openai`
SDK, streaming, greedy, `stream_options.include_usage`). Three workloads, each at concurrency
1 / 4 / 8:

* ``w1``: distinct ~110-token chats (fresh prompts for every cell and repeat: nothing to reuse but
  the template's first tokens);
* ``w2``: one shared 709-token system prompt and distinct short questions;
* ``chat``: a 6-turn conversation per client (a ~1,500-token first message, short follow-ups),
  each turn sending back the previous answer as the server streamed it.

Sides run interleaved per cell and repeat (A B, then B A, ...; never all of one side first), and
every request's `usage.prompt_tokens` must be equal on both sides (else the run stops). A bare
`mlx_lm` `BatchGenerator` loop in this process on the same prompts, all inserted at t0, is the
ceiling for w1 and w2. Per run the table below the results shows the 1-minute load average and
the CPU seconds used by processes other than the two servers and this driver, so a noisy run can
be seen.

Chat turns follow each other at once by default; `--think-s` puts a pause between an answer and
the next turn, as a person reading and typing does. TTFT is timed from the send either way, and
chat tok/s is then not comparable across think times (the pauses are in the wall time). With a
pause, `serve --local` prepares the next turn while idle (`prepare_next_turn`: the answer as the
template renders it back is prefilled), so the turn prefills only the new message.

Reading the chat rows: a turn can reuse the previous answer only when the template renders the
streamed answer back to the tokens the model generated. The tiny random models often generate
token runs their BPE tokenizer would split differently (and mlx-lm's detokenizer drops an answer's
leading space), so there both servers reuse the previous prompt only; `reuse` shows which case a
run was.

Columns: aggregate tok/s = completion tokens of all requests / wall time from t0 to the last
stream's end; TTFT = t0 (or the turn's send) to the first content delta, p50 over the requests;
chat TTFT t2-6 = p50 over turns 2-6 of every conversation. Ratios are medians of per-repeat
ratios. `reuse` = prompt tokens served from the prefix cache / prompt tokens (ours: /status
`reused_tokens`; mlx_lm.server: `usage.prompt_tokens_details.cached_tokens`).

    python benchmarks/peer_bench.py [--preset medium] [--repeats 6] [--concurrency 1,4,8]
                                    [--chat-concurrency 1] [--workloads w1,w2,chat]
                                    [--max-tokens 64] [--turn-tokens 64] [--think-s 0]

Run it with OpenBLAS preloaded (`sh tools/with-blas.sh .venv/bin/python benchmarks/peer_bench.py`);
both servers inherit the environment, so they use the same BLAS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from provider.tinymodel import build_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OURS, PEER, BARE = "ours", "mlx_lm.server", "bare"
MODEL_ID = "bench/peer-model"
WORDS = ("river mountain apple stream batch model token quiet room copper wire north wind paper boat "
         "window salt stone memory cache late train green blue seven hundred small open garden lamp "
         "silver market winter summer harbor bridge candle forest meadow thunder valley orchard").split()
TURNS = 6
SYSTEM_TOKENS = 709
FIRST_MESSAGE_TOKENS = 1500
W1_TOKENS = 110


# -- prompts -----------------------------------------------------------------------------------

class Prompts:
    """Chat messages of a target templated length, built with the model's own tokenizer."""

    def __init__(self, model_path: Path) -> None:
        from mlx_lm.utils import load_tokenizer
        self._tok = load_tokenizer(model_path)  # the wrapper both servers template with
        self.system = {"role": "system", "content": self._text_for(SYSTEM_TOKENS, random.Random("system"))}

    def count(self, messages: list[dict[str, str]]) -> int:
        return len(self._tok.apply_chat_template(messages, add_generation_prompt=True))

    def _text_for(self, tokens: int, rng: random.Random, wrap=lambda t: [{"role": "user", "content": t}]) -> str:
        words: list[str] = []
        while self.count(wrap(" ".join(words))) < tokens:
            words.extend(rng.choice(WORDS) for _ in range(8))
        while len(words) > 1 and self.count(wrap(" ".join(words[:-1]))) >= tokens:
            words.pop()
        return " ".join(words)

    def w1(self, c: int, repeat: int, i: int) -> list[dict[str, str]]:
        text = self._text_for(W1_TOKENS, random.Random(f"w1/{c}/{repeat}/{i}"))
        return [{"role": "user", "content": text}]

    def w2(self, c: int, repeat: int, i: int) -> list[dict[str, str]]:
        rng = random.Random(f"w2/{c}/{repeat}/{i}")
        return [self.system, {"role": "user", "content": "Tell me about " + " ".join(rng.choices(WORDS, k=6)) + "."}]

    def first_message(self, c: int, repeat: int, i: int) -> str:
        return self._text_for(FIRST_MESSAGE_TOKENS, random.Random(f"chat/{c}/{repeat}/{i}"))

    @staticmethod
    def follow_up(turn: int, i: int) -> str:
        rng = random.Random(f"follow/{turn}/{i}")
        return "And what about " + " ".join(rng.choices(WORDS, k=5)) + "?"


# -- measurements ------------------------------------------------------------------------------

@dataclass
class Request:
    ttft: float  # seconds from send to the first content delta
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    text: str
    turn: int = 0


@dataclass
class Run:
    side: str
    workload: str
    c: int
    repeat: int
    wall: float
    requests: list[Request]
    load1: float = 0.0
    others_cpu_s: float = 0.0
    reused_tokens: int | None = None  # ours: from /status

    @property
    def tokens(self) -> int:
        return sum(r.completion_tokens for r in self.requests)

    @property
    def tps(self) -> float:
        return self.tokens / self.wall

    def ttft_p50(self, turns: range | None = None) -> float:
        return statistics.median(r.ttft for r in self.requests if turns is None or r.turn in turns)

    @property
    def reuse(self) -> float | None:
        prompt = sum(r.prompt_tokens for r in self.requests)
        if self.reused_tokens is not None:
            return self.reused_tokens / prompt
        cached = [r.cached_tokens for r in self.requests]
        return None if any(c is None for c in cached) else sum(cached) / prompt


class CpuWatch:
    """CPU seconds used by processes other than ours over one run, and the load average."""

    def __init__(self, own_pids: list[int]) -> None:
        self._own = [psutil.Process(p) for p in own_pids]

    def _busy(self) -> float:
        t = psutil.cpu_times()
        return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)

    def _ours(self) -> float:
        total = 0.0
        for p in self._own:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    async def around(self, run: Callable[[], Awaitable[Run]]) -> Run:
        busy, ours = self._busy(), self._ours()
        result = await run()
        result.others_cpu_s = max(0.0, (self._busy() - busy) - (self._ours() - ours))
        result.load1 = os.getloadavg()[0]
        return result


# -- the two servers ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)  # a readiness poll across processes: there is no other signal
    raise RuntimeError(f"{url}: not ready within {timeout_s:.0f} s")


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    base_url: str
    model: str
    status_url: str | None = None
    client: AsyncOpenAI = field(init=False)

    def __post_init__(self) -> None:
        self.client = AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="bench", max_retries=0, timeout=600)

    def reused_tokens(self) -> int | None:
        if self.status_url is None:
            return None
        with urllib.request.urlopen(self.status_url, timeout=10) as r:
            return json.loads(r.read())["prefix_cache"]["reused_tokens"]

    async def close(self) -> int:
        await self.client.close()
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_peer(model_path: Path, work: Path) -> Server:
    port = free_port()
    hub = work / "hf-hub"  # mlx_lm.server's /v1/models needs the hub cache folder to exist
    hub.mkdir(exist_ok=True)
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(model_path),
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
                            env=env, stdout=subprocess.DEVNULL, stderr=(work / "peer.log").open("wb"))
    base = f"http://127.0.0.1:{port}"
    wait_ready(base + "/health", proc)
    return Server(PEER, proc, base, "default_model")


def start_ours(model_path: Path, work: Path) -> Server:
    port = free_port()
    hub = work / "empty-hub"
    hub.mkdir(exist_ok=True)
    config = work / "provider.toml"
    config.write_text(
        f"local_port = {port}\n"
        f"hf_cache_dir = {json.dumps(str(hub))}\n"
        f"state_dir = {json.dumps(str(work / 'state'))}\n"
        "log_level = \"warning\"\nlog_format = \"json\"\nidle_timeout_mins = 0\n"
        "[model_aliases]\n"
        f"{json.dumps(MODEL_ID)} = {json.dumps(str(model_path))}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DARKBLOOM_")}
    proc = subprocess.Popen([sys.executable, "-m", "provider.cli", "--config", str(config), "serve", "--local"],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=(work / "ours.log").open("wb"))
    base = f"http://127.0.0.1:{port}"
    wait_ready(base + "/healthz", proc)
    return Server(OURS, proc, base, MODEL_ID, status_url=base + "/status")


# -- one request, one run ----------------------------------------------------------------------

async def ask(server: Server, messages: list[dict[str, str]], max_tokens: int, turn: int = 0) -> Request:
    t0 = time.perf_counter()
    stream = await server.client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    ttft, parts, usage = None, [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError(f"{server.name}: a stream ended without usage")
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return Request(ttft if ttft is not None else time.perf_counter() - t0, usage.prompt_tokens,
                   usage.completion_tokens, cached, "".join(parts), turn)


async def single_shot(server: Server, batch: list[list[dict[str, str]]], max_tokens: int) -> tuple[float, list[Request]]:
    t0 = time.perf_counter()
    requests = await asyncio.gather(*(ask(server, m, max_tokens) for m in batch))
    return time.perf_counter() - t0, list(requests)


async def conversations(server: Server, prompts: Prompts, c: int, repeat: int,
                        max_tokens: int, think_s: float = 0.0) -> tuple[float, list[Request]]:
    async def one(i: int) -> list[Request]:
        history = [{"role": "user", "content": prompts.first_message(c, repeat, i)}]
        done = []
        for turn in range(1, TURNS + 1):
            if turn > 1 and think_s > 0:
                await asyncio.sleep(think_s)  # the user reading and typing (a modelled pause, not a sync)
            r = await ask(server, history, max_tokens, turn)
            done.append(r)
            history = history + [{"role": "assistant", "content": r.text},
                                 {"role": "user", "content": prompts.follow_up(turn, i)}]
        return done

    t0 = time.perf_counter()
    per_conversation = await asyncio.gather(*(one(i) for i in range(c)))
    return time.perf_counter() - t0, [r for conv in per_conversation for r in conv]


async def server_run(server: Server, prompts: Prompts, workload: str, c: int, repeat: int, args) -> Run:
    before = server.reused_tokens()
    if workload == "chat":
        wall, requests = await conversations(server, prompts, c, repeat, args.turn_tokens, args.think_s)
    else:
        batch = [getattr(prompts, workload)(c, repeat, i) for i in range(c)]
        wall, requests = await single_shot(server, batch, args.max_tokens)
    after = server.reused_tokens()
    return Run(server.name, workload, c, repeat, wall, requests,
               reused_tokens=None if before is None else after - before)


class Bare:
    """mlx-lm's BatchGenerator alone, in this process: all prompts inserted at t0, stepped to the end."""

    def __init__(self, model_path: Path) -> None:
        import mlx_lm
        self.model, self.tokenizer = mlx_lm.load(str(model_path))

    def run(self, batch: list[list[dict[str, str]]], max_tokens: int, workload: str, c: int, repeat: int) -> Run:
        from mlx_lm.generate import BatchGenerator
        prompts = [list(self.tokenizer.apply_chat_template(m, add_generation_prompt=True)) for m in batch]
        eos = sorted(self.tokenizer.eos_token_ids)
        gen = BatchGenerator(self.model, stop_tokens=[[t] for t in eos])
        try:
            t0 = time.perf_counter()
            uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
            first: dict[int, float] = {}
            counts = dict.fromkeys(uids, 0)
            left = set(uids)
            while left:
                for r in gen.next_generated():
                    first.setdefault(r.uid, time.perf_counter() - t0)
                    if not (r.finish_reason == "stop"):  # the EOS token is not a completion token
                        counts[r.uid] += 1
                    if r.finish_reason is not None:
                        left.discard(r.uid)
            wall = time.perf_counter() - t0
        finally:
            gen.close()
        requests = [Request(first[u], len(p), counts[u], None, "") for u, p in zip(uids, prompts, strict=True)]
        return Run(BARE, workload, c, repeat, wall, requests)


# -- the driver --------------------------------------------------------------------------------

def check_same_prompts(a: Run, b: Run) -> None:
    pa = [(r.turn, r.prompt_tokens) for r in a.requests]
    pb = [(r.turn, r.prompt_tokens) for r in b.requests]
    if sorted(pa) != sorted(pb):
        raise SystemExit(f"{a.workload} c={a.c} repeat {a.repeat}: usage.prompt_tokens differ between the sides")


def med(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def ratio(runs: dict, side: str, base: str, key) -> float:
    pairs = [(runs[(side, r)], runs[(base, r)]) for (s, r) in runs if s == side and (base, r) in runs]
    return med([key(x) / key(y) for x, y in pairs])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium", choices=["tiny", "small", "medium"])
    parser.add_argument("--model-dir", type=Path, default=None, help="an existing tiny-model folder instead")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--chat-concurrency", default=None, help="levels for the chat workload (default: --concurrency)")
    parser.add_argument("--workloads", default="w1,w2,chat")
    parser.add_argument("--max-tokens", type=int, default=64, help="per w1/w2 request")
    parser.add_argument("--think-s", type=float, default=0.0,
                        help="chat: seconds between an answer and the next turn (a user reading and typing); "
                             "TTFT is timed from the send either way")
    parser.add_argument("--turn-tokens", type=int, default=64, help="per chat turn (128 can outgrow the 4096-token context: answers from random weights re-tokenize into more tokens)")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    chat_levels = [int(x) for x in (args.chat_concurrency or args.concurrency).split(",")]
    workloads = args.workloads.split(",")
    cells = [(w, c) for w in workloads for c in (chat_levels if w == "chat" else levels)]

    # Absolute: the agent reads its alias from a config file in a temporary folder, where a relative
    # path would resolve to nothing.
    model_path = args.model_dir.resolve() if args.model_dir else build_tiny_model(
        REPO / ".cache" / "tiny-models" / f"{args.preset}-f32", preset=args.preset)
    prompts = Prompts(model_path)
    bare = Bare(model_path) if {"w1", "w2"} & set(workloads) else None
    work = Path(tempfile.mkdtemp(prefix="peer-bench-"))
    peer = start_peer(model_path, work)
    ours = start_ours(model_path, work)
    servers = {OURS: ours, PEER: peer}
    watch = CpuWatch([os.getpid(), ours.proc.pid, peer.proc.pid])
    runs: dict[tuple[str, int], dict[tuple[str, int], Run]] = {}  # (workload, c) -> (side, repeat) -> run
    log: list[Run] = []
    try:
        for server in servers.values():  # warm-up: ours loads the model on its first request
            await single_shot(server, [prompts.w1(0, -1, 0)], 4)
        started = time.monotonic()
        for repeat in range(args.repeats):
            for cell, (workload, c) in enumerate(cells):
                order = [OURS, PEER] if (repeat + cell) % 2 == 0 else [PEER, OURS]
                cell_runs = runs.setdefault((workload, c), {})
                if bare is not None and workload != "chat":
                    batch = [getattr(prompts, workload)(c, repeat, i) for i in range(c)]
                    cell_runs[(BARE, repeat)] = await watch.around(
                        lambda: asyncio.to_thread(bare.run, batch, args.max_tokens, workload, c, repeat))
                    log.append(cell_runs[(BARE, repeat)])
                for side in order:
                    run = await watch.around(lambda: server_run(servers[side], prompts, workload, c, repeat, args))
                    cell_runs[(side, repeat)] = run
                    log.append(run)
                check_same_prompts(cell_runs[(OURS, repeat)], cell_runs[(PEER, repeat)])
            print(f"repeat {repeat + 1}/{args.repeats} done ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    finally:
        codes = {name: await s.close() for name, s in servers.items()}
    report(args, model_path, runs, log, codes)


def report(args, model_path: Path, runs, log: list[Run], codes: dict[str, int]) -> None:
    blas = "OpenBLAS (preloaded)" if "openblas" in os.environ.get("LD_PRELOAD", "") else "MLX's bundled BLAS"
    print(f"\n{model_path.name}, {args.repeats} interleaved repeats, greedy, w1/w2 {args.max_tokens} tokens, "
          f"chat {TURNS} turns x {args.turn_tokens} tokens, {args.think_s:g} s between turns; BLAS: {blas}; server exit codes {codes}\n")
    print("| workload | c | ours tok/s | server tok/s | bare tok/s | ours ÷ bare tok/s | server ÷ bare | "
          "ours ÷ server tok/s | ours ÷ server TTFT p50 | reuse ours / server |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (workload, c), cell in runs.items():
        def side_med(side, key):
            return med([key(run) for (s, _), run in cell.items() if s == side])

        has_bare = any(s == BARE for s, _ in cell)
        tps = {s: side_med(s, lambda r: r.tps) for s in (OURS, PEER, BARE)}
        bare_cols = (f"{tps[BARE]:.1f} | {ratio(cell, OURS, BARE, lambda r: r.tps):.3f} | "
                     f"{ratio(cell, PEER, BARE, lambda r: r.tps):.3f}") if has_bare else "— | — | —"
        if workload == "chat":
            turns = range(2, TURNS + 1)
            ttft = (f"t1 {ratio(cell, OURS, PEER, lambda r: r.ttft_p50(range(1, 2))):.2f}, "
                    f"t2-6 **{ratio(cell, OURS, PEER, lambda r: r.ttft_p50(turns)):.2f}**")
        else:
            ttft = f"{ratio(cell, OURS, PEER, lambda r: r.ttft_p50()):.2f}"
        reuse = f"{side_med(OURS, lambda r: r.reuse):.2f} / {side_med(PEER, lambda r: r.reuse):.2f}"
        print(f"| {workload} | {c} | {tps[OURS]:.1f} | {tps[PEER]:.1f} | {bare_cols} | "
              f"{ratio(cell, OURS, PEER, lambda r: r.tps):.3f} | {ttft} | {reuse} |")
    print("\nper run (noise): side workload c repeat | wall s | tok/s | TTFT p50 ms | load1 | other processes' CPU s")
    for run in log:
        print(f"  {run.side:<14} {run.workload:<4} {run.c} r{run.repeat} | {run.wall:7.2f} | {run.tps:7.1f} | "
              f"{run.ttft_p50() * 1000:8.0f} | {run.load1:5.2f} | {run.others_cpu_s:6.1f}")


if __name__ == "__main__":
    asyncio.run(main())
