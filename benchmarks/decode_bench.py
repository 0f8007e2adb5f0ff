"""Decode tok/s per batch size against the HBM roofline: bare BatchGenerator, plain loops, our Engine.

For each batch size B (1, 8, 32, 64 by default), B distinct chats of about --prompt-tokens
templated tokens, greedy, EOS off, three ways on the same model folder in this process:

* ``bare``: mlx-lm's `BatchGenerator` (completion_batch_size=B, prefill_batch_size=min(8, B)):
  insert all, `next_generated()` until done;
* ``ours``: ``bare`` with the engine's decode step (`provider.engine.decode.EngineBatchGenerator`);
* ``plain``: the same prompts left-padded into one `BatchKVCache` per layer, one prefill, then
  forward + argmax per step with the next step's `mx.async_eval` issued before the current token
  is read (mlx-lm's `generate_step` pipelining, batched): what the hardware gives a simple loop;
* ``plainkv``: the plain loop over mlx-lm's plain batched `KVCache`, the prompts cut to one length (no
  padding, no mask in a decode step: the fused attention path); beside ``plain`` it tells what the padded
  batch cache and its mask cost;
* ``engine``: `provider.engine.Engine(batch_size=max B)` (no prefix cache), B requests submitted
  at once, every stream read to its `Finished`: the agent's engine with its delivery.
  ``--kv-quantization none,q8,q4`` runs it once per setting (``engine``, ``engine-q8``, ``engine-q4``:
  the same folder loaded once per setting, its KV kept quantized as `kv_quantization` asks); the table's
  ``÷ engine`` column is each setting's tok/s over ``engine``'s in the same repeat.

Each way runs the batch twice, to --short-tokens and to --long-tokens tokens a sequence. Both runs
do the same prefill, so the difference of their wall times is (long - short) decode steps of the
whole batch, all after every first token (the steady state):

    decode tok/s = B x (long - short) / (T_long - T_short),   ms/step = (T_long - T_short) / (long - short)

A decode step reads every weight once and every sequence's KV, so it cannot be faster than
(weight bytes + B x context x KV bytes per token) / --bandwidth (default 4.8e12 B/s, an H200's HBM),
with context the mean over the measured steps (prompt + (short + long) / 2). `roofline` is B tokens
per that time; `share` = decode tok/s / roofline. Each cell is the median over --repeats repeats;
every (way, B) is warmed up first (MLX compiles kernels on first use). `--deadline-s` starts no run
after that many seconds and reports what ran; so does a SIGTERM.

    python benchmarks/decode_bench.py [--model-dir PATH | --preset tiny] [--batch-sizes 1,8,32,64]
        [--prompt-tokens 128] [--short-tokens 16] [--long-tokens 80] [--repeats 3]
        [--bandwidth 4.8e12] [--ways bare,ours,plain,plainkv,engine] [--kv-quantization none,q8,q4]
        [--deadline-s S] [--json-out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

STARTED = time.monotonic()  # --deadline-s counts from here
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

from provider.engine import ChatRequest, Engine, Finished, SamplingParams  # noqa: E402
from provider.engine.decode import EngineBatchGenerator  # noqa: E402
from provider.models.kv import KV_QUANTIZATION_BITS, kv_quantization_bits, quantized_bytes_per_element  # noqa: E402
from provider.models.metadata import DType, config_dtype  # noqa: E402
from provider.tinymodel import PRESETS, build_tiny_model, weights_bytes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WAYS = ("bare", "ours", "plain", "plainkv", "engine")
PREFILL_BATCH = 8  # mlx-lm's prefill_batch_size default, which the engine uses too
WORDS = ("river mountain apple stream batch model token quiet room copper wire north wind paper boat "
         "window salt stone memory cache late train green blue seven hundred small open garden lamp").split()


class DeadlinePassed(Exception):
    """--deadline-s: start no further run."""


# -- prompts -----------------------------------------------------------------------------------

class Batch:
    """n distinct one-message chats whose templated prompts are about `tokens` long, and their ids."""

    def __init__(self, tokenizer, n: int, tokens: int) -> None:
        self.messages: list[list[dict[str, str]]] = []
        for i in range(n):
            rng = random.Random(f"decode/{i}")
            words = [f"Request {i}:"]
            while len(template(tokenizer, " ".join(words))) < tokens:
                words.extend(rng.choice(WORDS) for _ in range(4))
            while len(words) > 2 and len(template(tokenizer, " ".join(words[:-1]))) >= tokens:
                words.pop()
            self.messages.append([{"role": "user", "content": " ".join(words)}])
        self.prompts = [template(tokenizer, m[0]["content"]) for m in self.messages]


def template(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


# -- the three ways: each returns the wall time from start to the last token of the batch -------

def run_bare(model, prompts: list[list[int]], max_tokens: int, generator=BatchGenerator) -> float:
    b = len(prompts)
    gen = generator(model, stop_tokens=None, completion_batch_size=b,
                         prefill_batch_size=min(PREFILL_BATCH, b))
    try:
        t0 = time.perf_counter()
        gen.insert(prompts, max_tokens=[max_tokens] * b)
        left = max_tokens * b
        while left > 0:
            left -= len(gen.next_generated())
        return time.perf_counter() - t0
    finally:
        gen.close()


def run_ours(model, prompts: list[list[int]], max_tokens: int) -> float:
    """`bare` with the engine's decode step (`provider.engine.decode.EngineBatchGenerator`), nothing else."""
    return run_bare(model, prompts, max_tokens, generator=EngineBatchGenerator)


def run_plain_kv(model, prompts: list[list[int]], max_tokens: int) -> float:
    """The plain loop over mlx-lm's plain `KVCache` (batched): the prompts cut to one length, so there is
    no left padding and a decode step needs no mask (the fused attention path). Set beside `plain`, it
    tells what the padded batch cache and its per-step mask cost."""
    n = min(len(p) for p in prompts)
    t0 = time.perf_counter()
    cache = make_prompt_cache(model)
    ids = mx.array([p[:n] for p in prompts])

    def step(inputs: mx.array) -> mx.array:
        return mx.argmax(model(inputs, cache=cache)[:, -1, :], axis=-1)

    y = step(ids)
    mx.async_eval(y)
    for produced in range(1, max_tokens + 1):
        if produced < max_tokens:
            nxt = step(y[:, None])
            mx.async_eval(nxt)
        y.tolist()
        if produced < max_tokens:
            y = nxt
    return time.perf_counter() - t0


def run_plain(model, prompts: list[list[int]], max_tokens: int) -> float:
    t0 = time.perf_counter()
    longest = max(len(p) for p in prompts)
    padding = [longest - len(p) for p in prompts]
    cache = [BatchKVCache(padding) for _ in model.layers]
    ids = mx.array([[0] * pad + p for p, pad in zip(prompts, padding, strict=True)])

    def step(inputs: mx.array) -> mx.array:
        return mx.argmax(model(inputs, cache=cache)[:, -1, :], axis=-1)

    y = step(ids)  # the prefill gives every sequence its first token
    mx.async_eval(y)
    for produced in range(1, max_tokens + 1):
        if produced < max_tokens:
            nxt = step(y[:, None])
            mx.async_eval(nxt)  # queued before the current token is read
        y.tolist()  # the host reads this step's tokens, as a server would
        if produced < max_tokens:
            y = nxt
    return time.perf_counter() - t0


async def run_engine(engine: Engine, model_id: str, messages: list[list[dict[str, str]]],
                     prompt_lengths: list[int], max_tokens: int, tag: str) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    streams = [engine.submit(model_id, ChatRequest(f"{tag}-{i}", m, params)) for i, m in enumerate(messages)]
    finals = [final for _, final in await asyncio.gather(*(s.collect() for s in streams))]
    wall = time.perf_counter() - t0
    for final, length in zip(finals, prompt_lengths, strict=True):
        if not (isinstance(final, Finished) and final.usage.completion_tokens == max_tokens
                and final.usage.prompt_tokens == length):
            raise RuntimeError(f"engine: a request ended as {final!r} (want {max_tokens} tokens after {length})")
    return wall


# -- the roofline ------------------------------------------------------------------------------

def dtype_bytes_of(config: dict) -> int:
    """Bytes of one element at the config's dtype (float32 when it names none)."""
    return (config_dtype(config) or DType.FLOAT32).nbytes


def kv_bytes_per_token(config: dict) -> int:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    itemsize = dtype_bytes_of(config)
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * itemsize


def roofline_tps(batch: int, weights: int, kv_per_token: int, context: float, bandwidth: float) -> float:
    step_bytes = weights + batch * context * kv_per_token
    return batch * bandwidth / step_bytes


# -- the driver --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=None, help="an existing model folder")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                    help="without --model-dir: build this preset under .cache/tiny-models")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--long-tokens", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s (default: an H200's HBM)")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--kv-quantization", default="none",
                    help="the engine way once per setting (none,q8,q4): engine, engine-q8, engine-q4")
    ap.add_argument("--stream-interval-ms", type=float, default=0.0,
                    help="the engine way's stream_interval_s in ms (provider/engine/delivery.py); 0: every token")
    args = ap.parse_args(argv)
    if not 0 < args.short_tokens < args.long_tokens:
        ap.error("need 0 < --short-tokens < --long-tokens")
    if set(args.ways.split(",")) - set(WAYS):
        ap.error(f"--ways: choose from {','.join(WAYS)}")
    if not args.kv_quantization or set(args.kv_quantization.split(",")) - set(KV_QUANTIZATION_BITS):
        ap.error(f"--kv-quantization: choose from {','.join(KV_QUANTIZATION_BITS)}")
    return args


def engine_way(setting: str) -> str:
    return "engine" if setting == "none" else f"engine-{setting}"


def model_folder(args: argparse.Namespace) -> Path:
    if args.model_dir is not None:
        if not (args.model_dir / "config.json").is_file():
            raise SystemExit(f"{args.model_dir}: no config.json (not a model folder)")
        return args.model_dir.resolve()
    dtype = PRESETS[args.preset].dtype
    name = f"{args.preset}-{'f32' if dtype == 'float32' else 'bf16'}"
    return build_tiny_model(REPO / ".cache" / "tiny-models" / name, preset=args.preset)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    ways = args.ways.split(",")
    settings = args.kv_quantization.split(",") if "engine" in ways else []
    if settings:  # the engine way once per setting, in its place
        at = ways.index("engine")
        ways[at:at + 1] = [engine_way(s) for s in settings]
    deadline = None if args.deadline_s is None else STARTED + args.deadline_s
    path = model_folder(args)
    config = json.loads((path / "config.json").read_text())
    model, tok = mlx_lm.load(str(path))
    engine = None
    if settings:
        engine = Engine(batch_size=max(sizes), stream_interval_s=args.stream_interval_ms / 1000)
        for setting in settings:
            await engine.load(engine_way(setting), path, eos_token_ids=frozenset(),
                              kv_bits=kv_quantization_bits(setting))
    weights, kv_token = weights_bytes(path), kv_bytes_per_token(config)
    meta = {"model": str(path), "weights_bytes": weights, "kv_bytes_per_token": kv_token,
            "device": str(mx.default_device()), "device_info": {k: v for k, v in mx.device_info().items()
                                                                if isinstance(v, int | float | str)},
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "args": {k: str(v) if isinstance(v, Path) else v
                                                                        for k, v in vars(args).items()}}
    runs: list[dict] = []  # one per (batch, way, repeat): the two wall times
    stopped = None

    batches = {b: Batch(tok, b, args.prompt_tokens) for b in sizes}

    async def timed(way: str, batch: int, n_tokens: int, tag: str) -> float:
        b = batches[batch]
        if way == "bare":
            return run_bare(model, b.prompts, n_tokens)
        if way == "ours":
            return run_ours(model, b.prompts, n_tokens)
        if way == "plain":
            return run_plain(model, b.prompts, n_tokens)
        if way == "plainkv":
            return run_plain_kv(model, b.prompts, n_tokens)
        return await run_engine(engine, way, b.messages, [len(p) for p in b.prompts], n_tokens, tag)

    failed: dict[str, str] = {}  # way -> why it is left out of later runs
    terminated: list[int] = []  # a SIGTERM (e.g. from `timeout`) ends it like the deadline, at the next run
    signal.signal(signal.SIGTERM, lambda signum, _frame: terminated.append(signum))

    async def attempt(way: str, batch: int, n_tokens: int, tag: str) -> float | None:
        if terminated or (deadline is not None and time.monotonic() >= deadline):
            raise DeadlinePassed
        if way in failed:
            return None
        try:
            return await timed(way, batch, n_tokens, tag)
        except Exception as exc:  # one way failing must not lose the others' numbers
            traceback.print_exc()
            failed[way] = f"batch {batch}: {type(exc).__name__}: {exc}"
            return None

    try:
        for batch in sizes:
            for way in ways:  # warm-up: this batch shape's kernels, compiled on first use
                await attempt(way, batch, args.short_tokens, f"warm-{way}-{batch}")
            for rep in range(args.repeats):
                for way in ways:
                    short = await attempt(way, batch, args.short_tokens, f"{way}-{batch}-{rep}-s")
                    long = await attempt(way, batch, args.long_tokens, f"{way}-{batch}-{rep}-l")
                    if short is not None and long is not None:
                        runs.append({"batch": batch, "way": way, "repeat": rep, "short_s": short, "long_s": long})
            print(f"batch {batch} done ({time.monotonic() - STARTED:.0f} s)", file=sys.stderr)
    except DeadlinePassed:
        stopped = "SIGTERM" if terminated else f"deadline ({args.deadline_s:g} s)"
    finally:
        if engine is not None:
            await engine.aclose()
    dtype_bytes = dtype_bytes_of(config)
    rows = summarize(args, runs, sizes, ways, weights, kv_token, dtype_bytes)
    print_table(args, path, meta, rows, stopped, failed)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"meta": {**meta, "stopped": stopped, "failed": failed, "elapsed_s": time.monotonic() - STARTED},
               "rows": rows, "runs": runs}
        args.json_out.write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if failed else 0


def way_kv_bytes(way: str, kv_token: int, dtype_bytes: int) -> float:
    """KV bytes a token as `way` keeps it: the quantized ways' bits plus a scale and a bias a group."""
    bits = kv_quantization_bits(way.removeprefix("engine-")) if way.startswith("engine-") else None
    return kv_token if bits is None else kv_token * quantized_bytes_per_element(bits, dtype_bytes) / dtype_bytes


def summarize(args, runs: list[dict], sizes: list[int], ways: list[str], weights: int, kv_token: int,
              dtype_bytes: int) -> list[dict]:
    steps = args.long_tokens - args.short_tokens
    context = args.prompt_tokens + (args.short_tokens + args.long_tokens) / 2
    rows = []

    def rate(run: dict) -> float | None:
        # A long run no slower than the short one is noise (another process on a shared CPU): left out.
        span = run["long_s"] - run["short_s"]
        return run["batch"] * steps / span if span > 0 else None

    for batch in sizes:
        bare = {r["repeat"]: rate(r) for r in runs if r["batch"] == batch and r["way"] == "bare"}
        engine = {r["repeat"]: rate(r) for r in runs if r["batch"] == batch and r["way"] == "engine"}
        for way in ways:
            mine = {r["repeat"]: rate(r) for r in runs if r["batch"] == batch and r["way"] == way}
            tps = [t for t in mine.values() if t is not None]
            if not tps:
                continue
            ratios = [t / bare[rep] for rep, t in mine.items() if t is not None and bare.get(rep)]
            over_engine = [t / engine[rep] for rep, t in mine.items() if t is not None and engine.get(rep)]
            decode = statistics.median(tps)
            roof = roofline_tps(batch, weights, way_kv_bytes(way, kv_token, dtype_bytes), context, args.bandwidth)
            rows.append({"batch": batch, "way": way, "repeats": len(tps), "noisy_repeats": len(mine) - len(tps),
                         "decode_tok_s": decode, "ms_per_step": 1000 * batch / decode, "roofline_tok_s": roof,
                         "share": decode / roof, "over_bare": statistics.median(ratios) if ratios else None,
                         "over_engine": (statistics.median(over_engine) if over_engine and way.startswith("engine-")
                                         else None)})
    return rows


def print_table(args, path: Path, meta: dict, rows: list[dict], stopped: str | None, failed: dict[str, str]) -> None:
    print(f"\n{path.name}: {meta['weights_bytes'] / 1e9:.3f} GB of weights, {meta['kv_bytes_per_token']} KV bytes "
          f"a token; device {meta['device']} ({meta['device_info'].get('device_name', '?')}); prompts ~"
          f"{args.prompt_tokens} tokens; decode = steps {args.short_tokens + 1}..{args.long_tokens} of every "
          f"sequence; roofline at {args.bandwidth:.3g} B/s; median of {args.repeats}\n")
    quantized = any(r["over_engine"] is not None for r in rows)
    extra = (" ÷ engine |", "---|") if quantized else ("", "")
    print(f"| batch | way | decode tok/s | ms/step | roofline tok/s | share of roofline | ÷ bare |{extra[0]} repeats |")
    print(f"|---|---|---|---|---|---|---|{extra[1]}---|")
    for r in rows:
        over = "—" if r["over_bare"] is None else f"{r['over_bare']:.3f}"
        over_engine = ("" if not quantized else
                       " — |" if r["over_engine"] is None else f" {r['over_engine']:.3f} |")
        noisy = f" ({r['noisy_repeats']} left out)" if r["noisy_repeats"] else ""
        print(f"| {r['batch']} | {r['way']} | {r['decode_tok_s']:.1f} | {r['ms_per_step']:.2f} | "
              f"{r['roofline_tok_s']:.0f} | {100 * r['share']:.1f} % | {over} |{over_engine} {r['repeats']}{noisy} |")
    for way, why in failed.items():
        print(f"\nFAILED: {way} at {why} (traceback on stderr); its later runs were skipped")
    if stopped:
        print(f"\nSTOPPED EARLY: {stopped}")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
