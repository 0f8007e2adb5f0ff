"""memory.ledger: atomic check-and-insert, typed reservations, idempotent release, concurrency."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from memory.ledger import Lease, Ledger, Rejection, RejectionReason, ReservationKind
from memory.policy import MIN_KV_BYTES, GiB, compute_figures, figures
from memory.snapshot import MemorySnapshot

MiB = 2**20
FIG = figures(16 * GiB, env={})  # eff_cap 12 GiB, A 3 GiB → 9 GiB headroom on an idle box
IDLE = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=15 * GiB)


def test_reserve_admits_up_to_available_then_refuses() -> None:
    ledger = Ledger(FIG)
    assert ledger.available_bytes(IDLE) == 9 * GiB
    a = ledger.reserve("a", ReservationKind.REQUEST_KV, 5 * GiB, snapshot=IDLE)
    assert isinstance(a, Lease) and a.granted and a.nbytes == 5 * GiB
    assert ledger.available_bytes(IDLE) == 4 * GiB
    b = ledger.reserve("b", ReservationKind.MEDIA, 4 * GiB + 1, snapshot=IDLE)
    assert isinstance(b, Rejection) and not b.granted
    assert b.reason is RejectionReason.INSUFFICIENT_MEMORY and b.available_bytes == 4 * GiB
    assert "b" not in ledger
    assert ledger.reserve("b", ReservationKind.MEDIA, 4 * GiB, snapshot=IDLE).granted
    assert ledger.available_bytes(IDLE) == 0
    assert ledger.outstanding_bytes() == 9 * GiB


def test_live_usage_shrinks_what_is_admitted() -> None:
    ledger = Ledger(FIG)
    busy = replace(IDLE, mlx_active_bytes=6 * GiB, mlx_cache_bytes=GiB)  # 12 − 7 − 3 = 2 GiB
    assert not ledger.reserve("x", ReservationKind.REQUEST_KV, 2 * GiB + 1, snapshot=busy).granted
    assert ledger.reserve("x", ReservationKind.REQUEST_KV, 2 * GiB, snapshot=busy).granted


def test_duplicate_ids_refused_and_release_idempotent() -> None:
    ledger = Ledger(FIG)
    assert ledger.reserve("r1", ReservationKind.REQUEST_KV, GiB, snapshot=IDLE).granted
    dup = ledger.reserve("r1", ReservationKind.MEDIA, MiB, snapshot=IDLE)
    assert isinstance(dup, Rejection) and dup.reason is RejectionReason.DUPLICATE_ID
    assert ledger.bytes_of("r1") == GiB and ledger.outstanding_bytes() == GiB
    assert ledger.release("r1") == GiB
    assert ledger.release("r1") == 0
    assert ledger.release("never-reserved") == 0
    assert ledger.outstanding_bytes() == 0 and len(ledger) == 0
    # After release the id may be used again.
    assert ledger.reserve("r1", ReservationKind.REQUEST_KV, GiB, snapshot=IDLE).granted


def test_single_request_limit_and_invalid_size() -> None:
    big_fig = figures(128 * GiB, env={})
    idle = MemorySnapshot(physical_bytes=128 * GiB, available_bytes=127 * GiB)
    ledger = Ledger(big_fig)
    half = big_fig.hard_cap_bytes // 2
    over = ledger.reserve("kv", ReservationKind.REQUEST_KV, half + 1, snapshot=idle)
    assert isinstance(over, Rejection) and over.reason is RejectionReason.OVER_SINGLE_REQUEST_LIMIT
    assert ledger.reserve("kv", ReservationKind.REQUEST_KV, half, snapshot=idle).granted
    # The half-cap rule is for request KV only; a load claim may be larger.
    ledger.release("kv")
    assert ledger.claim_pending_load("load", half + GiB, snapshot=idle).granted
    neg = ledger.reserve("neg", ReservationKind.MEDIA, -1, snapshot=idle)
    assert isinstance(neg, Rejection) and neg.reason is RejectionReason.INVALID_SIZE
    with pytest.raises(ValueError):
        ledger.reduce("load", -1)


def test_pending_load_lifecycle_and_post_load_guard() -> None:
    ledger = Ledger(FIG)
    weights = 4 * GiB
    claim = ledger.claim_pending_load("load:m", weights + MIN_KV_BYTES, snapshot=IDLE)
    assert isinstance(claim, Lease) and claim.kind is ReservationKind.PENDING_LOAD
    # A concurrent request cannot take memory the load was promised.
    assert not ledger.reserve("req", ReservationKind.REQUEST_KV, 4 * GiB + 1, snapshot=IDLE).granted
    assert ledger.reserve("req", ReservationKind.REQUEST_KV, 4 * GiB, snapshot=IDLE).granted
    # Weights become resident in halves; the claim shrinks as they show up in mlx_used.
    assert ledger.reduce("load:m", 2 * GiB) == 3 * GiB
    assert ledger.reduce("load:m", 2 * GiB) == MIN_KV_BYTES
    assert ledger.reduce("load:m", 10 * GiB) == 0  # floored, still outstanding
    assert "load:m" in ledger
    loaded = replace(IDLE, mlx_active_bytes=weights)  # live headroom 12 − 4 − 3 = 5 GiB
    # Guard: 5 ≥ MIN_KV 1 + the request's 4 → serveable ...
    assert ledger.load_is_serveable(loaded, pending_load_id="load:m")
    assert ledger.reserve("req2", ReservationKind.REQUEST_KV, GiB, snapshot=loaded).granted
    # ... and with one more GiB of requests outstanding it would not be.
    assert not ledger.load_is_serveable(loaded, pending_load_id="load:m")
    assert ledger.release("load:m") == 0  # installed: its bytes are in mlx_used now
    assert ledger.release("req") == 4 * GiB and ledger.release("req2") == GiB
    too_big = ledger.claim_pending_load("x", 5 * GiB + 1, snapshot=loaded)
    assert isinstance(too_big, Rejection) and too_big.reason is RejectionReason.INSUFFICIENT_MEMORY
    assert ledger.claim_pending_load("x", 5 * GiB, snapshot=loaded).granted
    assert ledger.reduce("unknown", GiB) == 0


def test_guard_excludes_only_the_load_claim() -> None:
    ledger = Ledger(FIG)
    loaded = replace(IDLE, mlx_active_bytes=7 * GiB)  # live headroom 2 GiB
    assert ledger.claim_pending_load("load", GiB, snapshot=IDLE).granted
    assert ledger.reserve("kv", ReservationKind.REQUEST_KV, GiB, snapshot=IDLE).granted
    assert ledger.load_is_serveable(loaded, pending_load_id="load")  # 2 ≥ 1 + 1
    assert not ledger.load_is_serveable(loaded)  # counting the claim too: 2 < 1 + 2


def test_replace_figures_applies_to_later_admissions() -> None:
    ledger = Ledger(FIG)
    assert ledger.reserve("a", ReservationKind.MEDIA, 5 * GiB, snapshot=IDLE).granted
    ledger.replace_figures(figures(16 * GiB, env={}, memory_limit_gb=10))  # eff_cap 6, headroom 3 GiB
    assert ledger.figures.effective_cap_bytes == 6 * GiB
    assert ledger.outstanding_bytes() == 5 * GiB
    assert ledger.available_bytes(IDLE) == 0
    assert not ledger.reserve("b", ReservationKind.MEDIA, 1, snapshot=IDLE).granted


def test_snapshot_counts_and_bytes_by_kind() -> None:
    ledger = Ledger(FIG)
    ledger.reserve("a", ReservationKind.REQUEST_KV, 100, snapshot=IDLE)
    ledger.reserve("b", ReservationKind.REQUEST_KV, 50, snapshot=IDLE)
    ledger.reserve("c", ReservationKind.PREFIX_CACHE, 7, snapshot=IDLE)
    ledger.claim_pending_load("d", 1000, snapshot=IDLE)
    snap = ledger.snapshot()
    assert snap.count_by_kind[ReservationKind.REQUEST_KV] == 2
    assert snap.bytes_by_kind[ReservationKind.REQUEST_KV] == 150
    assert snap.count_by_kind[ReservationKind.MEDIA] == 0 and snap.bytes_by_kind[ReservationKind.MEDIA] == 0
    assert snap.bytes_by_kind[ReservationKind.PREFIX_CACHE] == 7
    assert snap.bytes_by_kind[ReservationKind.PENDING_LOAD] == 1000
    assert snap.count == 4 and snap.total_bytes == 1157 == ledger.outstanding_bytes()
    assert set(snap.count_by_kind) == set(ReservationKind)
    assert ReservationKind("media") is ReservationKind.MEDIA  # the wire/telemetry spelling


def test_grow_takes_the_same_capacity_check_as_reserve() -> None:
    ledger = Ledger(FIG)
    assert ledger.reserve("p", ReservationKind.PREFIX_CACHE, 5 * GiB, snapshot=IDLE).granted
    assert ledger.reserve("kv", ReservationKind.REQUEST_KV, GiB, snapshot=IDLE).granted
    grown = ledger.grow("p", ReservationKind.PREFIX_CACHE, 2 * GiB, snapshot=IDLE)
    assert isinstance(grown, Lease) and grown.nbytes == 2 * GiB and ledger.bytes_of("p") == 7 * GiB
    over = ledger.grow("p", ReservationKind.PREFIX_CACHE, GiB + 1, snapshot=IDLE)
    assert isinstance(over, Rejection) and over.reason is RejectionReason.INSUFFICIENT_MEMORY
    assert over.available_bytes == GiB and ledger.bytes_of("p") == 7 * GiB  # nothing changed
    busy = replace(IDLE, mlx_active_bytes=GiB)  # the live reading binds a grow as it binds a reserve
    assert not ledger.grow("p", ReservationKind.PREFIX_CACHE, 1, snapshot=busy).granted
    assert ledger.grow("p", ReservationKind.PREFIX_CACHE, GiB, snapshot=IDLE).granted
    assert ledger.available_bytes(IDLE) == 0 and ledger.peak_bytes == 9 * GiB
    # Only an outstanding reservation of the same kind grows.
    assert ledger.grow("nope", ReservationKind.PREFIX_CACHE, 0, snapshot=IDLE).reason is RejectionReason.NOT_OUTSTANDING
    assert ledger.grow("p", ReservationKind.MEDIA, 0, snapshot=IDLE).reason is RejectionReason.NOT_OUTSTANDING
    assert ledger.grow("p", ReservationKind.PREFIX_CACHE, -1, snapshot=IDLE).reason is RejectionReason.INVALID_SIZE
    snap = ledger.snapshot()
    assert snap.count_by_kind[ReservationKind.PREFIX_CACHE] == 1 and snap.bytes_by_kind[ReservationKind.PREFIX_CACHE] == 8 * GiB
    assert ledger.reduce("p", 3 * GiB) == 5 * GiB and ledger.snapshot().bytes_by_kind[ReservationKind.PREFIX_CACHE] == 5 * GiB
    assert ledger.release("p") == 5 * GiB and ledger.release("p") == 0
    assert ledger.snapshot().count_by_kind[ReservationKind.PREFIX_CACHE] == 0 and ledger.outstanding_bytes() == GiB


def test_grow_keeps_the_half_cap_rule_for_request_kv() -> None:
    big_fig = figures(128 * GiB, env={})
    idle = MemorySnapshot(physical_bytes=128 * GiB, available_bytes=127 * GiB)
    ledger = Ledger(big_fig)
    half = big_fig.hard_cap_bytes // 2
    assert ledger.reserve("kv", ReservationKind.REQUEST_KV, half - 10, snapshot=idle).granted
    over = ledger.grow("kv", ReservationKind.REQUEST_KV, 11, snapshot=idle)
    assert isinstance(over, Rejection) and over.reason is RejectionReason.OVER_SINGLE_REQUEST_LIMIT
    assert ledger.grow("kv", ReservationKind.REQUEST_KV, 10, snapshot=idle).granted
    assert ledger.bytes_of("kv") == half


def test_snapshot_does_not_walk_the_entries() -> None:
    """The totals are kept as reservations come and go: reading them costs the same at 20,000
    entries as at none (the entries are not even looked at)."""
    ledger = Ledger(FIG)
    for i in range(20_000):
        ledger.reserve(f"p{i}", ReservationKind.PREFIX_CACHE, 3, snapshot=IDLE)
    ledger.reserve("kv", ReservationKind.REQUEST_KV, 5, snapshot=IDLE, donor="p7", donated=2)
    ledger._entries = _Unwalkable(ledger._entries)
    snap = ledger.snapshot()
    assert snap.count_by_kind[ReservationKind.PREFIX_CACHE] == 20_000 and snap.count == 20_001
    assert snap.bytes_by_kind[ReservationKind.PREFIX_CACHE] == 60_000 - 2
    assert snap.bytes_by_kind[ReservationKind.REQUEST_KV] == 5 and snap.total_bytes == 60_003


class _Unwalkable(dict):
    """A ledger's entry table whose walk fails the test (lookups by id still work)."""

    def values(self):
        raise AssertionError("snapshot() walked the entries")

    def items(self):
        raise AssertionError("snapshot() walked the entries")

    def __iter__(self):
        raise AssertionError("snapshot() walked the entries")


def test_sample_callable_supplies_the_snapshot() -> None:
    calls = []

    def sample() -> MemorySnapshot:
        calls.append(1)
        return replace(IDLE, mlx_active_bytes=8 * GiB)  # 12 − 8 − 3 = 1 GiB

    ledger = Ledger(FIG, sample=sample)
    assert not ledger.reserve("a", ReservationKind.MEDIA, GiB + 1).granted
    assert ledger.reserve("a", ReservationKind.MEDIA, GiB).granted
    assert ledger.available_bytes() == 0
    assert len(calls) == 3
    with pytest.raises(TypeError):
        Ledger(FIG).reserve("a", ReservationKind.MEDIA, 1)


def test_nothing_expires_by_age(monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = Ledger(FIG)
    ledger.reserve("old", ReservationKind.REQUEST_KV, GiB, snapshot=IDLE)
    far_future = time.monotonic() + 10 * 365 * 86400
    monkeypatch.setattr(time, "monotonic", lambda: far_future)
    monkeypatch.setattr(time, "time", lambda: far_future)
    ledger.reserve("new", ReservationKind.MEDIA, 1, snapshot=IDLE)  # any activity: no sweep happens
    assert ledger.bytes_of("old") == GiB and ledger.outstanding_bytes() == GiB + 1


# -- property: any interleaving against a changing snapshot ---------------------------------------

KINDS = st.sampled_from(list(ReservationKind))
SIZES = st.integers(min_value=0, max_value=6 * GiB)


class LedgerMachine(RuleBasedStateMachine):
    """Reservations, claims, reductions and releases against a snapshot that keeps changing."""

    @initialize(physical_gib=st.sampled_from([8, 16, 64]))
    def setup(self, physical_gib: int) -> None:
        self.figures = figures(physical_gib * GiB, env={})
        self.ledger = Ledger(self.figures)
        self.snap = MemorySnapshot(physical_bytes=physical_gib * GiB, available_bytes=physical_gib * GiB)
        self.model: dict[str, int] = {}
        self.kinds: dict[str, ReservationKind] = {}
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _check_admission(self, result: Lease | Rejection, nbytes: int) -> None:
        if result.granted:
            self.model[result.id] = self.model.get(result.id, 0) + nbytes
            self.kinds[result.id] = result.kind
            after = sum(self.model.values())
            if nbytes == 0:
                return  # an empty reservation admits nothing (and is allowed even at zero headroom)
            # The admitted total fits under the effective cap with the activation reserve kept,
            # and within what the OS has available.
            assert self.snap.mlx_used_bytes + after + self.figures.activation_reserve_bytes \
                <= self.figures.effective_cap_bytes
            assert after + self.figures.activation_reserve_bytes <= self.snap.available_bytes
        else:
            assert result.id not in self.ledger or result.reason is RejectionReason.DUPLICATE_ID

    @rule(active=st.integers(0, 20 * GiB), cache=st.integers(0, 2 * GiB), avail=st.integers(0, 64 * GiB))
    def memory_changes(self, active: int, cache: int, avail: int) -> None:
        self.snap = replace(self.snap, mlx_active_bytes=active, mlx_cache_bytes=cache, available_bytes=avail)

    @rule(kind=KINDS, nbytes=SIZES)
    def reserve(self, kind: ReservationKind, nbytes: int) -> None:
        rid = self._new_id()
        self._check_admission(self.ledger.reserve(rid, kind, nbytes, snapshot=self.snap), nbytes)

    @rule(nbytes=SIZES)
    def claim_pending_load(self, nbytes: int) -> None:
        rid = self._new_id()
        self._check_admission(self.ledger.claim_pending_load(rid, nbytes, snapshot=self.snap), nbytes)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), nbytes=SIZES, same_kind=st.booleans())
    def grow(self, data: st.DataObject, nbytes: int, same_kind: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)))
        kind = self.kinds[rid] if same_kind else data.draw(KINDS.filter(lambda k: k is not self.kinds[rid]))
        result = self.ledger.grow(rid, kind, nbytes, snapshot=self.snap)
        if not same_kind:
            assert not result.granted and result.reason is RejectionReason.NOT_OUTSTANDING
            return
        if result.granted:
            assert result.nbytes == nbytes
            self._check_admission(result, nbytes)
        else:
            assert result.reason in (RejectionReason.INSUFFICIENT_MEMORY, RejectionReason.OVER_SINGLE_REQUEST_LIMIT)
        assert self.ledger.bytes_of(rid) == self.model[rid]

    @rule(kind=KINDS, nbytes=SIZES)
    def grow_unknown(self, kind: ReservationKind, nbytes: int) -> None:
        result = self.ledger.grow(self._new_id(), kind, nbytes, snapshot=self.snap)
        assert not result.granted and result.reason is RejectionReason.NOT_OUTSTANDING

    @precondition(lambda self: self.model)
    @rule(data=st.data(), kind=KINDS)
    def duplicate(self, data: st.DataObject, kind: ReservationKind) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)))
        result = self.ledger.reserve(rid, kind, 0, snapshot=self.snap)
        assert not result.granted and result.reason is RejectionReason.DUPLICATE_ID

    @precondition(lambda self: self.model)
    @rule(data=st.data(), cut=st.integers(0, 8 * GiB))
    def reduce(self, data: st.DataObject, cut: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)))
        self.model[rid] = max(0, self.model[rid] - cut)
        assert self.ledger.reduce(rid, cut) == self.model[rid]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), twice=st.booleans())
    def release(self, data: st.DataObject, twice: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)))
        assert self.ledger.release(rid) == self.model.pop(rid)
        del self.kinds[rid]
        if twice:
            assert self.ledger.release(rid) == 0

    @invariant()
    def books_balance(self) -> None:
        if not hasattr(self, "ledger"):
            return
        snap = self.ledger.snapshot()
        assert self.ledger.outstanding_bytes() == sum(self.model.values()) == snap.total_bytes >= 0
        assert snap.count == len(self.model)
        assert all(v >= 0 for v in snap.bytes_by_kind.values())
        assert self.ledger.available_bytes(self.snap) >= 0

    @invariant()
    def running_totals_equal_a_recount(self) -> None:
        """The per-kind totals `snapshot()` reads without a walk equal a walk over the ledger's own
        entries (white-box) and over this machine's model of them."""
        if not hasattr(self, "ledger"):
            return
        snap = self.ledger.snapshot()
        for source in ({rid: (e.kind, e.nbytes) for rid, e in self.ledger._entries.items()},
                       {rid: (self.kinds[rid], n) for rid, n in self.model.items()}):
            for kind in ReservationKind:
                held = [n for k, n in source.values() if k is kind]
                assert snap.count_by_kind[kind] == len(held), kind
                assert snap.bytes_by_kind[kind] == sum(held), kind
        assert snap.total_bytes == self.ledger.outstanding_bytes()
        assert self.ledger.peak_bytes >= snap.total_bytes

    def teardown(self) -> None:
        if not hasattr(self, "ledger"):
            return
        for rid in list(self.model):
            self.ledger.release(rid)
        assert self.ledger.outstanding_bytes() == 0
        assert self.ledger.snapshot().count == 0 and len(self.ledger) == 0


TestLedgerProperties = LedgerMachine.TestCase
TestLedgerProperties.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- concurrency: threads and asyncio tasks -------------------------------------------------------

def test_contended_reserve_never_over_admits() -> None:
    """64 threads race for room that holds exactly 10 reservations: exactly 10 win."""
    ledger = Ledger(FIG)
    size = FIG.available_bytes(IDLE) // 10
    barrier = threading.Barrier(64)
    wins: list[str] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        barrier.wait()
        if ledger.reserve(f"t{i}", ReservationKind.REQUEST_KV, size, snapshot=IDLE).granted:
            with lock:
                wins.append(f"t{i}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 10
    assert ledger.outstanding_bytes() == 10 * size


async def test_threads_and_tasks_lose_no_update() -> None:
    """An engine-like thread pool and asyncio tasks hammer the same ledger; the books balance."""
    roomy = MemorySnapshot(physical_bytes=1024 * GiB, available_bytes=1024 * GiB)
    ledger = Ledger(figures(1024 * GiB, env={}))
    rounds = 400
    held_threads: list[str] = []

    def thread_worker(w: int) -> None:
        for i in range(rounds):
            rid = f"th{w}-{i}"
            assert ledger.reserve(rid, ReservationKind.REQUEST_KV, 3 + i % 7, snapshot=roomy).granted
            ledger.reduce(rid, 1)
            if i % 5:
                assert ledger.release(rid) == 2 + i % 7
                assert ledger.release(rid) == 0
            else:
                held_threads.append(rid)

    async def task_worker(w: int) -> list[str]:
        kept = []
        for i in range(rounds):
            rid = f"tk{w}-{i}"
            assert ledger.reserve(rid, ReservationKind.MEDIA, 11, snapshot=roomy).granted
            await asyncio.sleep(0)  # interleave with the other tasks
            if i % 4:
                assert ledger.release(rid) == 11
            else:
                kept.append(rid)
        return kept

    threads = [asyncio.to_thread(thread_worker, w) for w in range(4)]
    results = await asyncio.gather(*threads, *(task_worker(w) for w in range(4)))
    held_tasks = [rid for kept in results if kept for rid in kept]
    expected_threads = 4 * sum(2 + i % 7 for i in range(rounds) if i % 5 == 0)
    expected_tasks = 11 * len(held_tasks)
    snap = ledger.snapshot()
    assert snap.bytes_by_kind[ReservationKind.REQUEST_KV] == expected_threads
    assert snap.bytes_by_kind[ReservationKind.MEDIA] == expected_tasks == 11 * 4 * (rounds // 4)
    assert ledger.outstanding_bytes() == expected_threads + expected_tasks
    assert snap.count == len(held_threads) + len(held_tasks)
    for rid in held_threads + held_tasks:
        ledger.release(rid)
    assert ledger.outstanding_bytes() == 0 and len(ledger) == 0


def test_a_donor_gives_bytes_to_a_reservation_in_the_same_step() -> None:
    """A loading model's claim turns part of its MIN_KV into a request's KV: atomically, and not at
    all when the reservation is refused."""
    figs = compute_figures(16 * GiB)
    snap = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=16 * GiB)
    ledger = Ledger(figs)
    room = figs.available_bytes(snap)
    assert isinstance(ledger.reserve("load:m", ReservationKind.PENDING_LOAD, room, snapshot=snap), Lease)
    assert isinstance(ledger.reserve("kv:r1", ReservationKind.REQUEST_KV, GiB, snapshot=snap), Rejection)
    lease = ledger.reserve("kv:r1", ReservationKind.REQUEST_KV, GiB, snapshot=snap, donor="load:m", donated=GiB)
    assert isinstance(lease, Lease)
    assert ledger.bytes_of("load:m") == room - GiB and ledger.outstanding_bytes() == room
    # refused (more than the gift and the room): nothing moves
    refused = ledger.reserve("kv:r2", ReservationKind.REQUEST_KV, 2 * GiB, snapshot=snap, donor="load:m", donated=GiB)
    assert isinstance(refused, Rejection) and ledger.bytes_of("load:m") == room - GiB
    # a gift never exceeds what the donor holds
    ledger.reduce("load:m", room - GiB - MiB)
    lease = ledger.reserve("kv:r3", ReservationKind.REQUEST_KV, MiB, snapshot=snap, donor="load:m", donated=GiB)
    assert isinstance(lease, Lease) and ledger.bytes_of("load:m") == 0
