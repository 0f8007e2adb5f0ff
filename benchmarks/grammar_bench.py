"""Constrained decoding in the continuous batch: what 4 grammar-constrained rows cost a batch of 8,
and what compiling a 50-property schema costs, cold and cached.

Decode. One `EngineBatchGenerator` (the engine's decode step) on the model, a batch of 8 distinct
chats of about --prompt-tokens tokens, greedy, no stop tokens (every row runs to its max_tokens),
two ways:

* ``plain``: 8 plain rows (the plain step, `decode.DecodeBatch._step`);
* ``mixed``: 4 plain rows and 4 rows constrained by a 50-property JSON schema (every property required,
  so no row's grammar ends within the run), the guided step (`engine/guided.py`): each step the
  constrained rows' matchers consume their token and fill their masks on the host while the forward
  pass runs, then only the sampling waits for them.

Each way runs the batch to --short-tokens and to --long-tokens tokens a row; both runs do the same
prefill, so (T_long - T_short) is (long - short) decode steps of the whole batch:

    decode tok/s = 8 x (long - short) / (T_long - T_short)

Each tok/s cell is the median of --repeats repeats (the ways interleaved, alternating which goes
first), after one warm-up of each; `÷ plain` is the median of the per-repeat ratios (a neighbour's
load on a shared machine then hits both sides of a ratio alike). It is the figure to watch (goal >= 0.90).
`CPU ms / token` is the process's CPU time (every thread) per decoded token, the same difference of
the two runs: the work a way does, whatever a neighbour takes of the cores.

Compile. The 50-property schema (strings, bounded integers, numbers, booleans, enums, arrays, nested
objects): `check` (parse time: llguidance builds the grammar without a tokenizer), `cold` (a fresh
`GrammarCache`: the grammar compiled against the model's vocabulary) and `cached` (the next request's
copy), medians over --compiles calls.

    python benchmarks/grammar_bench.py [--model-dir PATH | --preset tiny] [--prompt-tokens 64]
        [--short-tokens 16] [--long-tokens 80] [--repeats 7] [--compiles 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mlx_lm  # noqa: E402

from provider.engine.cuda_graphs import without_cuda_graphs  # noqa: E402
from provider.engine.decode import EngineBatchGenerator  # noqa: E402
from provider.engine.guided import RowGuide  # noqa: E402
from provider.grammar import GrammarCache, TokenTable, json_schema_grammar  # noqa: E402
from provider.tinymodel import PRESETS, build_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BATCH = 8
CONSTRAINED = 4
WORDS = ("river mountain apple stream batch model token quiet room copper wire north wind paper boat "
         "window salt stone memory cache late train green blue seven hundred small open garden lamp").split()


def schema_50() -> dict:
    """Fifty required properties of seven kinds, two levels deep in places."""
    kinds = [
        {"type": "string", "maxLength": 24},
        {"type": "integer", "minimum": -1000, "maximum": 1000},
        {"type": "number", "minimum": 0, "maximum": 100},
        {"type": "boolean"},
        {"enum": ["alpha", "beta", "gamma", "delta", "epsilon"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 6},
        {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                          "label": {"type": "string", "maxLength": 12}},
         "required": ["id", "label"], "additionalProperties": False},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def prompts(tokenizer, n: int, tokens: int) -> list[list[int]]:
    out = []
    for i in range(n):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(tokens)]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(words)}], add_generation_prompt=True)
        out.append(ids[-tokens:] if len(ids) > tokens else ids)
    return out


def run(model, batch: list[list[int]], max_tokens: int, guides: list[RowGuide | None]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) to generate max_tokens for every row (prefill included)."""
    generator = EngineBatchGenerator(model, stop_tokens=None, completion_batch_size=BATCH, prefill_batch_size=BATCH)
    started, cpu = time.perf_counter(), time.process_time()
    generator.insert(batch, max_tokens=[max_tokens] * len(batch), logits_processors=[[g] if g else [] for g in guides])
    done = 0
    while done < len(batch):
        _, responses = generator.next()
        done += sum(1 for r in responses if r.finish_reason is not None)
    elapsed = time.perf_counter() - started, time.process_time() - cpu
    generator.close()
    return elapsed


def median_ms(fn, n: int) -> float:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--long-tokens", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compiles", type=int, default=50)
    args = ap.parse_args()
    without_cuda_graphs()  # as the engine runs its batch (provider/engine/cuda_graphs.py); a no-op off CUDA
    path = args.model_dir or build_tiny_model(REPO / ".cache" / "tiny-models" / f"{args.preset}-f32", preset=args.preset)
    model, tokenizer = mlx_lm.load(str(path))
    table = TokenTable.of(tokenizer)
    schema = schema_50()
    grammar = json_schema_grammar(schema)
    cache = GrammarCache()
    batch = prompts(tokenizer, BATCH, args.prompt_tokens)

    def guides(way: str) -> list[RowGuide | None]:
        if way == "plain":
            return [None] * BATCH
        return [RowGuide(cache.constraint(table, grammar)) if i % 2 else None for i in range(BATCH)]

    ways = ("plain", "mixed")
    for way in ways:  # warm-up: kernels, the compiled grammar
        run(model, batch, args.short_tokens, guides(way))
    rates: dict[str, list[float]] = {w: [] for w in ways}
    cpu: dict[str, list[float]] = {w: [] for w in ways}
    ratios: list[float] = []
    for repeat in range(args.repeats):
        for way in ways if repeat % 2 == 0 else reversed(ways):  # neither way always first
            short = run(model, batch, args.short_tokens, guides(way))
            long = run(model, batch, args.long_tokens, guides(way))
            tokens = BATCH * (args.long_tokens - args.short_tokens)
            rates[way].append(tokens / max(long[0] - short[0], 1e-9))
            cpu[way].append((long[1] - short[1]) / tokens * 1e3)
        ratios.append(rates["mixed"][-1] / rates["plain"][-1])  # a neighbour's load hits both halves alike
    plain, mixed, ratio = statistics.median(rates["plain"]), statistics.median(rates["mixed"]), statistics.median(ratios)

    check = median_ms(lambda: json_schema_grammar(schema), args.compiles)
    cold = median_ms(lambda: GrammarCache().constraint(table, grammar), args.compiles)
    warm = GrammarCache()
    warm.constraint(table, grammar)
    cached = median_ms(lambda: warm.constraint(table, grammar), args.compiles)

    print(f"model {path.name}: vocab {table.vocab_size}, batch {BATCH} ({CONSTRAINED} constrained in mixed), "
          f"prompts ~{args.prompt_tokens} tokens, decode steps {args.short_tokens}-{args.long_tokens}, "
          f"median of {args.repeats}")
    print()
    print("| way | decode tok/s | ÷ plain | CPU ms / token |")
    print("|---|---|---|---|")
    print(f"| plain (8 plain rows) | {plain:.1f} | 1.00 | {statistics.median(cpu['plain']):.2f} |")
    print(f"| mixed (4 plain + 4 constrained) | {mixed:.1f} | {ratio:.2f} | {statistics.median(cpu['mixed']):.2f} |")
    print()
    print(f"| 50-property schema ({len(grammar)} B grammar) | ms |")
    print("|---|---|")
    print(f"| check at parse time (no tokenizer) | {check:.2f} |")
    print(f"| compile against the vocabulary, cold | {cold:.2f} |")
    print(f"| cached (a request's copy) | {cached:.3f} |")


if __name__ == "__main__":
    main()
