"""The activation reserve against what a request of a model's whole context really holds.

For each preset of `provider.tinymodel` (random weights, built once into --models), in a fresh process:
the model is loaded through the engine as the agent loads it (its default measurement budget, or
--budget), which measures the model's activation profile over the passes the load already times
(`provider/engine/activation.py`); then one request whose prompt fills the whole context (``context -
1`` tokens, one output token) is served through the same engine, and MLX's peak over it, less the
active bytes before it and its KV, is what it held: the *measured peak*. Printed per preset:

* ``reserve / peak``: the reserve the policy holds for the model (`ActivationProfile.reserve_bytes` at
  its context), measured at load; the goal is between 1.0 (never under) and 1.5;
* ``estimate / peak``: the config's estimate, what a model never loaded here is given;
* ``fixed / peak``: the baseline, the fixed 3 GiB every model was given before.

    python benchmarks/activation_bench.py [--presets tiny,small,medium] [--models DIR] [--budget S]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from provider.tinymodel import build_tiny_model

_CHILD = """
import asyncio, json, sys
import mlx.core as mx
from memory.policy import DEFAULT_ACTIVATION_RESERVE_BYTES
from provider.engine import ChatRequest, Engine, SamplingParams
from provider.models.activation import estimate_for
from provider.models.discovery import inspect_model
from provider.models.kv import round_up_to_step

async def main(path, budget):
    options = {} if budget == "default" else {"measure_budget_s": float(budget)}
    async with Engine(**options) as engine:
        info = await engine.load("m", path)
        profile, context = info.activation, info.context_length
        per_token = await engine.kv_bytes_per_token("m")
        await engine.reclaim()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        prompt = [3 + i % 500 for i in range(context - 1)]
        await engine.submit("m", ChatRequest("whole", [], SamplingParams(max_tokens=1, temperature=0.0),
                                             prompt_ids=prompt)).collect()
        peak = mx.get_peak_memory() - before - per_token * round_up_to_step(context)
    estimate = estimate_for(inspect_model(path, "m"), window_tokens=profile.window_tokens,
                            batch_rows=profile.batch_rows)
    print(json.dumps({"context": context, "window": profile.window_tokens, "peak": peak,
                      "reserve": profile.reserve_bytes(context), "estimate": estimate.reserve_bytes(context),
                      "fixed": DEFAULT_ACTIVATION_RESERVE_BYTES,
                      "load_peak": profile.peak_bytes, "load_peak_tokens": profile.peak_tokens,
                      "rates": info.rates_from.value, "budget_s": info.measure_budget_seconds}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""

MiB = 2**20


def run_preset(path: Path, budget: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), budget], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small,medium")
    parser.add_argument("--models", type=Path, default=None, help="where the presets are built (default: a temp dir)")
    parser.add_argument("--budget", default="default", help="the load's measurement budget in s (default: the engine's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="activation-bench-") as tmp:
        models = args.models or Path(tmp)
        rows = []
        for preset in args.presets.split(","):
            path = build_tiny_model(models / f"{preset}-f32", preset=preset)
            r = run_preset(path, args.budget)
            rows.append((preset, r))
    print(f"{'preset':8} {'context':>7} {'window':>6} {'load peak (tokens)':>20} {'peak MiB':>9} "
          f"{'reserve MiB':>11} {'reserve/peak':>12} {'estimate/peak':>13} {'fixed/peak':>10} {'rates':>12}")
    for preset, r in rows:
        print(f"{preset:8} {r['context']:>7} {r['window']:>6} "
              f"{r['load_peak'] / MiB:>12.1f} ({r['load_peak_tokens']:>4}) {r['peak'] / MiB:>9.1f} "
              f"{r['reserve'] / MiB:>11.1f} {r['reserve'] / r['peak']:>12.2f} {r['estimate'] / r['peak']:>13.2f} "
              f"{r['fixed'] / r['peak']:>10.1f} {r['rates']:>12}")


if __name__ == "__main__":
    main()
