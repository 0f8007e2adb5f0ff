"""The buffer-cache rule on the model manager: a refusal or an eviction that one
`mx.clear_cache()` would have avoided does not happen.

Real engine, real tiny models, a 4 GiB machine emulated with `memory_limit_gb`. The one stub is MLX's
cache *figure*: the probe reports `FakeCache.nbytes` on top of MLX's own cache counter, and the engine's
`reclaim` (gc + `mx.clear_cache()` on its thread) also empties the fake, as clearing empties the real
cache. On CPU MLX keeps at most 32 MiB, too little to matter; on Metal the cache held tens of GiB.
"""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import pytest

from memory import (
    MIN_KV_BYTES,
    GiB,
    Ledger,
    MlxCounters,
    Probe,
    ReservationKind,
    compute_figures,
    padded_weight_bytes,
    resolve_settings,
)
from provider.engine import ChatRequest, Engine, Finished, SamplingParams
from provider.models import discover
from provider.slots import Admitted, ModelManager, ModelState, Refused
from provider.tinymodel import weights_bytes

LIMIT_GB, RESERVE_GB = 4.0, 0.5  # effective cap 2 GiB
MESSAGES = [{"role": "user", "content": "hello there"}]
MiB = 1 << 20


class FakeCache:
    """MLX's cache figure plus `nbytes` of freed buffers that a clear gives back."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.clears = 0

    def counters(self) -> MlxCounters:
        return MlxCounters(mx.get_active_memory(), mx.get_cache_memory() + self.nbytes, mx.get_peak_memory())

    def rss(self) -> int:
        """The emulated machine's memory is MLX's alone (as manager_rigs.py's): the cache's bytes are RSS."""
        counters = self.counters()
        return counters.active_bytes + counters.cache_bytes

    def wrap(self, engine: Engine) -> None:
        """Whichever way the engine is asked to clear (awaited, or queued by a booking), the fake
        empties when the engine thread has run the clear, as the real cache does."""
        real, real_soon = engine.reclaim, engine.request_reclaim

        def cleared(_future=None) -> None:
            self.nbytes = 0
            self.clears += 1

        async def reclaim() -> None:
            await real()
            cleared()

        def request_reclaim():
            future = real_soon()
            future.add_done_callback(cleared)
            return future

        engine.reclaim = reclaim  # type: ignore[method-assign]
        engine.request_reclaim = request_reclaim  # type: ignore[method-assign]


class CacheRig:
    def __init__(self, paths: dict[str, Path], room_for_weights: int) -> None:
        gc.collect()
        mx.clear_cache()
        self.cache = FakeCache()
        self.probe = Probe(memory_limit_gb=LIMIT_GB, mlx_counters=self.cache.counters, rss=self.cache.rss)
        base = resolve_settings({}, memory_reserve_gb=RESERVE_GB, memory_limit_gb=LIMIT_GB)
        eff_cap = compute_figures(self.probe.machine_bytes, base).effective_cap_bytes
        activation = eff_cap - MIN_KV_BYTES - room_for_weights - mx.get_active_memory()
        settings = resolve_settings({}, memory_reserve_gb=RESERVE_GB, memory_limit_gb=LIMIT_GB,
                                    activation_reserve_gb=activation / GiB)
        self.figures = compute_figures(self.probe.machine_bytes, settings)
        self.ledger = Ledger(self.figures, sample=self.probe.snapshot)
        self.engine = Engine()
        self.cache.wrap(self.engine)
        self.manager = ModelManager(self.engine, discover(hf_cache=None, aliases=paths), self.ledger, self.figures,
                                    self.probe, max_model_slots=3, idle_timeout_s=None, settle_timeout_s=2.0)

    async def close(self) -> None:
        await self.manager.unload_all()
        assert len(self.ledger) == 0
        await self.engine.aclose()


@pytest.fixture
async def make_rig():
    made: list[CacheRig] = []

    def make(paths: dict[str, Path], room_for_weights: int) -> CacheRig:
        made.append(CacheRig(paths, room_for_weights))
        return made[-1]

    yield make
    for rig in made:
        await rig.close()


async def serve(manager: ModelManager, rid: str, model: str) -> Finished:
    async with manager.serve(rid, model, 32, 2) as slot:
        _, fin = await slot.submit(ChatRequest(rid, MESSAGES, SamplingParams(max_tokens=2, temperature=0.0))).collect()
    assert isinstance(fin, Finished)
    return fin


async def test_a_load_clears_the_cache_instead_of_evicting_an_idle_model(make_rig, tiny_model_path,
                                                                         small_model_path):
    # Room for both models with 40 MiB to spare; the cache holds 300 MiB of it.
    room = padded_weight_bytes(weights_bytes(small_model_path)) + padded_weight_bytes(weights_bytes(tiny_model_path))
    rig = make_rig({"tiny": tiny_model_path, "small": small_model_path}, room + 40 * MiB)
    await serve(rig.manager, "r1", "small")
    rig.cache.nbytes = 300 * MiB
    assert rig.probe.snapshot().reclaimable_bytes >= 300 * MiB
    await serve(rig.manager, "r2", "tiny")
    assert rig.manager.state("small") is ModelState.LOADED  # not evicted for memory a clear gave back
    assert rig.manager.last_unload is None
    assert rig.cache.clears >= 1 and rig.cache.nbytes == 0


async def test_a_request_is_not_refused_for_memory_held_in_the_cache(make_rig, tiny_model_path):
    rig = make_rig({"tiny": tiny_model_path}, 200 * MiB)
    await serve(rig.manager, "r1", "tiny")
    clears = rig.cache.clears
    # The cache fills everything under the cap: as counted now, no KV fits.
    snap = rig.probe.snapshot()
    rig.cache.nbytes = rig.figures.effective_cap_bytes - snap.mlx_used_bytes
    assert rig.figures.available_bytes(rig.probe.snapshot()) == 0
    verdict = rig.manager.admit("tiny", 32, 2)
    assert isinstance(verdict, Admitted), verdict  # judged as after the clear a booking makes
    await serve(rig.manager, "r2", "tiny")  # the booking queues the clear ahead of its KV, and fits
    assert rig.cache.clears == clears + 1 and rig.cache.nbytes == 0


async def test_without_cache_the_same_request_is_refused(make_rig, tiny_model_path):
    """The control: memory really taken (not reclaimable) is still refused at once."""
    rig = make_rig({"tiny": tiny_model_path}, 200 * MiB)
    await serve(rig.manager, "r1", "tiny")
    snap = rig.probe.snapshot()  # held bytes that no clear gives back, and as much as a clear would give
    hold = rig.ledger.reserve("test:hold", ReservationKind.MEDIA,
                              rig.figures.available_bytes(snap.after_reclaim()), snapshot=snap.after_reclaim())
    assert hold.granted
    try:
        assert isinstance(rig.manager.admit("tiny", 32, 2), Refused)
    finally:
        rig.ledger.release("test:hold")


async def test_a_refusal_no_clear_can_lift_queues_none(make_rig, tiny_model_path):
    """A full batch is refused whatever the cache holds: the booking does not clear the cache for it."""
    rig = make_rig({"tiny": tiny_model_path}, 200 * MiB)
    await serve(rig.manager, "r1", "tiny")
    held = [rig.manager.book(f"b{i}", "tiny", 32, 2) for i in range(rig.manager.max_concurrency("tiny"))]
    try:
        assert not any(isinstance(b, Refused) for b in held)
        rig.cache.nbytes = 100 * MiB
        clears = rig.cache.clears
        refused = rig.manager.book("over", "tiny", 32, 2)
        assert isinstance(refused, Refused)
        await rig.engine.reclaim()  # a clear queued by the booking would have run by the end of this one
        assert rig.cache.clears == clears + 1  # only this one
    finally:
        for booking in held:
            booking.release()
