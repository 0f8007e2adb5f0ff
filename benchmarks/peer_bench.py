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
`reused_tokens`; mlx_lm.server: `usage.prompt_tokens_details.cached_tokens`). A second table gives
per side TTFT p50 and p99 (medians over the repeats of each run's percentile) and the CPU seconds
the side's processes (the server and its children; bare: this process) used in a run.

    python benchmarks/peer_bench.py [--preset medium] [--repeats 6] [--concurrency 1,4,8]
                                    [--chat-concurrency 1] [--workloads w1,w2,chat]
                                    [--max-tokens 64] [--turn-tokens 64] [--think-s 0]

Run it with OpenBLAS preloaded (`sh tools/with-blas.sh .venv/bin/python benchmarks/peer_bench.py`);
both servers inherit the environment, so they use the same BLAS.

For a GPU (benchmarks/gpu_run.sh runs it so; the defaults above are the CPU table's):

* `--model-dir PATH` an existing model folder (e.g. `python -m provider.tinymodel PATH --preset 1b
  --no-eos`), or `--preset 1b|8b [--no-eos]` to build one under .cache/tiny-models;
* `--batch-size N`: one decode batch size for every side (ours `max_batch_size`, mlx_lm.server
  `--decode-concurrency`, the bare `BatchGenerator`'s `completion_batch_size`; prefill batches
  min(8, N) on the two mlx-lm sides, as ours does). Unset: each side's default (32 for all three),
  raised to the largest concurrency level when that is above 32;
* `--warmup cells`: before the timed cells, every cell once per side, untimed, with
  `--warmup-tokens` tokens (chat: its first turn, at most 8 conversations), so MLX's kernels are
  compiled for every shape (`one`, the default, sends a single short request per server);
* `--deadline-s S`: no cell starts S seconds after the start; what ran is reported; `--stop-s S`
  (or a SIGTERM, e.g. from `timeout`) cancels the cell under way and reports the rest;
* `--json-out PATH`: rewritten after every cell: `requests` (one record per request: side,
  workload, concurrency, repeat, turn, start_s / end_s from the run's start, ttft_s from the
  request's send, prompt / completion / cached tokens, max_tokens, error), `runs` (per side and
  cell: wall, tok/s, TTFT p50 / p99, CPU seconds) and `summary` (the tables' values);
* `--ours-toml LINE` (repeatable) adds a line to our server's config, e.g. `kv_ssd_budget_gb = 0`.

mlx_lm.server is started through `benchmarks/mlx_lm_server_backlog.py`, which gives its HTTP
server a listen backlog of 256 (the standard library's is 5: clients beyond it wait for a SYN
retransmit). A request that fails (a 503, a dropped connection) is recorded with its error and
the run goes on; a chat conversation ends at its failed turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import openai  # noqa: E402
import psutil  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from gil_sample import GilCounts, GilSampler  # noqa: E402
from peer_report import BARE, OURS, PEER, TURNS, pct, print_tables, write_json  # noqa: E402
from provider.tinymodel import PRESETS, build_tiny_model, weights_bytes  # noqa: E402

STARTED = time.monotonic()  # --deadline-s counts from here
REPO = Path(__file__).resolve().parent.parent
PREFILL_BATCH = 8  # mlx-lm's prefill_batch_size default, which ours uses too (capped by the batch size)
MODEL_ID = "bench/peer-model"
WORDS = ("river mountain apple stream batch model token quiet room copper wire north wind paper boat "
         "window salt stone memory cache late train green blue seven hundred small open garden lamp "
         "silver market winter summer harbor bridge candle forest meadow thunder valley orchard").split()
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
    start: float = 0.0  # send, seconds since the run's t0
    end: float = 0.0  # the stream's end, seconds since the run's t0
    max_tokens: int = 0
    error: str | None = None  # e.g. "APIStatusError 503"; the request produced nothing usable


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
    side_cpu_s: float = 0.0  # the side's own processes (the server and its children; bare: this process)
    reused_tokens: int | None = None  # ours: from /status

    @property
    def ok(self) -> list[Request]:
        return [r for r in self.requests if r.error is None]

    @property
    def errors(self) -> int:
        return len(self.requests) - len(self.ok)

    @property
    def short(self) -> int:
        """Answered requests that ended before max_tokens (an EOS, the context full)."""
        return sum(1 for r in self.ok if r.completion_tokens < r.max_tokens)

    @property
    def tokens(self) -> int:
        return sum(r.completion_tokens for r in self.requests)

    @property
    def tps(self) -> float:
        return self.tokens / self.wall

    def _ttfts(self, turns: range | None) -> list[float]:
        return [r.ttft for r in self.ok if turns is None or r.turn in turns] or [float("nan")]

    def ttft_p50(self, turns: range | None = None) -> float:
        return statistics.median(self._ttfts(turns))

    def ttft_p99(self, turns: range | None = None) -> float:
        return pct(self._ttfts(turns), 99)

    @property
    def reuse(self) -> float | None:
        prompt = sum(r.prompt_tokens for r in self.requests)
        if not prompt:
            return None
        if self.reused_tokens is not None:
            return self.reused_tokens / prompt
        cached = [r.cached_tokens for r in self.requests]
        return None if any(c is None for c in cached) else sum(cached) / prompt


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live children."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class CpuWatch:
    """Per run: CPU seconds of the side's own processes, of processes other than the bench's, and
    the load average."""

    def __init__(self, own_pids: list[int]) -> None:
        self._own = own_pids

    def _busy(self) -> float:
        t = psutil.cpu_times()
        return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)

    def _ours(self) -> float:
        return sum(tree_cpu_s(p) for p in self._own)

    async def around(self, run: Callable[[], Awaitable[Run]], side_pid: int) -> Run:
        busy, ours, side = self._busy(), self._ours(), tree_cpu_s(side_pid)
        result = await run()
        result.side_cpu_s = tree_cpu_s(side_pid) - side
        result.others_cpu_s = max(0.0, (self._busy() - busy) - (self._ours() - ours))
        result.load1 = os.getloadavg()[0]
        return result


# -- the two servers ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    """Poll until `url` answers 200; a server that never does is stopped before the error."""
    try:
        _poll_ready(url, proc, timeout_s)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _poll_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
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
            # None if /status changed shape: reuse then comes from usage's cached_tokens
            return json.loads(r.read()).get("prefix_cache", {}).get("reused_tokens")

    async def close(self) -> int:
        await self.client.close()
        self.proc.terminate()
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_peer(model_path: Path, work: Path, batch_size: int | None) -> Server:
    port = free_port()
    hub = work / "hf-hub"  # mlx_lm.server's /v1/models needs the hub cache folder to exist
    hub.mkdir(exist_ok=True)
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    batch = [] if batch_size is None else ["--decode-concurrency", str(batch_size),
                                           "--prompt-concurrency", str(min(PREFILL_BATCH, batch_size))]
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "mlx_lm_server_backlog.py"),
                             "--model", str(model_path), "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "WARNING", *batch],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=(work / "peer.log").open("wb"))
    base = f"http://127.0.0.1:{port}"
    wait_ready(base + "/health", proc)
    return Server(PEER, proc, base, "default_model")


def start_ours(model_path: Path, work: Path, batch_size: int | None, extra_toml: list[str],
               root: Path | None = None, side: str = OURS) -> Server:
    port = free_port()
    name = "ours" if side == OURS else "peer"  # its files: <name>.toml, <name>.log
    hub = work / "empty-hub"
    hub.mkdir(exist_ok=True)
    config = work / ("provider.toml" if side == OURS else f"{name}-provider.toml")
    config.write_text(  # an --ours-toml log_level (e.g. "info": one line per request) replaces the default
        f"local_port = {port}\n"
        f"hf_cache_dir = {json.dumps(str(hub))}\n"
        f"state_dir = {json.dumps(str(work / ('state' if side == OURS else 'peer-state')))}\n"
        + ("" if any(line.split("=")[0].strip() == "log_level" for line in extra_toml) else "log_level = \"warning\"\n")
        + "log_format = \"json\"\nidle_timeout_mins = 0\n"
        + ("" if batch_size is None else f"max_batch_size = {batch_size}\n")
        + "".join(f"{line}\n" for line in extra_toml)
        + "[model_aliases]\n"
        f"{json.dumps(MODEL_ID)} = {json.dumps(str(model_path))}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DARKBLOOM_")}
    proc = subprocess.Popen([sys.executable, "-m", "provider.cli", "--config", str(config), "serve", "--local"],
                            env=env, cwd=root or REPO, stdout=subprocess.DEVNULL,
                            stderr=(work / f"{name}.log").open("wb"))
    base = f"http://127.0.0.1:{port}"
    wait_ready(base + "/healthz", proc)
    return Server(side, proc, base, MODEL_ID, status_url=base + "/status")


# -- one request, one run ----------------------------------------------------------------------

async def ask(server: Server, messages: list[dict[str, str]], max_tokens: int, turn: int = 0,
              run_t0: float | None = None) -> Request:
    t0 = time.perf_counter()
    run_t0 = t0 if run_t0 is None else run_t0
    ttft, parts, usage = None, [], None
    try:
        stream = await server.client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    except openai.APIError as exc:  # a refusal or a dropped stream: recorded, the run goes on
        status = getattr(exc, "status_code", None)
        return Request(float("nan"), 0, 0, None, "", turn, t0 - run_t0, time.perf_counter() - run_t0,
                       max_tokens, f"{type(exc).__name__}{'' if status is None else f' {status}'}")
    end = time.perf_counter()
    if usage is None:
        raise RuntimeError(f"{server.name}: a stream ended without usage")
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return Request(ttft if ttft is not None else end - t0, usage.prompt_tokens,
                   usage.completion_tokens, cached, "".join(parts), turn, t0 - run_t0, end - run_t0, max_tokens)


async def single_shot(server: Server, batch: list[list[dict[str, str]]], max_tokens: int) -> tuple[float, list[Request]]:
    t0 = time.perf_counter()
    requests = await asyncio.gather(*(ask(server, m, max_tokens, run_t0=t0) for m in batch))
    return time.perf_counter() - t0, list(requests)


async def conversations(server: Server, prompts: Prompts, c: int, repeat: int,
                        max_tokens: int, think_s: float = 0.0) -> tuple[float, list[Request]]:
    async def one(i: int) -> list[Request]:
        history = [{"role": "user", "content": prompts.first_message(c, repeat, i)}]
        done = []
        for turn in range(1, TURNS + 1):
            if turn > 1 and think_s > 0:
                await asyncio.sleep(think_s)  # the user reading and typing (a modelled pause, not a sync)
            r = await ask(server, history, max_tokens, turn, run_t0=t0)
            done.append(r)
            if r.error is not None:
                break  # no answer to send back: the conversation ends here
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
               reused_tokens=None if before is None or after is None else after - before)


class Bare:
    """mlx-lm's BatchGenerator alone, in this process: all prompts inserted at t0, stepped to the end."""

    def __init__(self, model_path: Path, batch_size: int | None) -> None:
        import mlx_lm
        self.model, self.tokenizer = mlx_lm.load(str(model_path))
        self._sizes = {} if batch_size is None else {
            "completion_batch_size": batch_size, "prefill_batch_size": min(PREFILL_BATCH, batch_size)}

    def run(self, batch: list[list[dict[str, str]]], max_tokens: int, workload: str, c: int, repeat: int) -> Run:
        from mlx_lm.generate import BatchGenerator
        prompts = [list(self.tokenizer.apply_chat_template(m, add_generation_prompt=True)) for m in batch]
        eos = sorted(self.tokenizer.eos_token_ids)
        gen = BatchGenerator(self.model, stop_tokens=[[t] for t in eos], **self._sizes)
        try:
            t0 = time.perf_counter()
            uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
            first: dict[int, float] = {}
            ends: dict[int, float] = {}
            counts = dict.fromkeys(uids, 0)
            left = set(uids)
            while left:
                for r in gen.next_generated():
                    first.setdefault(r.uid, time.perf_counter() - t0)
                    if not (r.finish_reason == "stop"):  # the EOS token is not a completion token
                        counts[r.uid] += 1
                    if r.finish_reason is not None:
                        left.discard(r.uid)
                        ends[r.uid] = time.perf_counter() - t0
            wall = time.perf_counter() - t0
        finally:
            gen.close()
        requests = [Request(first[u], len(p), counts[u], None, "", end=ends[u], max_tokens=max_tokens)
                    for u, p in zip(uids, prompts, strict=True)]
        return Run(BARE, workload, c, repeat, wall, requests)


# -- the driver --------------------------------------------------------------------------------

class PromptMismatch(Exception):
    """The two servers counted different prompt lengths: their numbers are not comparable."""


def check_same_prompts(a: Run, b: Run) -> None:
    if a.errors or b.errors:
        print(f"{a.workload} c={a.c} repeat {a.repeat}: failed requests (ours {a.errors}, "
              f"server {b.errors}): prompt lengths not compared", file=sys.stderr)
        return
    pa = [(r.turn, r.prompt_tokens) for r in a.requests]
    pb = [(r.turn, r.prompt_tokens) for r in b.requests]
    if sorted(pa) == sorted(pb):
        return
    if a.workload == "chat" and sorted(p for p in pa if p[0] <= 1) == sorted(p for p in pb if p[0] <= 1):
        # A later turn sends back the side's own answer: in bf16 on a GPU a batch of another shape
        # may break a near-tie the other way, so the answers (and the next prompts) can differ.
        print(f"chat c={a.c} repeat {a.repeat}: later turns' prompts differ (the sides answered differently)",
              file=sys.stderr)
        return
    raise PromptMismatch(f"{a.workload} c={a.c} repeat {a.repeat}: usage.prompt_tokens differ between the sides")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="an existing model folder instead (e.g. python -m provider.tinymodel PATH --preset 1b --no-eos)")
    parser.add_argument("--no-eos", action="store_true", help="--preset: build it with EOS unreachable (greedy runs to max_tokens)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--chat-concurrency", default=None, help="levels for the chat workload (default: --concurrency)")
    parser.add_argument("--workloads", default="w1,w2,chat")
    parser.add_argument("--max-tokens", type=int, default=64, help="per w1/w2 request")
    parser.add_argument("--think-s", type=float, default=0.0,
                        help="chat: seconds between an answer and the next turn (a user reading and typing); "
                             "TTFT is timed from the send either way")
    parser.add_argument("--turn-tokens", type=int, default=64, help="per chat turn (128 can outgrow the 4096-token context: answers from random weights re-tokenize into more tokens)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="decode batch size of every side (ours max_batch_size, mlx_lm.server --decode-concurrency, "
                             "the bare BatchGenerator's completion_batch_size); default: each side's own (32)")
    parser.add_argument("--warmup", choices=("one", "cells"), default="one",
                        help="one: a short request per server; cells: every cell once per side, untimed")
    parser.add_argument("--warmup-tokens", type=int, default=8, help="--warmup cells: tokens per request")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no cell after this many seconds (from the start); report what ran")
    parser.add_argument("--stop-s", type=float, default=None,
                        help="cancel the cell under way after this many seconds (from the start) and report")
    parser.add_argument("--json-out", type=Path, default=None, help="per-request records, runs and summary (rewritten per cell)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="the servers' logs, config and state (default: a new temporary folder)")
    parser.add_argument("--ours-toml", action="append", default=[], metavar="LINE",
                        help="a line for our server's config, e.g. 'kv_ssd_budget_gb = 0' (repeatable)")
    parser.add_argument("--peer-root", type=Path, default=None, metavar="DIR",
                        help="the other side is our own server run from another checkout (e.g. a git worktree of an "
                             "earlier commit) instead of mlx_lm.server: an A/B of two versions, 'server' columns the other")
    parser.add_argument("--peer-toml", action="append", default=None, metavar="LINE",
                        help="with --peer-root: the other side's config lines instead of --ours-toml's, e.g. "
                             "--peer-root . --ours-toml 'kv_quantization = \"q8\"' --peer-toml 'kv_quantization = \"none\"': "
                             "one setting against another on the same checkout")
    parser.add_argument("--gil-cells", default="", metavar="W:C,...",
                        help="sample our server's GIL holders with py-spy while these cells run on our side, e.g. "
                             "w1:32,w1:64 (benchmarks/gil_sample.py); the shares are printed and saved")
    args = parser.parse_args(argv)
    if args.peer_toml is not None and args.peer_root is None:
        parser.error("--peer-toml needs --peer-root (the other side is mlx_lm.server otherwise)")
    return args


def model_folder(args: argparse.Namespace) -> Path:
    # Absolute: the agent reads its alias from a config file in a temporary folder, where a relative
    # path would resolve to nothing.
    if args.model_dir:
        if not (args.model_dir / "config.json").is_file():
            raise SystemExit(f"{args.model_dir}: no config.json (not a model folder)")
        return args.model_dir.resolve()
    dtype = PRESETS[args.preset].dtype
    name = f"{args.preset}-{'f32' if dtype == 'float32' else 'bf16'}{'-noeos' if args.no_eos else ''}"
    return build_tiny_model(REPO / ".cache" / "tiny-models" / name, preset=args.preset, no_eos=args.no_eos)


def describe(args: argparse.Namespace, model_path: Path, batch_size: int | None) -> dict:
    import mlx.core as mx
    import mlx_lm

    info = {k: v for k, v in mx.device_info().items() if isinstance(v, int | float | str)}
    config = json.loads((model_path / "config.json").read_text())
    return {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": str(model_path), "weights_bytes": weights_bytes(model_path),
            "model_config": {k: config.get(k) for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                        "num_attention_heads", "num_key_value_heads", "vocab_size",
                                                        "max_position_embeddings", "torch_dtype", "quantization")},
            "batch_size": batch_size, "device": str(mx.default_device()), "device_info": info,
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "python": sys.version.split()[0]}


def cell_batch(prompts: Prompts, workload: str, c: int, repeat: int) -> list[list[dict[str, str]]]:
    if workload == "chat":  # the first turn only (the warm-up's)
        return [[{"role": "user", "content": prompts.first_message(c, repeat, i)}] for i in range(c)]
    return [getattr(prompts, workload)(c, repeat, i) for i in range(c)]


class Deadline:
    def __init__(self, seconds: float | None) -> None:
        self._at = None if seconds is None else STARTED + seconds

    def passed(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at


@dataclass
class Bench:
    """One run's means and what it measured so far (what a stop still reports)."""

    args: argparse.Namespace
    prompts: Prompts
    bare: Bare | None
    servers: dict[str, Server]
    cells: list[tuple[str, int]]
    deadline: Deadline
    save: Callable[[], None]
    runs: dict[tuple[str, int], dict[tuple[str, int], Run]] = field(default_factory=dict)  # (workload, c) -> (side, repeat) -> run
    log: list[Run] = field(default_factory=list)
    doing: str = "the warm-up"  # what is under way, for a stop's message
    gil: dict[tuple[str, int], GilCounts] = field(default_factory=dict)  # --gil-cells: counts per cell

    async def _ours_run(self, workload: str, c: int, run: Callable[[], Awaitable[Run]]) -> Run:
        """Our side's run of a cell, with our server's GIL holders sampled when the cell is one of --gil-cells."""
        if f"{workload}:{c}" not in self.args.gil_cells.split(","):
            return await run()
        sampler = GilSampler(self.servers[OURS].proc.pid, self.gil.setdefault((workload, c), GilCounts()))
        sampler.start()
        try:
            return await run()
        finally:
            await asyncio.to_thread(sampler.stop)

    async def measure(self) -> str | None:
        """Warm up, then the interleaved repeats. Returns why it stopped early (a deadline), or None."""
        args, servers, bare = self.args, self.servers, self.bare
        pids = {OURS: servers[OURS].proc.pid, PEER: servers[PEER].proc.pid, BARE: os.getpid()}
        watch = CpuWatch(list(pids.values()))
        stopped = await warm_up(args, servers, bare, self.prompts, self.cells, self.deadline)
        if stopped is not None:
            return stopped
        started = time.monotonic()
        for repeat in range(args.repeats):
            for cell, (workload, c) in enumerate(self.cells):
                self.doing = f"{workload} c={c} repeat {repeat + 1}"
                if self.deadline.passed():
                    return f"deadline ({args.deadline_s:g} s) before {self.doing}"
                order = [OURS, PEER] if (repeat + cell) % 2 == 0 else [PEER, OURS]
                cell_runs = self.runs.setdefault((workload, c), {})
                if bare is not None and workload != "chat":
                    batch = cell_batch(self.prompts, workload, c, repeat)
                    cell_runs[(BARE, repeat)] = await watch.around(
                        lambda: asyncio.to_thread(bare.run, batch, args.max_tokens, workload, c, repeat), pids[BARE])
                    self.log.append(cell_runs[(BARE, repeat)])
                for side in order:
                    def one(side=side):
                        return server_run(servers[side], self.prompts, workload, c, repeat, args)
                    if side == OURS:
                        run = await watch.around(lambda: self._ours_run(workload, c, one), pids[side])
                    else:
                        run = await watch.around(one, pids[side])
                    cell_runs[(side, repeat)] = run
                    self.log.append(run)
                check_same_prompts(cell_runs[(OURS, repeat)], cell_runs[(PEER, repeat)])
                self.save()
            print(f"repeat {repeat + 1}/{args.repeats} done ({time.monotonic() - started:.0f} s)", file=sys.stderr)
        return None


async def measure_until_stopped(bench: Bench) -> str | None:
    """`bench.measure()`, cancelled at --stop-s or on SIGTERM (e.g. from `timeout`): either way the
    runs so far are reported. Returns why it stopped early, or None."""
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(bench.measure())
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    timer = None
    if bench.args.stop_s is not None:
        timer = loop.call_later(max(0.0, STARTED + bench.args.stop_s - time.monotonic()), task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise  # this coroutine itself was cancelled: not a stop of ours
        return f"stopped (--stop-s or SIGTERM) during {bench.doing}; that cell is incomplete"
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        if timer is not None:
            timer.cancel()


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    chat_levels = [int(x) for x in (args.chat_concurrency or args.concurrency).split(",")]
    workloads = args.workloads.split(",")
    cells = [(w, c) for w in workloads for c in (chat_levels if w == "chat" else levels)]
    batch_size = args.batch_size
    if batch_size is None and max(c for _, c in cells) > 32:  # every side's default is 32
        batch_size = max(c for _, c in cells)
        print(f"--batch-size {batch_size} (the largest concurrency level) for every side", file=sys.stderr)

    model_path = model_folder(args)
    meta = describe(args, model_path, batch_size)
    prompts = Prompts(model_path)
    bare = Bare(model_path, batch_size) if {"w1", "w2"} & set(workloads) else None
    work = args.work_dir.resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="peer-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    servers: dict[str, Server] = {}
    stopped: str | None = None

    def save() -> None:
        if args.json_out is not None:
            gil = {f"{w}:{c}": counts.as_dict() for (w, c), counts in bench.gil.items()}
            write_json(args.json_out, {**meta, "stopped": stopped, "elapsed_s": time.monotonic() - STARTED,
                                       "gil": gil}, bench.runs, bench.log)

    bench = Bench(args, prompts, bare, servers, cells, Deadline(args.deadline_s), save)
    try:
        servers[PEER] = (start_peer(model_path, work, batch_size) if args.peer_root is None
                         else start_ours(model_path, work, batch_size,
                                         args.ours_toml if args.peer_toml is None else args.peer_toml,
                                         root=args.peer_root, side=PEER))
        servers[OURS] = start_ours(model_path, work, batch_size, args.ours_toml)
        stopped = await measure_until_stopped(bench)
    except Exception as exc:  # the edge of the run: report what was measured, then fail
        traceback.print_exc()
        stopped = f"{type(exc).__name__}: {exc}"
    finally:
        codes = {name: await s.close() for name, s in servers.items()}
    meta["server_exit_codes"] = codes
    save()
    blas = "OpenBLAS (preloaded)" if "openblas" in os.environ.get("LD_PRELOAD", "") else "MLX's bundled BLAS"
    batch = "each side's default" if batch_size is None else str(batch_size)
    print_tables(f"{model_path.name}, {args.repeats} interleaved repeats, greedy, w1/w2 {args.max_tokens} tokens, "
                 f"chat {TURNS} turns x {args.turn_tokens} tokens, {args.think_s:g} s between turns; BLAS: {blas}; "
                 f"server exit codes {codes}\ndevice {meta['device']} ({meta['device_info'].get('device_name', '?')}), "
                 f"decode batch size {batch}, warm-up {args.warmup}", bench.runs, bench.log, stopped)
    if bench.gil:
        print("\nour server's GIL holders while its engine was active (py-spy dump samples, benchmarks/gil_sample.py)\n")
        for (workload, c), counts in bench.gil.items():
            print(f"* {workload} c = {c}: {counts.line()}")
    return 1 if stopped is not None and not stopped.startswith(("deadline", "stopped")) else 0


async def warm_up(args, servers: dict[str, Server], bare: Bare | None, prompts: Prompts,
                  cells: list[tuple[str, int]], deadline: Deadline) -> str | None:
    """Untimed requests before the timed cells: ours loads the model on its first request, and MLX
    compiles its kernels on first use (per shape on a GPU). Returns why it stopped, if it did."""
    if args.warmup == "one":
        for server in servers.values():
            await single_shot(server, [prompts.w1(0, -1, 0)], 4)
        return None
    t0 = time.monotonic()
    # Chat warms its first turn only, at most a prefill batch of it: the long prompts are prefilled in
    # batches of min(8, N) whatever the concurrency, and the decode shapes are w1's and w2's.
    shapes = list(dict.fromkeys((w, min(c, PREFILL_BATCH) if w == "chat" else c) for w, c in cells))
    for workload, c in shapes:
        if deadline.passed():
            return f"deadline ({args.deadline_s:g} s) during the warm-up"
        batch = cell_batch(prompts, workload, c, -1)
        if bare is not None and workload != "chat":
            await asyncio.to_thread(bare.run, batch, args.warmup_tokens, workload, c, -1)
        for server in servers.values():
            _, requests = await single_shot(server, batch, args.warmup_tokens)
            failed = sum(r.error is not None for r in requests)
            if failed:
                print(f"warm-up {workload} c={c}: {server.name} failed {failed} of {len(requests)}", file=sys.stderr)
    print(f"warm-up: {len(shapes)} cells per side in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return None


if __name__ == "__main__":
    code = asyncio.run(main())
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is printed and written. The interpreter's teardown sometimes aborts in MLX's threads
    # ("terminate called without an active exception", exit 134; seen before --json-out too), which
    # would read as a failed run: leave without it.
    os._exit(code)
