"""A text model's load, end to end through the engine: where its seconds go, on which budget.

After the weights, a load measures (solo prefill, register's rates) and warms the shapes serving uses
on a time budget (`provider/engine/budget.py`: by default the larger of a few seconds and twice the
weight read). Each load here runs in a fresh process (`Engine.load`, as the agent loads), once per
--budgets entry and --repeats round, interleaved:

* ``default``: the engine's own budget;
* a number of seconds: `EngineOptions.measure_budget_s`, e.g. ``600`` for every measurement and
  every warm-up shape at its full size (the baseline: what a load cost before it had a budget, give
  or take the shapes it warms now).

Columns: the load's seconds (``load_s`` = ``weights_s`` + ``measure_s`` + ``warm_s``, medians over the
rounds), the budget, where the figures came from (``solo``: the solo-prefill threshold, ``rates``:
prefill_tps / decode_tps; measured, extrapolated from shorter passes, or the fallback once the budget
was spent), the warm-up shapes served of those that apply, and the figures themselves (last round).
The model's weights are in the page cache after the first round.

    python benchmarks/load_bench.py MODEL_DIR [MODEL_DIR ...] [--budgets default,600] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = """
import asyncio, json, sys
from provider.engine import Engine

async def main(path, budget):
    options = {} if budget == "default" else {"measure_budget_s": float(budget)}
    async with Engine(**options) as engine:
        info = await engine.load("m", path)
    print(json.dumps({
        "load_s": info.load_seconds, "weights_s": info.weights_seconds, "measure_s": info.measure_seconds,
        "warm_s": info.warm_seconds, "budget_s": info.measure_budget_seconds, "solo": info.solo_from.value,
        "rates": info.rates_from.value, "shapes": f"{info.warm_shapes}/{info.warm_shapes + info.warm_skipped}",
        "solo_min_tokens": info.solo_min_tokens, "prefill_tps": info.prefill_tps, "decode_tps": info.decode_tps}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def load_once(model: str, budget: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, model, budget], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="model folders (MLX layout)")
    parser.add_argument("--budgets", default="default", help="comma-separated: 'default' or seconds (default: default)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    runs: dict[tuple[str, str], list[dict]] = {(m, b): [] for m in args.models for b in budgets}
    for _ in range(args.repeats):
        for model in args.models:
            for budget in budgets:
                runs[model, budget].append(load_once(model, budget))
    print("| model | budget | load_s | weights_s | measure_s | warm_s | budget_s | solo | rates | shapes "
          "| solo_min_tokens | prefill_tps | decode_tps |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (model, budget), rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in ("load_s", "weights_s", "measure_s", "warm_s",
                                                                   "budget_s")}
        last = rows[-1]
        print(f"| {model} | {budget} | {med['load_s']:.2f} | {med['weights_s']:.2f} | {med['measure_s']:.2f} "
              f"| {med['warm_s']:.2f} | {med['budget_s']:.1f} | {last['solo']} | {last['rates']} | {last['shapes']} "
              f"| {last['solo_min_tokens']} | {last['prefill_tps']:.1f} | {last['decode_tps']:.2f} |")


if __name__ == "__main__":
    main()
