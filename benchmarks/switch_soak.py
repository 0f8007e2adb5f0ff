"""Model-switch soak: 50 load → serve → unload switches between two tiny models of different sizes.

Run: `HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/switch_soak.py [--switches 50]`

Every switch goes through `ModelManager`: `serve` loads the model (load gate, pending-load claim,
post-load guard) and runs one 4-token request, then `unload` stops it, clears MLX's cache, trims
the heap and runs the settle barrier. After each unload we read MLX active/cache memory and the
process RSS and compare them with the baseline taken before the first load, in the same process.
Prints one row per switch, then a summary with the worst drift and the settle times; the timing
baseline is the same work on the bare engine (`load`, one 4-token request, `unload`) in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from pathlib import Path

import mlx.core as mx
import psutil

from memory import Ledger, Probe, compute_figures, resolve_settings
from provider.engine import ChatRequest, Engine, Finished, SamplingParams
from provider.models import discover
from provider.slots import ModelManager
from provider.tinymodel import build_tiny_model, weights_bytes

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tiny-models"
MESSAGES = [{"role": "user", "content": "hello there"}]
MiB = 2**20


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


async def bare_engine_cycle(engine: Engine, model: str, path: Path) -> float:
    """The same work without the manager: load, one 4-token request, unload."""
    t0 = time.perf_counter()
    await engine.load(model, path)
    request = ChatRequest("bare", MESSAGES, SamplingParams(max_tokens=4, temperature=0.0))
    _, fin = await engine.submit(model, request).collect()
    assert isinstance(fin, Finished)
    await engine.unload(model)
    return time.perf_counter() - t0


async def run(switches: int) -> None:
    paths = {"tiny": build_tiny_model(CACHE / "tiny-f32", preset="tiny"),
             "small": build_tiny_model(CACHE / "small-f32", preset="small")}
    sizes = {m: weights_bytes(p) for m, p in paths.items()}
    inventory = discover(hf_cache=None, aliases=paths)
    probe = Probe(memory_limit_gb=4.0)
    figures = compute_figures(probe.machine_bytes, resolve_settings({}, memory_reserve_gb=0.5, memory_limit_gb=4.0,
                                                                    activation_reserve_gb=0.25))
    ledger = Ledger(figures, sample=probe.snapshot)
    process = psutil.Process()
    async with Engine() as engine:
        # Timing baseline, same run: the engine alone, no gate, guard or settle.
        for model, path in paths.items():  # warm both once (first loads pay imports and page-ins)
            await bare_engine_cycle(engine, model, path)
        bare = [await bare_engine_cycle(engine, m, paths[m]) for m in ("tiny", "small") * 5]

        manager = ModelManager(engine, inventory, ledger, figures, probe, max_model_slots=1, idle_timeout_s=None)
        gc.collect()
        mx.clear_cache()
        base_active, base_rss = mx.get_active_memory(), process.memory_info().rss
        rows = []
        for i in range(switches):
            model = ("tiny", "small")[i % 2]
            t0 = time.perf_counter()
            async with manager.serve(f"r{i}", model, 16, 4) as slot:
                stream = slot.submit(ChatRequest(f"r{i}", MESSAGES, SamplingParams(max_tokens=4, temperature=0.0)))
                _, fin = await stream.collect()
                assert isinstance(fin, Finished)
            loaded_s = time.perf_counter() - t0
            assert await manager.unload(model)
            report = manager.last_unload
            assert report is not None and len(ledger) == 0
            drift = mx.get_active_memory() - base_active
            rows.append((i, model, loaded_s, report.total_seconds, report.settle_seconds, report.freed_bytes,
                         drift, mx.get_cache_memory(), process.memory_info().rss - base_rss))

    print(f"baseline: MLX active {base_active / MiB:.2f} MiB, RSS {base_rss / MiB:.1f} MiB; "
          f"models: tiny {sizes['tiny'] / MiB:.1f} MiB, small {sizes['small'] / MiB:.1f} MiB")
    print(f"{'#':>3} {'model':6} {'load+serve s':>12} {'unload s':>9} {'settle s':>9} {'freed MiB':>10} "
          f"{'active drift B':>15} {'cache B':>8} {'RSS drift MiB':>14}")
    for i, model, load_s, unload_s, settle_s, freed, drift, cache, rss in rows:
        print(f"{i:3d} {model:6} {load_s:12.3f} {unload_s:9.3f} {settle_s:9.4f} {freed / MiB:10.2f} "
              f"{drift:15d} {cache:8d} {rss / MiB:14.1f}")
    worst = max(rows, key=lambda r: abs(r[6]))
    settle = [r[4] for r in rows]
    switch = [r[2] + r[3] for r in rows]
    print()
    print(f"{'summary over ' + str(switches) + ' switches':40} {'value':>14}")
    print(f"{'worst MLX active drift after unload':40} {worst[6]:>12d} B  (switch {worst[0]}, "
          f"{abs(worst[6]) / sizes[worst[1]] * 100:.4f} % of {worst[1]})")
    print(f"{'worst RSS drift after unload':40} {max(r[8] for r in rows) / MiB:>12.1f} MiB")
    print(f"{'RSS drift, last switch':40} {rows[-1][8] / MiB:>12.1f} MiB")
    print(f"{'settle time per switch, median / max':40} {statistics.median(settle) * 1e3:>8.2f} / "
          f"{max(settle) * 1e3:.2f} ms")
    print(f"{'manager switch (load+serve+unload) p50':40} {statistics.median(switch) * 1e3:>12.1f} ms")
    print(f"{'baseline: bare engine, same work, p50':40} {statistics.median(bare) * 1e3:>12.1f} ms")
    print(f"{'ratio manager / bare':40} {statistics.median(switch) / statistics.median(bare):>14.2f}")
    print(f"{'manager switch p90':40} {pct(switch, 0.9) * 1e3:>12.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--switches", type=int, default=50)
    asyncio.run(run(parser.parse_args().switches))


if __name__ == "__main__":
    main()
