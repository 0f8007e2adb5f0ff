"""provider/slots ModelManager on real MLX with the tiny models, on a small machine emulated with
`memory_limit_gb`.

The emulated machine and the rigs that build it are in manager_rigs.py.

"Contended" (X = padded(M) + S/2 ≈ 498 MB), where medium and small genuinely contend:
* medium alone: needs padded(M) ≤ X — fits (25 MB spare);
* small resident, load medium: room = X − S < padded(M) — small must be evicted first;
* medium resident, load small: padded(S) ≈ 60 MB ≤ X − M ≈ 104 MB — fits beside it;
* medium and small resident, load tiny: padded(T) ≈ 6 MB ≤ X − M − S ≈ 54 MB — fits.

After every test: unload_all, the ledger is empty, the engine holds no model, and MLX active
memory is back to its baseline.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

from manager_rigs import LIMIT_GB, MESSAGES, NEVER_STOP, PROMPT, Rig, mlx_bytes, params, serve_once
from memory import GiB, Probe, ReservationKind, padded_weight_bytes
from memory.probe import read_mlx_counters
from protocol.errors import ErrorReason, FailureCode, RejectionReason
from provider.engine import ChatRequest, Finished, TextDelta
from provider.models import Inventory
from provider.slots import Admitted, LoadStep, ModelManager, ModelState, Refused, SlotRefused
from provider.tinymodel import weights_bytes


def contended_room(medium: Path, small: Path) -> int:
    return padded_weight_bytes(weights_bytes(medium)) + weights_bytes(small) // 2


class PauseAfterClaim:
    """A fault hook that holds a load right after its pending-load claim until `go` is set."""

    def __init__(self) -> None:
        self.at_claim, self.go = asyncio.Event(), asyncio.Event()
        self.steps: list[LoadStep] = []

    async def __call__(self, step: LoadStep, model_id: str) -> None:
        self.steps.append(step)
        if step is LoadStep.CLAIMED:
            self.at_claim.set()
            await self.go.wait()


# --------------------------------------------------------------------------------------------
# loads, eviction, refusal


async def test_a_load_that_fits_is_published_and_serves(rigs, tiny_model_path, small_model_path):
    make, baseline = rigs
    rig = make({"tiny": tiny_model_path, "small": small_model_path}, room_for_weights=200 * 10**6)
    m = rig.manager
    assert isinstance(m.admit("tiny", PROMPT, 4), Admitted)
    fin = await serve_once(m, "r1", "tiny", 4)
    assert fin.usage.completion_tokens >= 1
    assert m.state("tiny") is ModelState.LOADED and m.warm_models() == ["tiny"]
    assert len(rig.ledger) == 0  # the engine released the request's KV when it left the batch
    resident = mx.get_active_memory() - baseline
    # The weights, give or take what a first forward pass leaves in MLX's process-wide state (seen up to
    # ~300 KB when another test module ran first: graph constants, RNG state), never a second model.
    assert abs(resident - weights_bytes(tiny_model_path)) < 1024 * 1024


async def test_lru_idle_model_is_evicted_to_make_room(rigs, tiny_model_path, small_model_path, medium_model_path):
    """small (least recently used) and tiny resident; medium needs S/2 more than is left, so the
    LRU model (small) goes, and only it: without small there are X − T ≥ padded(M) bytes."""
    make, _ = rigs
    rig = make({"tiny": tiny_model_path, "small": small_model_path, "medium": medium_model_path},
               contended_room(medium_model_path, small_model_path))
    m = rig.manager
    await m.ensure_loaded("small")
    await m.ensure_loaded("tiny")  # now small is the least recently used
    verdict = dict((info.id, v) for info, v in m.verdicts())["medium"]
    assert verdict.verdict.value == "fits_after_eviction"
    admitted = m.admit("medium", PROMPT, 2)
    assert isinstance(admitted, Admitted) and admitted.evict == ("small",)

    await serve_once(m, "r1", "medium")
    assert m.state("small") is ModelState.NOT_LOADED and rig.engine.stats("small") is None
    assert m.state("tiny") is ModelState.LOADED
    assert m.state("medium") is ModelState.LOADED
    # and medium leaves room for small again beside it (X − M ≥ padded(S))
    await serve_once(m, "r2", "small")
    assert sorted(m.warm_models()) == ["medium", "small", "tiny"]


async def test_refused_when_evicting_every_idle_model_cannot_reach(rigs, tiny_model_path, small_model_path,
                                                                   medium_model_path):
    """small is serving (never evictable), tiny idle: evicting tiny frees T < S/2, so medium can
    never fit. Refused at once with memory_cap, and tiny is NOT evicted for nothing."""
    make, _ = rigs
    rig = make({"tiny": tiny_model_path, "small": small_model_path, "medium": medium_model_path},
               contended_room(medium_model_path, small_model_path), eos_token_ids={"small": NEVER_STOP})
    m = rig.manager
    await m.ensure_loaded("tiny")
    async with m.serve("busy", "small", PROMPT, 64) as slot:
        stream = slot.submit(ChatRequest("busy", MESSAGES, params(64)))
        assert isinstance(await anext(stream), TextDelta)  # in the batch now

        refused = m.admit("medium", PROMPT, 2)
        assert isinstance(refused, Refused)
        assert refused.status_code == 503 and refused.failure_code is FailureCode.CAPACITY
        assert refused.rejection_reason is RejectionReason.MEMORY_CAP
        with pytest.raises(SlotRefused) as exc:
            await serve_once(m, "r-medium", "medium")
        assert exc.value.failure.rejection is RejectionReason.MEMORY_CAP
        assert m.state("small") is ModelState.LOADED and m.state("tiny") is ModelState.LOADED
        assert m.state("medium") is ModelState.NOT_LOADED and rig.engine.stats("medium") is None
        assert len(rig.ledger) == 1 and "kv:busy" in rig.ledger  # only the busy request's KV
        await stream.aclose()


async def test_slot_cap_evicts_lru_then_refuses_when_all_are_busy(rigs, tiny_model_path, small_model_path,
                                                                  quantized_model_path):
    make, _ = rigs
    rig = make({"tiny": tiny_model_path, "small": small_model_path, "q4": quantized_model_path},
               200 * 10**6, max_model_slots=2, eos_token_ids={"tiny": NEVER_STOP, "small": NEVER_STOP})
    m = rig.manager
    await m.ensure_loaded("tiny")
    await m.ensure_loaded("small")
    await serve_once(m, "r-q4", "q4", 1)  # the slot cap forces out the LRU model: tiny
    assert m.state("tiny") is ModelState.NOT_LOADED and sorted(m.warm_models()) == ["q4", "small"]

    async with HoldServing(m, ("a", "small"), ("b", "q4")):
        refused = m.admit("tiny", PROMPT, 2)
        assert isinstance(refused, Refused) and refused.rejection_reason is RejectionReason.SLOT_STATE
        with pytest.raises(SlotRefused) as exc:
            await m.ensure_loaded("tiny")
        assert exc.value.failure.rejection is RejectionReason.SLOT_STATE


class HoldServing:
    """Hold two serving requests (in the batch) for the body, then cancel both."""

    def __init__(self, manager: ModelManager, *pairs: tuple[str, str]) -> None:
        self.manager, self.pairs, self.stack = manager, pairs, None

    async def __aenter__(self):
        self.stack = contextlib.AsyncExitStack()
        for rid, model in self.pairs:
            slot = await self.stack.enter_async_context(self.manager.serve(rid, model, PROMPT, 64))
            stream = slot.submit(ChatRequest(rid, MESSAGES, params(64)))
            assert isinstance(await anext(stream), TextDelta)
        return self

    async def __aexit__(self, *exc):
        await self.stack.aclose()


async def test_a_serving_model_is_never_evicted_by_the_idle_reaper(rigs, tiny_model_path):
    now = [1000.0]
    make, _ = rigs
    rig = make({"tiny": tiny_model_path}, 100 * 10**6, idle_timeout_s=60.0, clock=lambda: now[0],
               eos_token_ids={"tiny": NEVER_STOP})
    m = rig.manager
    async with m.serve("r", "tiny", PROMPT, 64) as slot:
        stream = slot.submit(ChatRequest("r", MESSAGES, params(64)))
        await anext(stream)
        now[0] += 3600
        assert await m.reap_idle() == []
        assert await m.unload("tiny") is False
        assert m.state("tiny") is ModelState.LOADED
    await rig.engine.kv_cache_bytes("tiny")  # a command round-trip: the engine has handled the cancel
    now[0] += 59
    assert await m.reap_idle() == []  # idle, but only for 59 s
    now[0] += 1
    assert await m.reap_idle() == ["tiny"]
    assert m.state("tiny") is ModelState.NOT_LOADED and rig.engine.stats("tiny") is None


async def test_idle_timeout_zero_means_never(rigs, tiny_model_path):
    now = [0.0]
    make, _ = rigs
    rig = make({"tiny": tiny_model_path}, 100 * 10**6, idle_timeout_s=0, clock=lambda: now[0])
    await rig.manager.ensure_loaded("tiny")
    now[0] += 10**9
    assert await rig.manager.reap_idle() == []
    assert rig.manager.state("tiny") is ModelState.LOADED


# --------------------------------------------------------------------------------------------
# single-flight


async def test_two_requests_for_one_cold_model_share_one_load(rigs, small_model_path, medium_model_path):
    """While medium loads, its pending claim holds padded(M) + 1 GiB: a second load of it could not
    fit. The second request must wait for the first load, not be refused, and not load again."""
    make, _ = rigs
    pause_after_claim = PauseAfterClaim()
    at_claim, go, steps = pause_after_claim.at_claim, pause_after_claim.go, pause_after_claim.steps

    rig = make({"medium": medium_model_path, "small": small_model_path},
               contended_room(medium_model_path, small_model_path), fault=pause_after_claim)
    m = rig.manager
    first = asyncio.create_task(serve_once(m, "r1", "medium"))
    await at_claim.wait()
    assert m.state("medium") is ModelState.LOADING
    # booked together at admission: the pending-load claim and r1's KV
    assert "load:medium" in rig.ledger and "kv:r1" in rig.ledger and len(rig.ledger) == 2
    assert isinstance(m.admit("medium", PROMPT, 2), Admitted)  # loading → accept, it will wait
    assert m.capacity().slots[0].state.value == "reloading"
    second = asyncio.create_task(serve_once(m, "r2", "medium"))
    await asyncio.sleep(0)  # one scheduling point: the task runs until it awaits the shared load
    assert not second.done() and m.state("medium") is ModelState.LOADING
    go.set()
    f1, f2 = await asyncio.gather(first, second)
    assert f1.usage.completion_tokens >= 1 and f2.usage.completion_tokens >= 1
    assert steps.count(LoadStep.CLAIMED) == 1 and steps.count(LoadStep.LOADED) == 1  # one load
    assert m.warm_models() == ["medium"]


async def test_a_cancelled_waiter_does_not_cancel_the_shared_load(rigs, tiny_model_path):
    make, _ = rigs
    pause = PauseAfterClaim()
    at_claim, go = pause.at_claim, pause.go

    rig = make({"tiny": tiny_model_path}, 100 * 10**6, fault=pause)
    m = rig.manager
    waiter = asyncio.create_task(serve_once(m, "r1", "tiny"))
    await at_claim.wait()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(rig.ledger) == 1  # the load's own claim, nothing of the cancelled request
    go.set()
    await m.ensure_loaded("tiny")
    assert m.state("tiny") is ModelState.LOADED and len(rig.ledger) == 0


# --------------------------------------------------------------------------------------------
# post-load guard and failure injection


def under_estimated(rig: Rig, model_id: str, claimed_weight_bytes: int) -> Inventory:
    """The inventory with one model's on-disk size under-stated: the gate's estimate is too low,
    which is exactly what the post-load guard exists for (seed: 'if the estimate under-counts')."""
    models = tuple(replace(m, weight_bytes=claimed_weight_bytes) if m.id == model_id else m
                   for m in rig.inventory.models)
    return replace(rig.inventory, models=models)


async def test_post_load_guard_refuses_and_leaves_nothing_loaded(rigs, tiny_model_path):
    """X = T − 1 MB. tiny claims to weigh 1 kB: the gate passes (padded 1.2 kB ≤ X), but measured
    headroom after the load is MIN_KV + X − T = 1 GiB − 1 MB < MIN_KV → unload, release, refuse."""
    make, baseline = rigs
    t = weights_bytes(tiny_model_path)
    rig = make({"tiny": tiny_model_path}, t - 10**6)
    m = rig.build(under_estimated(rig, "tiny", 1000))
    with pytest.raises(SlotRefused) as exc:
        await serve_once(m, "r1", "tiny")
    assert exc.value.failure.code is FailureCode.CAPACITY
    assert exc.value.failure.rejection is RejectionReason.MEMORY_CAP
    assert m.state("tiny") is ModelState.NOT_LOADED and rig.engine.stats("tiny") is None
    assert len(rig.ledger) == 0
    assert mx.get_active_memory() - baseline < 256 * 1024
    # the honest estimate is refused by the gate itself: padded(T) > X
    refused = rig.manager.admit("tiny", PROMPT, 2)
    assert isinstance(refused, Refused) and refused.rejection_reason is RejectionReason.MEMORY_CAP


class Injected(RuntimeError):
    pass


@pytest.mark.parametrize("step", [LoadStep.CLAIMED, LoadStep.ENGINE_LOADING, LoadStep.LOADED, LoadStep.GUARD,
                                  LoadStep.GUARD_UNLOAD])
async def test_a_failure_at_each_load_step_leaves_a_clean_slate(rigs, tiny_model_path, step):
    make, baseline = rigs
    t = weights_bytes(tiny_model_path)
    fired: list[LoadStep] = []

    async def fail_at(at: LoadStep, model_id: str) -> None:
        if at is step and not fired:
            fired.append(at)
            raise Injected

    # GUARD_UNLOAD is only reached when the guard refuses: use the under-estimate set-up for it.
    guard_case = step is LoadStep.GUARD_UNLOAD
    rig = make({"tiny": tiny_model_path}, t - 10**6 if guard_case else 100 * 10**6, fault=fail_at)
    m = rig.build(under_estimated(rig, "tiny", 1000)) if guard_case else rig.manager
    with pytest.raises(SlotRefused) as exc:
        await serve_once(m, "r1", "tiny")
    assert fired == [step]
    assert exc.value.failure.code is FailureCode.MODEL_UNAVAILABLE
    assert exc.value.failure.reason is ErrorReason.MODEL_LOAD and exc.value.failure.status_code == 503
    assert m.state("tiny") is ModelState.NOT_LOADED and rig.engine.stats("tiny") is None
    assert len(rig.ledger) == 0
    assert mx.get_active_memory() - baseline < 256 * 1024
    if not guard_case:  # and the next attempt loads normally
        await serve_once(m, "r2", "tiny")
        assert m.state("tiny") is ModelState.LOADED


async def test_an_engine_load_failure_releases_the_claim(rigs, tiny_model_path, tmp_path):
    make, baseline = rigs
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_path, broken)
    rig = make({"broken": broken}, 100 * 10**6)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 4096])  # truncated after discovery: the engine fails
    with pytest.raises(SlotRefused) as exc:
        await serve_once(rig.manager, "r1", "broken")
    assert exc.value.failure.reason is ErrorReason.MODEL_LOAD
    assert rig.manager.state("broken") is ModelState.NOT_LOADED and len(rig.ledger) == 0
    assert mx.get_active_memory() - baseline < 256 * 1024


# --------------------------------------------------------------------------------------------
# per-request KV reservations


async def test_kv_reservation_is_held_while_serving_and_released_by_the_engine(rigs, tiny_model_path):
    make, _ = rigs
    rig = make({"tiny": tiny_model_path}, 100 * 10**6)
    m = rig.manager
    async with m.serve("r1", "tiny", PROMPT, 8) as slot:
        assert rig.ledger.bytes_of("kv:r1") == slot.kv.nbytes > 0
        cap = m.capacity().slots[0]
        assert cap.active_token_budget_used == slot.kv.tokens == PROMPT + 8
        assert cap.max_tokens_potential == 8
        _, fin = await slot.submit(ChatRequest("r1", MESSAGES, params(8))).collect()
        assert isinstance(fin, Finished)
        assert "kv:r1" not in rig.ledger  # released on the engine thread before Finished was delivered
    assert len(rig.ledger) == 0


async def test_kv_reservation_released_on_cancel_and_when_never_submitted(rigs, tiny_model_path):
    make, _ = rigs
    rig = make({"tiny": tiny_model_path}, 100 * 10**6, eos_token_ids={"tiny": NEVER_STOP})
    m = rig.manager
    async with m.serve("never", "tiny", PROMPT, 8):
        assert "kv:never" in rig.ledger
    assert len(rig.ledger) == 0  # released by the context exit

    with pytest.raises(Injected):
        async with m.serve("cancelled", "tiny", PROMPT, 500) as slot:
            stream = slot.submit(ChatRequest("cancelled", MESSAGES, params(500)))
            await anext(stream)
            raise Injected  # the consumer goes away mid-stream
    await rig.engine.kv_cache_bytes("tiny")  # a command round-trip: the engine has handled the cancel
    assert len(rig.ledger) == 0
    assert m.capacity().slots[0].active_token_budget_used == 0


async def test_kv_reservation_released_when_the_engine_refuses_the_request(rigs, tiny_model_path):
    make, _ = rigs
    rig = make({"tiny": tiny_model_path}, 100 * 10**6)
    m = rig.manager
    async with m.serve("dup", "tiny", PROMPT, 4) as slot:
        slot.submit(ChatRequest("dup", MESSAGES, params(4)))
        with pytest.raises(RuntimeError):
            slot.submit(ChatRequest("dup", MESSAGES, params(4)))
    await rig.engine.kv_cache_bytes("tiny")
    assert len(rig.ledger) == 0
    with pytest.raises(SlotRefused) as exc:
        async with m.serve("too-long", "tiny", 4096, 4):
            pass
    assert exc.value.failure.reason is ErrorReason.REQUEST_EXCEEDS_CONTEXT


# --------------------------------------------------------------------------------------------
# draining, capacity


async def test_draining_refuses_admission_and_serving(rigs, tiny_model_path):
    make, _ = rigs
    rig = make({"tiny": tiny_model_path}, 100 * 10**6)
    m = rig.manager
    await m.ensure_loaded("tiny")
    m.start_draining()
    refused = m.admit("tiny", PROMPT, 2)
    assert isinstance(refused, Refused) and refused.error_reason is ErrorReason.DRAINING
    with pytest.raises(SlotRefused) as exc:
        await serve_once(m, "r", "tiny")
    assert exc.value.failure.reason is ErrorReason.DRAINING
    unknown = m.admit("nope", PROMPT, 2)
    assert isinstance(unknown, Refused)  # draining is answered first
    await m.unload_all()
    assert m.warm_models() == [] and rig.engine.stats("tiny") is None


async def test_unknown_model_is_404(rigs, tiny_model_path):
    make, _ = rigs
    rig = make({"tiny": tiny_model_path}, 100 * 10**6)
    refused = rig.manager.admit("nope", PROMPT, 2)
    assert isinstance(refused, Refused)
    assert refused.status_code == 404 and refused.failure_code is FailureCode.MODEL_UNAVAILABLE


async def test_capacity_report(rigs, tiny_model_path, small_model_path):
    make, baseline = rigs
    rig = make({"tiny": tiny_model_path, "small": small_model_path}, 200 * 10**6)
    m = rig.manager
    await m.ensure_loaded("tiny")
    report = m.capacity()
    assert report.warm_models == ("tiny",) and report.slots[0].state.value == "running"
    assert report.total_memory_bytes == int(LIMIT_GB * GiB)
    assert report.mlx_active_bytes - baseline >= weights_bytes(tiny_model_path) - 256 * 1024
    # tiny is idle, so it counts as evictable: free_for_load = X (everything above A + MIN_KV)
    assert abs(report.free_for_load_bytes - 200 * 10**6) < 10**6
    assert report.slots[0].kv_bytes_per_token == rig.inventory.get("tiny").kv_bytes_per_token
    assert report.slots[0].max_concurrency >= 1


# --------------------------------------------------------------------------------------------
# unloading


async def test_unload_purges_the_models_kv_after_the_engine_dropped_it(rigs, tiny_model_path):
    make, _ = rigs
    purged: list[tuple[str, bool]] = []
    rig = None

    async def purge(model_id: str) -> None:
        purged.append((model_id, rig.engine.stats(model_id) is None))

    rig = make({"tiny": tiny_model_path}, 100 * 10**6, kv_purge=purge)
    await serve_once(rig.manager, "r", "tiny", 1)
    assert purged == []
    assert await rig.manager.unload("tiny") is True
    assert purged == [("tiny", True)]


async def test_a_waiter_gives_up_after_load_wait_timeout_but_the_load_goes_on(rigs, tiny_model_path):
    make, _ = rigs
    pause = PauseAfterClaim()
    at_claim, go = pause.at_claim, pause.go

    rig = make({"tiny": tiny_model_path}, 100 * 10**6, fault=pause, load_wait_timeout_s=0.2)
    m = rig.manager
    with pytest.raises(SlotRefused) as exc:
        await serve_once(m, "r1", "tiny")
    assert at_claim.is_set()
    assert exc.value.failure.reason is ErrorReason.CAPACITY_TIMEOUT and exc.value.failure.status_code == 503
    assert m.state("tiny") is ModelState.LOADING and "kv:r1" not in rig.ledger
    go.set()
    # The load goes on without its waiter; wait on the load itself (the 0.2 s waiter deadline is
    # shorter than a load on a busy 2-core machine), then a new request is served by that load.
    load_task = m._s.slots["tiny"].load_task
    assert load_task is not None
    assert await asyncio.wait_for(asyncio.shield(load_task), 60) is None
    assert m.state("tiny") is ModelState.LOADED
    await serve_once(m, "r2", "tiny")


async def test_publish_and_unload_each_tell_the_capacity_listener(rigs, tiny_model_path):
    make, _ = rigs
    rig = make({"tiny": tiny_model_path}, 100 * 10**6)
    m = rig.manager
    seen: list[list[str]] = []
    m.on_capacity_change = lambda: seen.append(m.warm_models())
    await serve_once(m, "r1", "tiny")
    assert seen == [["tiny"]]  # called once the model is published, not while it loads
    assert await m.unload("tiny")
    assert seen == [["tiny"], []]


# --------------------------------------------------------------------------------------------
# one memory reading shared by the requests that arrive together


async def test_requests_arriving_together_share_one_memory_reading(rigs, tiny_model_path):
    """Admission reads the machine through `Probe.recent()`: eight requests booked in one instant (the
    probe's clock never moves here) read it once between them, where each used to read it several
    times; the ledger stays live, so the eighth still sees the seven before it. An unload tells the
    probe, so what admission reads next shows the weights gone although no time has passed."""
    make, baseline = rigs
    rig = make({"tiny": tiny_model_path}, 100 * 10**6)
    reads: list[int] = []
    now = [0.0]

    def counters():
        reads.append(1)
        return read_mlx_counters()

    probe = Probe(memory_limit_gb=LIMIT_GB, mlx_counters=counters, clock=lambda: now[0], rss=mlx_bytes)
    m = rig.manager = ModelManager(rig.engine, rig.inventory, rig.ledger, rig.figures, probe,
                                   max_model_slots=3, idle_timeout_s=None, settle_timeout_s=2.0)
    await m.ensure_loaded("tiny")
    now[0] += 1.0  # the reading the load left behind is stale now
    reads.clear()
    bookings = []
    for i in range(8):
        assert m.precheck("tiny", PROMPT, 4) is None
        booked = m.book(f"b{i}", "tiny", PROMPT, 4)
        assert not isinstance(booked, Refused)
        bookings.append(booked)
    assert len(reads) == 1
    assert rig.ledger.snapshot().count_by_kind[ReservationKind.REQUEST_KV] == 8  # each saw the ones before
    for booked in bookings:
        booked.release()
    assert len(rig.ledger) == 0

    now[0] += 1.0  # a request on its own: one reading for its whole admission
    assert m.precheck("tiny", PROMPT, 4) is None
    lone = m.book("lone", "tiny", PROMPT, 4)
    assert not isinstance(lone, Refused) and len(reads) == 2
    lone.release()

    loaded = probe.recent().mlx_active_bytes
    assert loaded - baseline >= weights_bytes(tiny_model_path) - 256 * 1024
    assert await m.unload("tiny")
    assert probe.recent().mlx_active_bytes < loaded - weights_bytes(tiny_model_path) // 2
