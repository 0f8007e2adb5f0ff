"""The one process-wide reservation ledger.

A reservation holds back bytes that are promised but not yet visible in MLX's counters: a request's
KV, decoded media, a model load in flight, the RAM prefix cache. The ledger admits a reservation
iff it fits in `available = live_headroom(snapshot) − Σ outstanding`, and it does the check and the
insert under one `threading.Lock` with no await in between, so the asyncio loop and the engine
thread can both call it and two callers can never both take the last bytes.

Where the live headroom comes from: each call that admits takes the current `MemorySnapshot`
(`snapshot=`), or, when none is passed, calls the `sample` callable given at construction (in
production `Probe.recent`, a reading at most a few milliseconds old: memory/probe.py says why that
keeps the cap). The snapshot is read, and the arithmetic done, inside the lock together with the
outstanding total, which is always live. Tests pass snapshots by hand. The snapshot's unattributed term
(the process's bytes outside MLX) is taken with the ledger's own host-side total at that moment
(`ReservationKind.host_side`): a booking for host memory is counted once, here, not again in RSS.

Every reservation is released exactly once by its owner, from its own cleanup path; `release` is
idempotent and nothing ever expires by age (there is no clock in here).

Cost: every method is O(1) in the number of outstanding reservations. The ledger keeps running
totals (count and bytes per kind, and their sum) that `reserve`, `grow`, `reduce` and `release`
update under the same lock as the entries, so `snapshot()` copies a few counters instead of walking
the entries: admission reads it several times per request, and a provider that has served for days
must admit as fast as a fresh one.

"One process-wide": the provider builds exactly one `Ledger` at startup and hands that instance to
everything that reserves (jobs, the model manager, the RAM prefix cache). This module keeps no
global so tests can build as many as they like.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Literal

from memory.policy import CapFigures
from memory.snapshot import MemorySnapshot


class ReservationKind(StrEnum):
    REQUEST_KV = "request_kv"  # a request's prompt + output KV, from admission to completion
    MEDIA = "media"  # decoded images/video held while a request is prepared
    PENDING_LOAD = "pending_load"  # a model load's allocation permit: weights_est + MIN_KV
    PREFIX_CACHE = "prefix_cache"  # RAM prefix-cache entries (kvcache/ram)
    PREFIX_INDEX = "prefix_index"  # the SSD prefix tier's index in memory (kvcache/blockindex), while it holds a file
    PROMPT = "prompt"  # a large request body's working memory while it is parsed and tokenized
    GRAMMAR = "grammar"  # a constrained request's grammar and mask rows (memory/grammar.py), intake to engine exit

    @property
    def host_side(self) -> bool:
        """Booked for memory outside MLX (host RAM: Python objects, decoded rasters, a body's copies): once it
        is allocated it is in the process's RSS, not in MLX's counters, so the snapshot's unattributed term
        gives it way (memory/snapshot.py) instead of counting it twice. The other kinds are MLX's."""
        return self in _HOST_SIDE


# The kinds whose bytes live outside MLX: a body while it is parsed, a grammar's matcher and mask rows,
# decoded images until the processor hands MLX its arrays, the SSD tier's index in memory.
_HOST_SIDE = frozenset({ReservationKind.PROMPT, ReservationKind.GRAMMAR, ReservationKind.MEDIA,
                        ReservationKind.PREFIX_INDEX})


class RejectionReason(StrEnum):
    INSUFFICIENT_MEMORY = "insufficient_memory"  # bytes > available
    OVER_SINGLE_REQUEST_LIMIT = "over_single_request_limit"  # request_kv above half the hard cap
    DUPLICATE_ID = "duplicate_id"  # an outstanding reservation already has this id
    INVALID_SIZE = "invalid_size"  # negative byte count
    NOT_OUTSTANDING = "not_outstanding"  # `grow`: no outstanding reservation of this kind under this id


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted reservation. `nbytes` is the amount granted; `Ledger.bytes_of(id)` is the current one."""

    id: str
    kind: ReservationKind
    nbytes: int

    @property
    def granted(self) -> Literal[True]:
        return True


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refused reservation, with the figures that refused it (nothing was inserted)."""

    id: str
    kind: ReservationKind
    nbytes: int
    reason: RejectionReason
    available_bytes: int

    @property
    def granted(self) -> Literal[False]:
        return False


@dataclass(frozen=True, slots=True)
class LedgerSnapshot:
    """Telemetry view: outstanding count and bytes per kind (every kind present, zeros included)."""

    count_by_kind: Mapping[ReservationKind, int]
    bytes_by_kind: Mapping[ReservationKind, int]

    @property
    def count(self) -> int:
        return sum(self.count_by_kind.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_kind.values())


@dataclass(slots=True)
class _Entry:
    kind: ReservationKind
    nbytes: int


class Ledger:
    """Reservations against the live headroom of `figures`. Thread-safe; every method is synchronous."""

    def __init__(self, figures: CapFigures, *, sample: Callable[[], MemorySnapshot] | None = None) -> None:
        self._figures = figures
        self._sample = sample
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        # Running totals, kept equal to a walk over `_entries` by every method that changes them.
        self._count_by_kind = dict.fromkeys(ReservationKind, 0)
        self._bytes_by_kind = dict.fromkeys(ReservationKind, 0)
        self._total = 0
        self._host = 0  # the host-side kinds' part of `_total`
        self._peak = 0  # high-water mark of Σ outstanding since construction

    @property
    def figures(self) -> CapFigures:
        return self._figures

    def replace_figures(self, figures: CapFigures) -> None:
        """Swap in recomputed figures (e.g. after `Probe.refresh()` saw a new cgroup limit).
        Outstanding reservations are kept; only later admissions see the new cap."""
        with self._lock:
            self._figures = figures

    # -- admitting ---------------------------------------------------------------------------

    def reserve(self, rid: str, kind: ReservationKind, nbytes: int, *,
                snapshot: MemorySnapshot | None = None, donor: str | None = None,
                donated: int = 0) -> Lease | Rejection:
        """Atomically check `nbytes ≤ available` and insert. Never blocks beyond the lock.

        `donor`/`donated`: an outstanding reservation gives up to `donated` of its bytes to this
        one in the same step (a loading model's claim turning its MIN_KV part into a request's KV);
        nothing changes if the reservation is refused."""
        kind = ReservationKind(kind)
        if nbytes < 0 or donated < 0:
            return Rejection(rid, kind, nbytes, RejectionReason.INVALID_SIZE, 0)
        with self._lock:
            snap = self._snapshot_for(snapshot)
            giver = self._entries.get(donor) if donor is not None else None
            gift = min(donated, giver.nbytes) if giver is not None else 0
            available = self._figures.available_bytes(snap, self._total - gift)
            if rid in self._entries:
                return Rejection(rid, kind, nbytes, RejectionReason.DUPLICATE_ID, available)
            if kind is ReservationKind.REQUEST_KV and nbytes > self._figures.single_request_limit_bytes:
                return Rejection(rid, kind, nbytes, RejectionReason.OVER_SINGLE_REQUEST_LIMIT, available)
            if nbytes > available:
                return Rejection(rid, kind, nbytes, RejectionReason.INSUFFICIENT_MEMORY, available)
            if giver is not None:
                self._resize(giver, -gift)
            entry = self._entries[rid] = _Entry(kind, 0)
            self._count_by_kind[kind] += 1
            self._resize(entry, nbytes)
            return Lease(rid, kind, nbytes)

    def grow(self, rid: str, kind: ReservationKind, nbytes: int, *,
             snapshot: MemorySnapshot | None = None) -> Lease | Rejection:
        """Atomically check `nbytes ≤ available` and add them to the outstanding reservation `rid`
        of `kind` (the same check as `reserve`, the half-cap rule on the grown total for request
        KV). The lease names the bytes granted now; `bytes_of(rid)` is the new total. Refused with
        `NOT_OUTSTANDING` when `rid` is not an outstanding reservation of `kind`."""
        kind = ReservationKind(kind)
        if nbytes < 0:
            return Rejection(rid, kind, nbytes, RejectionReason.INVALID_SIZE, 0)
        with self._lock:
            snap = self._snapshot_for(snapshot)
            available = self._figures.available_bytes(snap, self._total)
            entry = self._entries.get(rid)
            if entry is None or entry.kind is not kind:
                return Rejection(rid, kind, nbytes, RejectionReason.NOT_OUTSTANDING, available)
            if kind is ReservationKind.REQUEST_KV and entry.nbytes + nbytes > self._figures.single_request_limit_bytes:
                return Rejection(rid, kind, nbytes, RejectionReason.OVER_SINGLE_REQUEST_LIMIT, available)
            if nbytes > available:
                return Rejection(rid, kind, nbytes, RejectionReason.INSUFFICIENT_MEMORY, available)
            self._resize(entry, nbytes)
            return Lease(rid, kind, nbytes)

    def claim_pending_load(self, rid: str, nbytes: int, *,
                           snapshot: MemorySnapshot | None = None) -> Lease | Rejection:
        """A load's allocation permit (`nbytes` = weights_est + MIN_KV), taken with its own capacity
        check. `reduce` it as weights become resident; `release` it on install and on every failure."""
        return self.reserve(rid, ReservationKind.PENDING_LOAD, nbytes, snapshot=snapshot)

    # -- shrinking and releasing -------------------------------------------------------------

    def reduce(self, rid: str, nbytes: int) -> int:
        """Lower a reservation by `nbytes` (floored at 0; it stays outstanding until released).
        Returns the bytes still reserved under `rid` (0 for an unknown or released id)."""
        if nbytes < 0:
            raise ValueError("reduce() takes a non-negative byte count")
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                return 0
            self._resize(entry, -min(nbytes, entry.nbytes))
            return entry.nbytes

    def release(self, rid: str) -> int:
        """Drop a reservation. Idempotent: returns the bytes freed, 0 if `rid` is not outstanding."""
        with self._lock:
            entry = self._entries.pop(rid, None)
            if entry is None:
                return 0
            freed = entry.nbytes
            self._resize(entry, -freed)
            self._count_by_kind[entry.kind] -= 1
            return freed

    def _resize(self, entry: _Entry, delta: int) -> None:
        """The one place an entry's bytes change, with every running total. Caller holds the lock."""
        entry.nbytes += delta
        self._bytes_by_kind[entry.kind] += delta
        self._total += delta
        if entry.kind.host_side:
            self._host += delta
        if delta > 0:
            self._peak = max(self._peak, self._total)

    # -- reading -----------------------------------------------------------------------------

    def outstanding_bytes(self, *, excluding: str | None = None) -> int:
        """Σ outstanding reservations, optionally leaving one id out."""
        with self._lock:
            entry = self._entries.get(excluding) if excluding is not None else None
            return self._total - (entry.nbytes if entry else 0)

    def available_bytes(self, snapshot: MemorySnapshot | None = None) -> int:
        """What `reserve` would admit right now (read-only; for fast admission)."""
        with self._lock:
            return self._figures.available_bytes(self._snapshot_for(snapshot), self._total)

    def load_is_serveable(self, snapshot: MemorySnapshot | None = None, *,
                          pending_load_id: str | None = None, kv_floor_bytes: int | None = None) -> bool:
        """Post-load guard: live headroom ≥ the KV floor + outstanding reservations other than the
        load's own claim (whose weights are now part of the snapshot's MLX usage). The floor is
        MIN_KV, less what the model's own requests already reserved (`kv_floor_bytes`)."""
        with self._lock:
            snap = self._snapshot_for(snapshot)
            entry = self._entries.get(pending_load_id) if pending_load_id is not None else None
            others = self._total - (entry.nbytes if entry else 0)
            return self._figures.load_is_serveable(snap, others, kv_floor_bytes=kv_floor_bytes)

    def host_booked_bytes(self) -> int:
        """Σ outstanding host-side reservations. Read without the lock (one int, kept by `_resize`), so a
        probe may ask it while it samples for a call that holds the lock."""
        return self._host

    @property
    def peak_bytes(self) -> int:
        """The most ever outstanding at once (since construction)."""
        with self._lock:
            return self._peak

    def bytes_of(self, rid: str) -> int | None:
        """Current bytes reserved under `rid`, None when it is not outstanding."""
        with self._lock:
            entry = self._entries.get(rid)
            return None if entry is None else entry.nbytes

    def __contains__(self, rid: object) -> bool:
        with self._lock:
            return rid in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def snapshot(self) -> LedgerSnapshot:
        """Count and bytes outstanding per kind, read atomically (the running totals: no walk)."""
        with self._lock:
            counts, sizes = dict(self._count_by_kind), dict(self._bytes_by_kind)
        return LedgerSnapshot(MappingProxyType(counts), MappingProxyType(sizes))

    def _snapshot_for(self, snapshot: MemorySnapshot | None) -> MemorySnapshot:
        """The reading to decide on, its unattributed term net of the host-side bookings now. Caller holds the lock."""
        if snapshot is None:
            if self._sample is None:
                raise TypeError("Ledger has no sample(); pass snapshot=")
            snapshot = self._sample()
        return snapshot.booked(self._host)
