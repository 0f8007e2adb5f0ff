"""Fast-admission decision latency with 3 models loaded and 8 requests in flight.

Run: `HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/admission_bench.py [--n 3000]`

Loads the tiny, small and 4-bit tiny models (built offline into .cache/tiny-models/) on a machine
emulated with `memory_limit_gb=4`, starts 8 requests that never stop (the engine thread keeps
decoding them on the other core, as in production), then times `ModelManager.admit()` for each kind
of decision. Prints µs per call (p50, p99) and each row's p50 as a ratio of the baseline measured in
the same run: one `Probe.snapshot()`, the memory sample every decision needs.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from memory import Ledger, Probe, compute_figures, resolve_settings
from provider.engine import ChatRequest, Engine, SamplingParams, TextDelta
from provider.models import discover
from provider.slots import Admitted, ModelManager, Refused
from provider.tinymodel import build_tiny_model
from timing import measure

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tiny-models"
MESSAGES = [{"role": "user", "content": "hello there"}]


async def run(n: int) -> None:
    paths = {
        "tiny": build_tiny_model(CACHE / "tiny-f32", preset="tiny"),
        "small": build_tiny_model(CACHE / "small-f32", preset="small"),
        "q4": build_tiny_model(CACHE / "tiny-q4", preset="tiny", q_bits=4),
        "medium": build_tiny_model(CACHE / "medium-f32", preset="medium"),  # never loaded: cold decisions
    }
    inventory = discover(hf_cache=None, aliases=paths)
    probe = Probe(memory_limit_gb=4.0)
    figures = compute_figures(probe.machine_bytes, resolve_settings({}, memory_reserve_gb=0.5, memory_limit_gb=4.0,
                                                                    activation_reserve_gb=0.25))
    ledger = Ledger(figures, sample=probe.snapshot)
    never = frozenset()
    async with Engine() as engine:
        manager = ModelManager(engine, inventory, ledger, figures, probe, max_model_slots=3, idle_timeout_s=None,
                               eos_token_ids={"tiny": never, "small": never, "q4": never})
        async with _InFlight(manager, ("tiny", "small", "q4") * 3, 8) as flight:
            assert len(manager.warm_models()) == 3 and flight.count == 8
            rows = [
                ("baseline: Probe.snapshot()", probe.snapshot, None),
                ("ManagerView copy", manager.view, None),
                ("admit resident, accept", lambda: manager.admit("tiny", 64, 64), Admitted),
                ("admit resident, large KV (accept)", lambda: manager.admit("small", 2048, 2048), Admitted),
                ("admit cold, plan eviction (refuse: slots busy)", lambda: manager.admit("medium", 64, 64), Refused),
                ("admit unknown model (404)", lambda: manager.admit("nope", 64, 64), Refused),
            ]
            results = []
            stats_before = {m: engine.stats(m) for m in ("tiny", "small", "q4")}
            for name, fn, expect in rows:
                if expect is not None:
                    assert isinstance(fn(), expect), name
                results.append((name, *measure(fn, n)))
            in_batch = sum(engine.stats(m).num_running + engine.stats(m).num_waiting for m in stats_before)
            assert in_batch == 8, "a request left the batch during the measurement"
    base = results[0][1]
    print(f"fast admission, 3 models loaded, 8 requests in flight, n={n} per row (µs per call)")
    print(f"{'decision':50} {'p50':>8} {'p99':>8} {'p50 / baseline':>15}")
    for name, p50, p99 in results:
        print(f"{name:50} {p50:8.1f} {p99:8.1f} {p50 / base:15.2f}")


class _InFlight:
    """Start `count` never-ending requests through `manager.serve`, cancel them on exit."""

    def __init__(self, manager: ModelManager, models: tuple[str, ...], count: int) -> None:
        self.manager, self.models, self.count = manager, models[:count], 0
        self._release = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _one(self, rid: str, model: str, started: asyncio.Event) -> None:
        # 1900 output tokens: far more than the measurement lasts, so all 8 stay in the batch
        async with self.manager.serve(rid, model, 64, 1900) as slot:
            stream = slot.submit(ChatRequest(rid, MESSAGES, SamplingParams(max_tokens=1900, temperature=0.0)))
            assert isinstance(await anext(stream), TextDelta)
            self.count += 1
            started.set()
            await self._release.wait()

    async def __aenter__(self) -> _InFlight:
        for i, model in enumerate(self.models):
            started = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._one(f"r{i}", model, started)))
            await started.wait()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._release.set()
        await asyncio.gather(*self._tasks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=3000)
    asyncio.run(run(parser.parse_args().n))


if __name__ == "__main__":
    main()
