"""ModelManager rigs on real MLX with the tiny models, on a small machine emulated with `memory_limit_gb`.

The emulated machine. `P = 4 GiB` (memory_limit_gb=4), `R_cfg = 0.5 GiB`:
hard_cap = min(0.9·4, 4 − 2) = 2 GiB and eff_cap = min(2, 4 − 0.5) = 2 GiB. A load needs
`padded(w) + A + MIN_KV` (MIN_KV = 1 GiB) of `eff_cap − mlx_used − outstanding`. Each test picks
the room left for weights, `X = eff_cap − MIN_KV − A − baseline`, and derives the activation reserve
`A` from it, so the only thing that differs from a real 4 GiB machine is A. On disk
M (medium) ≈ 394.3 MB, S (small) ≈ 50.4 MB, T (tiny) ≈ 5.3 MB; resident ≈ the same; padded = ×1.2.
The emulated machine's memory is MLX's alone: its probe reads the process's RSS as MLX's bytes, so the
unattributed term (the test process's own heap and libraries, several hundred MiB that a 2 GiB cap
cannot hold) is 0 here; it is tested for itself in test_memory_unattributed.py and end to end in
test_unattributed_e2e.py.

``rigs`` (a fixture) makes rigs: ``make, baseline = rigs; rig = make(paths, room_for_weights, **manager_kw)``
(``engine_options=`` an `EngineOptions` for the rig's engine).
After every test: unload_all, the ledger is empty, the engine holds no model, and MLX active memory is
back to its baseline.
"""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import pytest

from memory import MIN_KV_BYTES, GiB, Ledger, Probe, compute_figures, resolve_settings
from provider.engine import ChatRequest, Engine, EngineOptions, Finished, SamplingParams
from provider.models import Inventory, discover
from provider.slots import ModelManager

LIMIT_GB = 4.0
RESERVE_GB = 0.5
MESSAGES = [{"role": "user", "content": "hello there"}]
PROMPT = 32  # declared prompt tokens (the templated prompt is shorter)
NEVER_STOP = frozenset()  # eos set that never ends a request: it stays in flight until cancelled


def mlx_bytes() -> int:
    """The rigs' RSS: MLX's bytes (the module docstring says why)."""
    return mx.get_active_memory() + mx.get_cache_memory()


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


class Rig:
    """One engine + ledger + manager over chosen models, with the figures worked out above."""

    def __init__(self, paths: dict[str, Path], room_for_weights: int, baseline: int, *,
                 engine_options: EngineOptions | None = None, **manager_kw) -> None:
        self.inventory = discover(hf_cache=None, aliases=paths)
        assert {m.id for m in self.inventory.models} == set(paths), self.inventory.skipped
        self.probe = Probe(memory_limit_gb=LIMIT_GB, rss=mlx_bytes)
        eff_cap = compute_figures(self.probe.machine_bytes,
                                  resolve_settings({}, memory_reserve_gb=RESERVE_GB,
                                                   memory_limit_gb=LIMIT_GB)).effective_cap_bytes
        activation = eff_cap - MIN_KV_BYTES - room_for_weights - baseline
        assert activation > 0, "the chosen room does not fit the emulated machine"
        settings = resolve_settings({}, memory_reserve_gb=RESERVE_GB, memory_limit_gb=LIMIT_GB,
                                    activation_reserve_gb=activation / GiB)
        self.figures = compute_figures(self.probe.machine_bytes, settings)
        assert self.figures.effective_cap_bytes == 2 * GiB
        self.ledger = Ledger(self.figures, sample=self.probe.snapshot)
        # One measuring pass and no warm-up at a load, as every process of the suite (conftest).
        self.engine = Engine(engine_options or EngineOptions(measure_budget_s=0.0))
        self.manager_kw = manager_kw
        self.manager = self.build()

    def build(self, inventory: Inventory | None = None, **kw) -> ModelManager:
        args = {"max_model_slots": 3, "idle_timeout_s": None, "load_wait_timeout_s": 60.0,
                "settle_timeout_s": 2.0, **self.manager_kw, **kw}
        return ModelManager(self.engine, inventory or self.inventory, self.ledger, self.figures, self.probe, **args)


@pytest.fixture
async def rigs(tiny_model_path):
    """Factory for rigs; teardown checks the invariants every test must leave behind."""
    gc.collect()
    mx.clear_cache()
    baseline = mx.get_active_memory()
    made: list[Rig] = []

    def make(paths: dict[str, Path], room_for_weights: int, **kw) -> Rig:
        rig = Rig(paths, room_for_weights, baseline, **kw)
        made.append(rig)
        return rig

    yield make, baseline
    for rig in made:
        await rig.manager.unload_all()
        assert len(rig.ledger) == 0, rig.ledger.snapshot()
        for model in rig.inventory.models:
            assert rig.engine.stats(model.id) is None  # nothing half-loaded behind the manager's back
        await rig.engine.aclose()
    gc.collect()
    mx.clear_cache()
    assert mx.get_active_memory() - baseline < 256 * 1024
    assert mx.get_cache_memory() == 0


async def serve_once(manager: ModelManager, rid: str, model: str, n: int = 2) -> Finished:
    async with manager.serve(rid, model, PROMPT, n) as slot:
        _, fin = await slot.submit(ChatRequest(rid, MESSAGES, params(n))).collect()
    assert isinstance(fin, Finished)
    return fin
