"""provider/slots pure decisions on hand-built snapshots: no MLX.

The machine (P = 16 GiB, eff_cap = 12 GiB) and the snapshots' builders are in admission_figures.py.
"""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from admission_figures import FIG, MiB, model, slot, snap, view
from memory import GiB, Ledger, MemorySnapshot, ReservationKind, fit, padded_weight_bytes
from protocol.errors import ErrorReason, FailureCode, RejectionReason
from provider.models import ModelInfo
from provider.slots import Admitted, BatchKv, ManagerView, ModelState, Refused, RoomPlan, SlotView, decide, plan_room
from provider.slots.leases import KvReservation
from provider.slots.state import InvalidTransition, ModelSlot


def test_worked_figures():
    assert FIG.hard_cap_bytes == 14 * GiB and FIG.effective_cap_bytes == 12 * GiB
    assert FIG.load_headroom_bytes == 4 * GiB and FIG.single_request_limit_bytes == 7 * GiB


def admit(v: ManagerView, s: MemorySnapshot, info: ModelInfo | None, prompt: int = 100, max_tokens: int | None = 100):
    return decide(v, FIG, s, model_id=info.id if info else "unknown", info=info, prompt_tokens=prompt,
                  max_tokens=max_tokens)


# --------------------------------------------------------------------------------------------
# The admission rules of `decide`, one at a time


def test_unknown_model_is_404_and_draining_comes_first():
    r = admit(view(), snap(), None)
    assert isinstance(r, Refused) and r.status_code == 404 and r.failure_code is FailureCode.MODEL_UNAVAILABLE
    r = admit(view(draining=True), snap(), model("m", GiB))
    assert isinstance(r, Refused) and r.status_code == 503 and r.error_reason is ErrorReason.DRAINING


def test_a_model_that_can_never_fit_is_request_exceeds_node():
    """7 GiB on disk → padded 8.4 GiB + 4 GiB headroom = 12.4 GiB > eff_cap 12 GiB."""
    r = admit(view(), snap(), model("big", 7 * GiB))
    assert isinstance(r, Refused) and r.status_code == 503
    assert r.rejection_reason is RejectionReason.MEMORY_CAP and r.error_reason is ErrorReason.REQUEST_EXCEEDS_NODE


def test_cold_load_evicts_the_lru_idle_model_only_when_needed():
    """a (4 GiB, idle, older) and b (3 GiB, busy) resident: room = 12 − 7 = 5 GiB. c is 2.5 GiB on
    disk → 3 GiB padded → needs 7 GiB: evicting a gives 9 GiB."""
    a = slot("a", last_used=1.0, resident=4 * GiB)
    b = slot("b", busy=True, last_used=0.0, resident=3 * GiB)
    r = admit(view(a, b), snap(a, b), model("c", 5 * GiB // 2))
    assert isinstance(r, Admitted) and r.cold and r.evict == ("a",)
    small = admit(view(a, b), snap(a, b), model("d", GiB // 2))  # 0.6 + 4 ≤ 5: no eviction
    assert isinstance(small, Admitted) and small.evict == ()


def test_cold_load_refused_with_memory_cap_when_nothing_idle_reaches():
    a = slot("a", busy=True, resident=4 * GiB)
    b = slot("b", busy=True, resident=3 * GiB)
    r = admit(view(a, b), snap(a, b), model("c", 5 * GiB // 2))
    assert isinstance(r, Refused) and r.rejection_reason is RejectionReason.MEMORY_CAP
    assert r.error_reason is ErrorReason.CAPACITY_BUSY  # transient: it may fit later


def test_slot_cap_with_nothing_evictable_is_slot_state():
    a, b = slot("a", busy=True, resident=GiB), slot("b", state=ModelState.LOADING)
    r = admit(view(a, b, max_slots=2), snap(a), model("c", MiB))
    assert isinstance(r, Refused) and r.rejection_reason is RejectionReason.SLOT_STATE
    a_idle = slot("a", resident=GiB)
    r = admit(view(a_idle, b, max_slots=2), snap(a_idle), model("c", MiB))
    assert isinstance(r, Admitted) and r.evict == ("a",)


def test_a_loading_model_admits_what_its_claim_and_the_room_can_hold():
    """m loads: its claim (padded 6 GiB + 1 GiB of KV) and 1.5 GiB of requests booked with it are
    outstanding: available = 12 − 3 − 8.5 = 0.5 GiB. A request waiting for the load counts like one
    on a resident model (before, every request for a loading model was accepted)."""
    info = model("m", 5 * GiB)
    loading = SlotView("m", ModelState.LOADING, True, 0.0, 0, BatchKv(3, 512, int(1.5 * GiB)))
    r = admit(view(loading, outstanding=int(8.5 * GiB)), snap(), info, prompt=100, max_tokens=100)
    assert isinstance(r, Admitted) and r.cold and r.claim_bytes == 0  # 512 tokens of 1 MiB each fit in 0.5 GiB
    # 1024 tokens pad the batch of four to 4 GiB: a 2.5 GiB share does not fit
    r = admit(view(loading, outstanding=int(8.5 * GiB)), snap(), info, prompt=900, max_tokens=124)
    assert isinstance(r, Refused) and r.rejection_reason in (RejectionReason.TOKEN_BUDGET, RejectionReason.KV_HEADROOM)
    # the claim's KV part (MIN_KV not yet taken by requests) becomes this request's first
    with_kv_part = SlotView("m", ModelState.LOADING, True, 0.0, 0, BatchKv(3, 512, int(1.5 * GiB)),
                            claim_kv_bytes=2 * GiB)
    r = admit(view(with_kv_part, outstanding=int(8.5 * GiB)), snap(), info, prompt=900, max_tokens=124)
    assert isinstance(r, Admitted) and r.share == int(2.5 * GiB)


def test_a_cold_model_books_its_claim_with_the_first_request():
    info = model("m", 5 * GiB)
    r = admit(view(), snap(), info, prompt=100, max_tokens=100)  # 200 tokens → one 256-token block
    assert isinstance(r, Admitted) and r.cold and r.share == 256 * MiB
    assert r.claim_bytes == padded_weight_bytes(5 * GiB) + GiB - 256 * MiB  # MIN_KV less its own share


def test_no_more_requests_than_the_engine_runs_at_once():
    m = SlotView("m", ModelState.LOADED, True, 0.0, GiB, BatchKv(4, 256, 4 * 256 * MiB))
    full = ManagerView({"m": m}, 3, False, GiB, GiB, batch_size=4)
    r = admit(full, snap(m), model("m", GiB), prompt=10, max_tokens=10)
    assert isinstance(r, Refused) and r.status_code == 503 and r.error_reason is ErrorReason.QUEUE_FULL
    room = ManagerView({"m": m}, 3, False, GiB, GiB, batch_size=5)
    assert isinstance(admit(room, snap(m), model("m", GiB), prompt=10, max_tokens=10), Admitted)


def test_a_model_being_unloaded_is_refused_with_slot_state():
    m = slot("m", state=ModelState.UNLOADING, resident=GiB)
    r = admit(view(m), snap(m), model("m", GiB))
    assert isinstance(r, Refused) and r.rejection_reason is RejectionReason.SLOT_STATE


def test_resident_model_kv_token_budget_vs_kv_headroom():
    """m resident 4 GiB: available = 12 − 4 − 3 = 5 GiB before reservations; 1 MiB per token."""
    m = slot("m", busy=True, resident=4 * GiB)
    info = model("m", 4 * GiB)
    # 2 GiB held by in-flight requests → 3 GiB available; 4096 tokens = 4 GiB would fit without them
    busy = view(m, outstanding=2 * GiB, request_kv=2 * GiB)
    r = admit(busy, snap(m), info, prompt=2048, max_tokens=2048)
    assert isinstance(r, Refused) and r.rejection_reason is RejectionReason.TOKEN_BUDGET
    assert r.error_reason is ErrorReason.TOKEN_BUDGET_EXHAUSTED and r.available_token_budget == 3072
    # 6144 tokens = 6 GiB > 5 GiB even with no request in flight → memory itself is short
    r = admit(busy, snap(m), info, prompt=2048, max_tokens=4096)
    assert isinstance(r, Refused) and r.rejection_reason is RejectionReason.KV_HEADROOM
    # fits now → accept, no eviction
    r = admit(view(m), snap(m), info, prompt=2048, max_tokens=2048)
    assert isinstance(r, Admitted) and not r.cold and r.kv.tokens == 4096 and r.kv.nbytes == 4 * GiB


def test_resident_model_kv_may_evict_an_idle_neighbour():
    m, other = slot("m", resident=4 * GiB), slot("o", resident=2 * GiB)
    r = admit(view(m, other), snap(m, other), model("m", 4 * GiB), prompt=2048, max_tokens=2048)
    assert isinstance(r, Admitted) and r.evict == ("o",)  # 3 GiB available, 5 GiB after evicting o


def test_kv_request_limits_and_context():
    info = model("m", GiB, per_token=2 * MiB, context=8192)
    r = admit(view(), snap(), info, prompt=8192, max_tokens=1)
    assert isinstance(r, Refused) and r.error_reason is ErrorReason.REQUEST_EXCEEDS_CONTEXT
    r = admit(view(), snap(), info, prompt=4000, max_tokens=4000)  # 8000 → 8192 slots × 2 MiB = 16 GiB > 7
    assert isinstance(r, Refused) and r.error_reason is ErrorReason.REQUEST_EXCEEDS_NODE_BUDGET
    ok = admit(view(), snap(), model("m", GiB, per_token=MiB // 2), prompt=100, max_tokens=None)
    assert isinstance(ok, Admitted) and ok.kv.tokens == 8192  # default max_tokens, clamped to context
    assert ok.kv.max_tokens == 8092 and ok.kv.nbytes == 4 * GiB
    # 100 tokens allocate a whole 256-token block
    assert admit(view(), snap(), model("m", GiB), prompt=60, max_tokens=40).kv.nbytes == 256 * MiB


# --------------------------------------------------------------------------------------------
# plan_room properties


@st.composite
def scenes(draw):
    n = draw(st.integers(0, 5))
    slots = []
    for i in range(n):
        state = draw(st.sampled_from([ModelState.LOADED, ModelState.LOADED, ModelState.LOADING, ModelState.UNLOADING]))
        resident = draw(st.integers(0, 5 * GiB)) if state is not ModelState.LOADING else 0
        slots.append(slot(f"m{i}", state, busy=draw(st.booleans()), last_used=draw(st.floats(0, 100)),
                          resident=resident))
    max_slots = draw(st.integers(1, 4))
    outstanding = draw(st.integers(0, 4 * GiB))
    extra_active = draw(st.integers(0, 2 * GiB))
    on_disk = draw(st.integers(0, 10 * GiB))
    return view(*slots, max_slots=max_slots, outstanding=outstanding), snap(*slots, extra_active=extra_active), on_disk


def _fits(v: ManagerView, s: MemorySnapshot, on_disk: int, victims: list[SlotView]) -> tuple[bool, bool]:
    leaving = sum(x.resident_bytes for x in v.slots.values() if x.state is ModelState.UNLOADING)
    r = fit(FIG, s, on_disk, evictable_bytes=leaving + sum(x.resident_bytes for x in victims),
            outstanding_bytes=v.outstanding_bytes)
    occupied = sum(1 for x in v.slots.values() if x.state in (ModelState.LOADING, ModelState.LOADED))
    return r.required_bytes <= r.room_after_eviction_bytes, occupied - len(victims) < v.max_model_slots


@settings(max_examples=300, deadline=None)
@given(scenes())
def test_plan_room_evicts_the_shortest_lru_prefix_of_idle_models_or_refuses(scene):
    v, s, on_disk = scene
    plan = plan_room(v, FIG, s, target="new", weight_bytes_on_disk=on_disk)
    idle_lru = sorted((x for x in v.slots.values() if x.idle), key=lambda x: (x.last_used, x.model_id))
    if isinstance(plan, RoomPlan):
        k = len(plan.victims)
        assert list(plan.victims) == [x.model_id for x in idle_lru[:k]]  # idle only, LRU first
        assert all(_fits(v, s, on_disk, idle_lru[:k]))
        if k:
            assert not all(_fits(v, s, on_disk, idle_lru[:k - 1]))  # no needless eviction
    else:
        assert isinstance(plan, Refused) and plan.status_code == 503
        assert not all(_fits(v, s, on_disk, idle_lru))  # even evicting every idle model would not do
        memory_ok, _ = _fits(v, s, on_disk, idle_lru)
        if plan.rejection_reason is RejectionReason.SLOT_STATE:
            assert any(_fits(v, s, on_disk, idle_lru[:k])[0] for k in range(len(idle_lru) + 1))
        if padded_weight_bytes(on_disk) + FIG.load_headroom_bytes > FIG.effective_cap_bytes:
            assert plan.error_reason is ErrorReason.REQUEST_EXCEEDS_NODE


@settings(max_examples=200, deadline=None)
@given(scenes(), st.integers(0, 4096), st.one_of(st.none(), st.integers(1, 8192)))
def test_decide_is_pure_and_never_accepts_a_cold_model_plan_room_refuses(scene, prompt, max_tokens):
    v, s, on_disk = scene
    info = model("new", on_disk, per_token=64 * 1024)
    first = decide(v, FIG, s, model_id="new", info=info, prompt_tokens=prompt, max_tokens=max_tokens)
    assert first == decide(v, FIG, s, model_id="new", info=info, prompt_tokens=prompt, max_tokens=max_tokens)
    if isinstance(first, Admitted):
        assert isinstance(plan_room(v, FIG, s, target="new", weight_bytes_on_disk=on_disk), RoomPlan)
        assert first.kv.nbytes <= FIG.single_request_limit_bytes


# --------------------------------------------------------------------------------------------
# state table and the release-once reservation


def test_state_transitions_follow_the_table():
    s = ModelSlot(model("m", GiB))
    for step in (ModelState.LOADING, ModelState.LOADED, ModelState.UNLOADING, ModelState.NOT_LOADED,
                 ModelState.LOADING, ModelState.NOT_LOADED):
        s.state = step
    try:
        s.state = ModelState.LOADED
    except InvalidTransition as exc:
        assert "NOT_LOADED -> LOADED" in str(exc)
    else:
        raise AssertionError("NOT_LOADED -> LOADED must be refused")


def test_kv_reservation_is_released_exactly_once_across_threads():
    ledger = Ledger(FIG)
    s = snap()
    slot_ = ModelSlot(model("m", GiB))
    for round_no in range(20):
        granted, _ = slot_.kv_book.reserve(ledger, slot_.info.kv, "r", "kv:r", 16, 8, MiB, snapshot=s)
        assert granted.granted
        reservation = KvReservation(ledger, slot_, "r", None)
        barrier = threading.Barrier(8)

        def release() -> None:
            barrier.wait()
            reservation.release("r")

        threads = [threading.Thread(target=release) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(ledger) == 0, round_no
        # the id is reused by a later request: a late, duplicate release must not free it
        assert ledger.reserve("kv:r", ReservationKind.REQUEST_KV, MiB, snapshot=s).granted
        reservation.release()
        assert ledger.bytes_of("kv:r") == MiB
        ledger.release("kv:r")


def test_pressure_names_the_lru_idle_model_only_at_yellow_or_worse():
    """P = 16 GiB; YELLOW from 65 %: 8 GiB resident + 2 GiB incoming = 62.5 % (GREEN), + 3 GiB = 68.75 %."""
    from provider.slots import pressure_victim

    old, new, busy = (slot("old", last_used=1.0, resident=4 * GiB), slot("new", last_used=2.0, resident=2 * GiB),
                      slot("busy", busy=True, resident=2 * GiB))
    v, s = view(old, new, busy), snap(old, new, busy)
    assert pressure_victim(v, s, target="x", incoming_bytes=2 * GiB) is None
    assert pressure_victim(v, s, target="x", incoming_bytes=3 * GiB) == "old"
    assert pressure_victim(view(busy), snap(busy, extra_active=8 * GiB), target="x", incoming_bytes=3 * GiB) is None
