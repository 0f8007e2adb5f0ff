"""RAM tier: one model's prompt caches keyed by token prefix, every byte charged to the ledger.

An entry is a list of mlx-lm `KVCache` layers cut to exactly the tokens it is keyed by. `fetch`
returns a fresh copy cut to the longest common prefix with the new prompt, always leaving at
least one prompt token to feed (mlx-lm's `BatchGenerator` feeds the last prompt token in the first
decode step and refuses an empty prompt). `store` takes a cache that may hold more (a finished
request's cache also holds its completion) and keeps only the keyed prefix.

The whole tier is one `prefix_cache` reservation in the ledger, not one per entry (a tier of 16 GiB
holds tens of thousands of sequences): taken with the first entry, grown by each store (`Ledger.grow`,
the same capacity check as a new reservation), lowered by each eviction and released when the last
entry goes: each reservation the tier takes is released exactly once, and a purged tier holds none.
`_charge` is the only place that adds bytes and `_evict` the only place that drops an entry and
gives bytes back, so bytes held and bytes charged cannot drift apart.

Threads: `fetch` and `store` run MLX and must be called on the engine thread. Eviction, purge and
the stats only drop references and touch the ledger, so any thread may call them; a lock guards
the index. MLX work happens outside the lock.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from kvcache import state
from kvcache.trie import Key, PrefixIndex
from memory.ledger import Ledger, ReservationKind
from memory.snapshot import MemorySnapshot

# Shared by every PrefixCache in the process so "least recently used" compares across models.
_clock = itertools.count(1)
# Each PrefixCache's reservation id is its own, also for a model purged and loaded again (a late
# eviction of the purged tier must never touch the new tier's reservation).
_tiers = itertools.count()


class StoreOutcome(Enum):
    STORED = "stored"
    COVERED = "covered"  # an entry already holds this prefix (or a longer one)
    REFUSED = "refused"  # the ledger (or max_bytes) had no room
    UNSUPPORTED = "unsupported"  # not plain KVCache layers (rotating, quantized, SSM…)
    CLOSED = "closed"  # purged: the model is going away


@dataclass(slots=True)
class _Entry:
    cache: list  # list[KVCache], exactly len(key) positions
    nbytes: int
    used: int  # _clock stamp of the last fetch/store


@dataclass(frozen=True, slots=True)
class RamHit:
    cache: list  # a private copy, `matched` positions
    matched: int
    key: Key  # the stored sequence it was cut from


class PrefixCache:
    """The RAM prefix cache of one loaded model."""

    def __init__(self, model_id: str, ledger: Ledger, *,
                 sample_snapshot: Callable[[], MemorySnapshot] | None = None,
                 max_bytes: int | None = None) -> None:
        self.model_id = model_id
        self._ledger = ledger
        self._sample = sample_snapshot
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._index: PrefixIndex[_Entry] = PrefixIndex()
        self._bytes = 0  # = the ledger's bytes under `lease_id` while `_leased`
        self._closed = False
        self.lease_id = f"prefix:{model_id}:{next(_tiers)}"
        self._leased = False  # the tier's reservation is outstanding (iff the tier holds an entry)

    # -- engine thread -----------------------------------------------------------------------

    def fetch(self, tokens: Sequence[int]) -> RamHit | None:
        """A private copy of the longest cached prefix of `tokens` (≤ len(tokens) − 1), or None."""
        with self._lock:
            match = self._index.lookup(tokens)
            if match is None:
                return None
            matched = min(match.common, len(tokens) - 1)
            if matched < 1:
                return None
            self._index.touch(match.key)
            match.value.used = next(_clock)
            source = match.value.cache
        return RamHit(state.prefix_copy(source, matched), matched, match.key)

    def longest_match(self, tokens: Sequence[int]) -> int:
        """How many leading tokens `fetch` would reuse (no copy, no LRU update)."""
        with self._lock:
            match = self._index.lookup(tokens)
        return 0 if match is None else max(0, min(match.common, len(tokens) - 1))

    def store(self, tokens: Sequence[int], cache: Sequence[object]) -> StoreOutcome:
        """Keep the first `len(tokens)` positions of `cache` under `tokens`."""
        key: Key = tuple(tokens)
        if not key or not state.reusable(cache) or state.cache_tokens(cache) < len(key):
            return StoreOutcome.UNSUPPORTED
        with self._lock:
            if self._closed:
                return StoreOutcome.CLOSED
            if self._index.covers(key):
                return StoreOutcome.COVERED
        entry_cache = state.prefix_copy(cache, len(key))
        nbytes = state.cache_nbytes(entry_cache)
        if self._max_bytes is not None and nbytes > self._max_bytes:
            return StoreOutcome.REFUSED
        snapshot = self._sample() if self._sample is not None else None
        with self._lock:
            if self._closed:
                return StoreOutcome.CLOSED
            if self._index.covers(key):
                return StoreOutcome.COVERED
            if self._max_bytes is not None:
                while self._bytes + nbytes > self._max_bytes and len(self._index):
                    self._evict(self._index.oldest())
            if not self._charge(nbytes, snapshot):
                return StoreOutcome.REFUSED
            self._index.insert(key, _Entry(entry_cache, nbytes, next(_clock)))
            # Shorter entries on the same path are now redundant: the new one trims to them.
            for shorter in self._index.prefixes_of(key):
                self._evict(shorter)
        return StoreOutcome.STORED

    def entry(self, key: Sequence[int]) -> list | None:
        """The cache stored under exactly `key` (shared, read-only: the arrays are immutable), or None."""
        with self._lock:
            found = self._index.get(tuple(key))
            return None if found is None else found.cache

    # -- any thread --------------------------------------------------------------------------

    def oldest_use(self) -> int | None:
        """The LRU stamp of the least recently used entry (comparable across models)."""
        with self._lock:
            key = self._index.oldest()
            return None if key is None else self._index.get(key).used

    def evict_oldest(self) -> int:
        """Evict the least recently used entry; bytes returned to the ledger (0 when empty)."""
        with self._lock:
            key = self._index.oldest()
            return 0 if key is None else self._evict(key)

    def evict_for(self, nbytes: int) -> int:
        """Evict LRU entries until at least `nbytes` went back to the ledger or none are left."""
        freed = 0
        with self._lock:
            while freed < nbytes and len(self._index):
                freed += self._evict(self._index.oldest())
        return freed

    def evict_all(self) -> int:
        with self._lock:
            return sum(self._evict(key) for key in list(self._index.keys_lru()))

    def purge(self) -> int:
        """Drop every entry and refuse later stores: the model is being unloaded."""
        with self._lock:
            self._closed = True
            return sum(self._evict(key) for key in list(self._index.keys_lru()))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)

    def _charge(self, nbytes: int, snapshot: MemorySnapshot | None) -> bool:
        """The one way in: `nbytes` more on the tier's reservation (taken now if the tier is empty),
        checked against what the ledger has available. Caller holds the lock."""
        if self._leased:
            granted = self._ledger.grow(self.lease_id, ReservationKind.PREFIX_CACHE, nbytes, snapshot=snapshot).granted
        else:
            granted = self._ledger.reserve(self.lease_id, ReservationKind.PREFIX_CACHE, nbytes,
                                           snapshot=snapshot).granted
            self._leased = granted
        if granted:
            self._bytes += nbytes
        return granted

    def _evict(self, key: Key) -> int:
        """The one way out: drop the entry and give its bytes back to the ledger (the reservation
        itself once the tier is empty). Caller holds the lock."""
        entry = self._index.remove(key)
        if entry is None:
            return 0
        self._bytes -= entry.nbytes
        if len(self._index):
            self._ledger.reduce(self.lease_id, entry.nbytes)
        else:
            self._ledger.release(self.lease_id)
            self._leased = False
        entry.cache = []
        return entry.nbytes
