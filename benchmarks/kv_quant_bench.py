"""Quantized KV (`kv_quantization` q8, q4) against the model's dtype: how close the answers stay, and
how fast a batch decodes.

* ``logits``: teacher-forced closeness, with the median lead of the top token over the runner-up and
  the median change of a logit beside it (random weights give flat logits: where the lead is smaller
  than the change, top-1 agreement measures near-ties more than closeness). The same token sequences
  (distinct --prompt-tokens chats plus --continue-tokens of the model's own greedy continuation, all
  the sequences in one batch) go through the model in --chunk-token passes: once with mlx-lm's plain KV
  cache, once for each form with every layer's KV quantized as the engine keeps it
  (`kvcache.quantized`), so each pass attends over quantized keys and values. At every position the
  next-token logits of the runs are compared: cosine similarity (the median over positions) and top-1
  agreement (the share of positions whose argmax is the same). --forms takes the settings (q8, q4)
  and other forms written as k8v4g32 (keys' bits, values' bits, group size), to compare with them.
* ``attention``: one layer's attention over quantized KV alone, for each --forms entry, with the model's
  head shapes (decode steps at batch 8 and 32 over 384 keys, a 128-token prefill chunk over 512): the
  dequantized path the engine thread takes off Metal (`provider/engine/attention.py`, the CPU's float
  attention) and MLX's quantized kernels (`kvcache.quantized`, what Metal runs), ms, medians of 5
  rounds; beside them the float attention over unquantized KV.
* ``decode``: decode tok/s of the engine's generator (`EngineBatchGenerator`, the decode step the
  engine runs) at batch 8 and 32 for none, q8 and q4, sides interleaved per repeat, median of
  per-repeat ratios to none (steps --short-tokens..--long-tokens of every sequence, as decode_bench).

Models: --model-dir, or --preset (built with `provider.tinymodel` under .cache/tiny-models; the `1b`
preset is a random bfloat16 Llama at ~1B, `small` a random float32 one; --dtype float16 builds it in
float16). Random weights give flat logits, so top-1 agreement there is a harder test than on a trained
model, where the best token usually leads by far.

    python benchmarks/kv_quant_bench.py [--preset 1b] [--parts logits,decode] [--repeats 3] [--forms q8,q4,k4v4g32]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvcache import quantized as quantized_kv  # noqa: E402
from kvcache.bits import KvBits  # noqa: E402
from kvcache.quantized import make_quantized_cache  # noqa: E402
from provider.engine import attention  # noqa: E402
from provider.engine.decode import EngineBatchGenerator  # noqa: E402
from provider.mlxlm import holds_sequences  # noqa: E402
from provider.models.kv import KV_QUANTIZATION_BITS, kv_quantization_bits  # noqa: E402
from provider.tinymodel import build_tiny_model  # noqa: E402

SETTINGS = ("q8", "q4")
WORDS = ("river mountain apple stream batch model token quiet room copper wire north wind paper boat window "
         "salt stone memory cache late train green blue seven hundred small open garden lamp").split()


def model_folder(args: argparse.Namespace) -> Path:
    if args.model_dir is not None:
        return args.model_dir
    name = f"{args.preset}-{args.dtype or 'default'}-noeos"
    return build_tiny_model(REPO / ".cache" / "tiny-models" / name, preset=args.preset, dtype=args.dtype,
                            no_eos=True)


def chats(tokenizer, n: int, tokens: int) -> list[list[int]]:
    out = []
    for i in range(n):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(tokens)]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(words)}], add_generation_prompt=True)
        out.append(list(ids[: tokens]))
    return out


def teacher_forced(model, sequences: list[list[int]], cache: list, chunk: int) -> list[mx.array]:
    """Next-token logits at every position of each of `sequences` (all of one length, one batch), fed in
    `chunk`-token passes through `cache`."""
    tokens = mx.array(sequences)
    passes = []
    for at in range(0, tokens.shape[1], chunk):
        logits = model(tokens[:, at: at + chunk], cache=cache).astype(mx.float32)
        mx.eval(logits)
        passes.append(logits)
    return list(mx.concatenate(passes, axis=1))


def continued(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The prompts (all of one length) and the model's own greedy continuation of `n` tokens each, decoded
    as one batch (plain KV)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompts), cache=cache)[:, -1]
    out = [list(p) for p in prompts]
    for _ in range(n):
        tokens = mx.argmax(logits, axis=-1)
        for seq, token in zip(out, tokens.tolist()):
            seq.append(token)
        logits = model(tokens[:, None], cache=cache)[:, -1]
    return out


def form(text: str) -> tuple[str, KvBits]:
    """A --forms entry: a setting's name, or k<keys' bits>v<values' bits>g<group size>."""
    if text in KV_QUANTIZATION_BITS and text != "none":
        return text, kv_quantization_bits(text)
    match = re.fullmatch(r"k(\d)v(\d)g(\d+)", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r}: a setting ({', '.join(SETTINGS)}) or a form such as k8v4g32")
    try:
        return text, KvBits(*map(int, match.groups()))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def logits_part(model, tokenizer, args) -> list[str]:
    sequences = continued(model, chats(tokenizer, args.sequences, args.prompt_tokens), args.continue_tokens)
    plain = teacher_forced(model, sequences, make_prompt_cache(model), args.chunk_tokens)
    lines = ["| setting | keys, values, group | positions | cosine p50 | cosine min | top-1 agreement | top-1 lead p50 "
             "| |Δ logit| p50 |", "|---|---|---|---|---|---|---|---|"]
    for name, kv_bits in args.forms:
        cosines, leads, changes, agree, total = [], [], [], 0, 0
        quantized = teacher_forced(model, sequences, make_quantized_cache(model, kv_bits), args.chunk_tokens)
        for base, quant in zip(plain, quantized):
            dots = (base * quant).sum(axis=-1)
            norms = mx.sqrt((base * base).sum(axis=-1)) * mx.sqrt((quant * quant).sum(axis=-1))
            cosines += (dots / norms).tolist()
            top2 = mx.sort(base, axis=-1)[:, -2:]
            leads += (top2[:, 1] - top2[:, 0]).tolist()
            changes += mx.abs(quant - base).mean(axis=-1).tolist()
            agree += int((mx.argmax(base, axis=-1) == mx.argmax(quant, axis=-1)).sum().item())
            total += base.shape[0]
        lines.append(f"| {name} | {kv_bits} | {total} | {statistics.median(cosines):.5f} | {min(cosines):.5f} | "
                     f"{agree / total:.4f} | {statistics.median(leads):.4g} | {statistics.median(changes):.4g} |")
    return lines


def decode_rate(model, prompts: list[list[int]], bits: KvBits | None, steps: int) -> float:
    """tok/s of the batch's decode steps after every first token (steps 2..steps+1 of every sequence)."""
    generator = EngineBatchGenerator(model, stop_tokens=None, completion_batch_size=len(prompts),
                                     prefill_batch_size=len(prompts))
    caches = [make_quantized_cache(model, bits) for _ in prompts] if bits else None
    generator.insert(prompts, max_tokens=[steps + 2] * len(prompts), caches=caches)
    seen: dict[int, int] = {}
    started = None
    while holds_sequences(generator):
        _, responses = generator.next()
        for r in responses:
            seen[r.uid] = seen.get(r.uid, 0) + 1
        if started is None and len(seen) == len(prompts) and min(seen.values()) >= 2:
            started, tokens_then = time.perf_counter(), sum(seen.values())
    generator.close()
    return (sum(seen.values()) - tokens_then) / (time.perf_counter() - started)


def attention_part(model, args) -> list[str]:
    layer = model.layers[0].self_attn
    heads, kv, dim = layer.n_heads, layer.n_kv_heads, layer.head_dim
    lines = ["| case | setting | keys, values, group | dequantized ms | quantized kernels ms | float KV ms |",
             "|---|---|---|---|---|---|"]
    for batch, queries, keys, n in ((32, 1, 384, 50), (8, 1, 384, 100), (1, 128, 512, 20)):
        mx.random.seed(0)
        q = mx.random.normal((batch, heads, queries, dim))
        k, v = mx.random.normal((batch, kv, keys, dim)), mx.random.normal((batch, kv, keys, dim))
        mask = None if queries == 1 else "causal"
        plain = timed(lambda: attention.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask), n)
        case = f"{queries} {'query' if queries == 1 else 'queries'} x {keys} keys, batch {batch}"
        for name, kv_bits in args.forms:
            g = kv_bits.group_size
            qk, qv = mx.quantize(k, g, kv_bits.keys), mx.quantize(v, g, kv_bits.values)
            dequantized = timed(lambda: attention.quantized_attention(q, qk, qv, 0.125, mask, group_size=g), n)
            kernels = timed(lambda: quantized_kv.quantized_attention(q, qk, qv, 0.125, mask, group_size=g), n // 5)
            lines.append(f"| {case} | {name} | {kv_bits} | {dequantized:.3f} | {kernels:.3f} | {plain:.3f} |")
    return lines


def timed(fn, n: int) -> float:
    """ms a call of `fn` (evaluated), the median of 5 rounds of `n` calls after one unmeasured."""
    mx.eval(fn())
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(n):
            mx.eval(fn())
        rounds.append((time.perf_counter() - started) / n * 1e3)
    return statistics.median(rounds)


def decode_part(model, tokenizer, args) -> list[str]:
    lines = ["| batch | setting | decode tok/s (median) | ÷ none (median of per-repeat ratios) |", "|---|---|---|---|"]
    for batch in args.batch_sizes:
        prompts = chats(tokenizer, batch, args.prompt_tokens)
        decode_rate(model, prompts, None, 4)  # warm-up: kernels for these shapes
        rates: dict[str, list[float]] = {"none": [], "q8": [], "q4": []}
        for repeat in range(args.repeats):
            order = ["none", *SETTINGS] if repeat % 2 == 0 else [*reversed(SETTINGS), "none"]
            for setting in order:
                rates[setting].append(decode_rate(model, prompts, kv_quantization_bits(setting), args.decode_steps))
        for setting in ("none", *SETTINGS):
            ratio = statistics.median(r / n for r, n in zip(rates[setting], rates["none"]))
            lines.append(f"| {batch} | {setting} | {statistics.median(rates[setting]):.1f} | {ratio:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default=None, help="the preset's weights dtype (e.g. float16)")
    parser.add_argument("--parts", default="logits,decode")
    parser.add_argument("--sequences", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--continue-tokens", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32])
    parser.add_argument("--decode-steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forms", type=lambda s: [form(x) for x in s.split(",")], default=[form(s) for s in SETTINGS],
                        help="the logits and attention parts' forms: settings and k<bits>v<bits>g<group> (default: q8,q4)")
    args = parser.parse_args(argv)
    path = model_folder(args)
    model, tokenizer = mlx_lm.load(str(path))
    dtype = next(iter(model.parameters()["model"]["layers"][0]["self_attn"]["q_proj"].values())).dtype
    if not attention.quantized_kernels():  # MLX's CUDA backend: as the engine thread attends there
        attention.enable_dequantized_kv()
    forms = ", ".join(f"{s} = {kv_quantization_bits(s)}" for s in SETTINGS)
    print(f"model {path.name} ({dtype}), device {mx.default_device()}, {forms}\n")
    parts = args.parts.split(",")
    if "logits" in parts:
        print(f"teacher-forced next-token logits, quantized KV against the model's dtype: {args.sequences} sequences "
              f"of {args.prompt_tokens} prompt + {args.continue_tokens} greedy tokens, {args.chunk_tokens}-token passes\n")
        print("\n".join(logits_part(model, tokenizer, args)) + "\n")
    if "attention" in parts:
        print("one layer's attention over quantized KV, the dequantized path and the quantized kernels\n")
        print("\n".join(attention_part(model, args)) + "\n")
    if "decode" in parts:
        print(f"decode, the engine's generator, {args.prompt_tokens}-token prompts, {args.decode_steps} steps after "
              f"every first token, {args.repeats} interleaved repeats\n")
        print("\n".join(decode_part(model, tokenizer, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
