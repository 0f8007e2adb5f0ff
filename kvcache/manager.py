"""The prefix cache of every loaded model: RAM tier in front, SSD tier behind, one purge.

Lifecycle: the model manager calls `attach(model, weight_hash)` after a
load and `purge(model)` on every unload (eviction, idle timeout, shutdown) before the unload
returns; `disk.startup_sweep(root)` runs once before the first attach. The engine worker calls
`ModelKvCache.fetch` before inserting a request into its `BatchGenerator` and `store` when the
request finishes, both on the engine thread. What is stored is the request's whole sequence
(prompt + completion), so a follow-up turn whose templated prompt repeats the conversation reuses
all of it; matching is on tokens, so a template that re-renders an earlier answer differently
reuses up to the first token that differs and no further.

Memory: each model's RAM tier is one `prefix_cache` reservation in the ledger, grown as sequences
are stored and lowered as they are evicted (kvcache/ram.py). When admission or a load needs
room it calls `evict_for(nbytes)` (least recently used first, across models); under RED pressure
or worse `relieve(level)` drops the whole RAM tier. The SSD tier's files are not in memory, but
its index is (a few hundred bytes per file, kvcache/blockindex.py): each model's is one
`prefix_index` reservation (`IndexLease`), taken with its first file and released at the purge;
a file the ledger has no room for is not written.

What goes to the SSD tier: only sequences whose request reused at least `SSD_MIN_REUSED_TOKENS` of
a stored one (a conversation's next turn, a question after a shared system prompt): reuse is the
evidence that a line is worth keeping, and a sequence nothing ever builds on (most requests from the
network, a benchmark's fresh prompts, which share no more than a chat template's first tokens) is
never copied off the device at all. Such a sequence is written once
it has stayed quiet for `write_delay_s` (no longer turn stored over it, no running request
extending it): each turn of a live conversation would otherwise encrypt and write the whole
conversation again, on the CPU the next turn's prefill needs (0: at once).

SSD writes copy the RAM entry, never the request's cache, and nothing of them waits on the engine
thread: the entry's copy was only scheduled at `store`; the engine thread hands it over at a later
`write_quiet` (one step later at the soonest, when the copy has run: its `settle` then costs
nothing), and the device→host copy (`state.host_copy`), the encryption and the file write run on
`write_executor` when one is given (inline otherwise). An entry evicted from RAM before it went quiet
is not written, nor is one whose RAM store was refused, nor anything of a purged model; one evicted
after it was due is still written (the pending hand-over keeps it).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from enum import Enum

from kvcache import state
from kvcache.ram import PrefixCache, StoreOutcome
from kvcache.ssd import SsdStore, WriteOutcome
from kvcache.trie import Key
from memory.ledger import Ledger, ReservationKind
from memory.pressure import PressureLevel
from memory.snapshot import MemorySnapshot

log = logging.getLogger("kvcache")

# A request reuses a cached prefix of at least this many tokens, or its whole prompt but the last token
# (`fetch(min_tokens=...)`): a chat template's own first tokens (Llama 3's dated system header is ~30)
# match nearly every prompt, and reusing them saves a few tokens of a batched prefill for a copy of
# their KV and a cache-carrying join.
REUSE_MIN_TOKENS = 48
SSD_MIN_REUSED_TOKENS = 48  # more than a chat template's own first tokens (Llama 3: ~30, with its dated system header)


class Tier(Enum):
    RAM = "ram"
    SSD = "ssd"


@dataclass(frozen=True, slots=True)
class Reuse:
    """What `fetch` found: `cache` holds the first `matched` prompt tokens (None on a miss), cut from
    the stored sequence `key`."""

    cache: list | None
    matched: int
    tier: Tier | None
    key: Key | None = None

    def rest(self, tokens: Sequence[int]) -> list[int]:
        """The prompt tokens still to prefill."""
        return list(tokens[self.matched:])


MISS = Reuse(None, 0, None)


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    hits: int = 0  # the whole prompt but its last token came from the cache
    partial_hits: int = 0  # some leading tokens came from the cache
    misses: int = 0
    ram_bytes: int = 0
    disk_bytes: int = 0
    entries: int = 0  # RAM entries
    ssd_hits: int = 0  # hits and partial hits served from the SSD tier (included above)
    reused_tokens: int = 0  # prompt tokens whose KV came from the cache instead of a prefill

    def __add__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(*(a + b for a, b in zip(_fields(self), _fields(other), strict=True)))


def _fields(s: PrefixCacheStats) -> tuple[int, ...]:
    return (s.hits, s.partial_hits, s.misses, s.ram_bytes, s.disk_bytes, s.entries, s.ssd_hits, s.reused_tokens)


class ModelKvCache:
    """One loaded model's prefix cache. `fetch`/`store` on the engine thread only."""

    def __init__(self, model_id: str, weight_hash: str, ram: PrefixCache, ssd: SsdStore | None,
                 write_executor: Executor | None, *, write_delay_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model_id = model_id
        self.weight_hash = weight_hash
        self.ram = ram
        self._ssd = ssd
        self._executor = write_executor
        self._delay = write_delay_s
        self._clock = clock
        self._pending: dict[Key, float] = {}  # sequence -> when it is due on SSD (engine thread only)
        # Due on SSD: the entry (kept even if RAM evicts it first), and whether a write_quiet saw it since.
        self._copying: dict[Key, tuple[list, bool]] = {}
        self._closed = False
        self._lock = threading.Lock()
        self._hits = self._partial = self._misses = self._ssd_hits = self._reused = 0

    def fetch(self, tokens: Sequence[int], *, count: bool = True, min_tokens: int = 1) -> Reuse:
        """The longest reusable prefix of `tokens` from RAM, else from SSD (promoted to RAM); MISS when
        it is shorter than `min_tokens` and not the whole prompt (nothing is copied). `count=False`:
        the engine's own preparation, not a request: the stats stay as they were."""
        matched = self.longest_match(tokens)
        reuse = self._lookup(tokens) if matched >= min(min_tokens, len(tokens) - 1) else MISS
        if not count:
            return reuse
        with self._lock:
            if reuse.cache is None:
                self._misses += 1
            elif reuse.matched == len(tokens) - 1:
                self._hits += 1
            else:
                self._partial += 1
            if reuse.tier is Tier.SSD:
                self._ssd_hits += 1
            self._reused += reuse.matched
        return reuse

    def longest_match(self, tokens: Sequence[int]) -> int:
        """How many leading tokens `fetch` would reuse, from either tier (no copy, no read, no stats).
        The SSD tier's figure is its index's lower bound (less than a block short where a stored
        sequence and `tokens` part inside one): `fetch` may reuse a few tokens more, never fewer."""
        if len(tokens) < 2:
            return 0
        best = self.ram.longest_match(tokens)
        if self._ssd is not None:
            best = max(best, min(self._ssd.longest_match(self.model_id, tokens), len(tokens) - 1))
        return best

    def _lookup(self, tokens: Sequence[int]) -> Reuse:
        if len(tokens) < 2:
            return MISS
        ram_len = self.ram.longest_match(tokens)
        if self._ssd is not None and self._ssd.longest_match(self.model_id, tokens) > ram_len:
            hit = self._ssd.fetch(self.model_id, self.weight_hash, tokens)
            ssd_len = 0 if hit is None else min(hit.common, len(tokens) - 1)  # compared token by token
            if ssd_len > ram_len:
                cache = state.from_host(hit.cache)
                self.ram.store(hit.key, cache)  # promote; refused is fine
                return Reuse(state.prefix_copy(cache, ssd_len), ssd_len, Tier.SSD, hit.key)
        if ram_len:
            hit = self.ram.fetch(tokens)
            if hit is not None:
                return Reuse(hit.cache, hit.matched, Tier.RAM, hit.key)
        return MISS

    def store(self, tokens: Sequence[int], cache: Sequence[object], *, extends: Key | None = None,
              reused: int = 0) -> StoreOutcome:
        """Keep `cache` under the leading `tokens` it holds: RAM, and SSD (see the module docstring).

        `tokens` may run past the cache (a finished request's prompt + completion, when a cache
        ends before its last token): only the positions the cache really holds are kept.
        `extends`: the stored sequence the request reused (`Reuse.key`), if any, and `reused` how
        many of its tokens it reused (`Reuse.matched`)."""
        if not state.reusable(cache):
            return StoreOutcome.UNSUPPORTED
        key = tuple(tokens[: state.cache_tokens(cache)])
        outcome = self.ram.store(key, cache)
        if self._ssd is None or outcome in (StoreOutcome.UNSUPPORTED, StoreOutcome.CLOSED, StoreOutcome.COVERED):
            return outcome
        if extends is None or reused < SSD_MIN_REUSED_TOKENS:
            return outcome  # a new line: kept in RAM, copied off the device only once something builds on it
        self._pending.pop(extends, None)  # a later turn replaces it
        self._copying.pop(extends, None)
        if self._delay > 0 and outcome is StoreOutcome.STORED:
            self._pending[key] = self._clock() + self._delay
            return outcome
        entry = self.ram.entry(key) if outcome is StoreOutcome.STORED else None  # refused: nothing to copy
        if entry is not None:
            self._copying[key] = (entry, False)  # handed over once a `write_quiet` has seen it (the copy has run)
        return outcome

    def write_quiet(self, in_use: Collection[Key] = ()) -> float | None:
        """Hand the sequences due on SSD over to the writer, once their entry's copy has run (seen
        here once before), and make due the pending ones that stayed quiet for the delay; `in_use`:
        the sequences running requests reused (they are about to be extended, so they wait). Engine
        thread, between steps. Returns the seconds until the next call has work (0: a copy waits for
        its hand-over), None when nothing is pending."""
        now = self._clock()
        next_due = None
        for key, due in list(self._pending.items()):
            if key in in_use:
                due = self._pending[key] = now + self._delay
            if due > now:
                next_due = due if next_due is None else min(next_due, due)
                continue
            del self._pending[key]
            cache = self.ram.entry(key)
            if cache is not None:
                self._copying[key] = (cache, True)  # its copy was scheduled a delay ago: handed over now
        self._hand_over()
        if self._copying:
            next_due = now  # a copy scheduled since the last call: handed over at the next
        return None if next_due is None else max(0.0, next_due - now)

    def _hand_over(self) -> None:
        for key, (cache, seen) in list(self._copying.items()):
            if not seen:
                self._copying[key] = (cache, True)
                continue
            del self._copying[key]
            if self._closed:
                continue  # purged meanwhile: nothing of it is written
            if self._ssd.covers(self.model_id, key):
                continue
            state.settle(cache)  # done a step ago: no wait
            if self._executor is None:
                self._write(key, cache)
            else:
                self._executor.submit(self._write, key, cache)

    def _write(self, key: Key, cache: Sequence[object]) -> WriteOutcome | None:
        """The writer thread: host bytes of the settled entry, sealed and written."""
        try:
            return self._ssd.write(self.model_id, self.weight_hash, key, state.host_copy(cache))
        except OSError:  # a full or failing disk only costs the SSD tier
            log.warning("kv cache write failed", exc_info=True)
            return None

    def close(self) -> None:
        """Purged (any thread): nothing pending is handed over any more; the engine thread no longer
        finds this cache, and what it held goes with it."""
        self._closed = True

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            hits, partial, misses, ssd_hits, reused = (self._hits, self._partial, self._misses, self._ssd_hits,
                                                       self._reused)
        disk = self._ssd.disk_bytes(self.model_id) if self._ssd is not None else 0
        return PrefixCacheStats(hits, partial, misses, self.ram.nbytes, disk, len(self.ram), ssd_hits, reused)


_leases = itertools.count()


class IndexLease:
    """The ledger's side of one model's SSD index (`kvcache.ssd.IndexMeter`): one `prefix_index`
    reservation, taken with the index's first bytes and released with its last. Called under the
    SSD store's lock (the ledger's own lock is taken inside it, never the other way round)."""

    def __init__(self, ledger: Ledger, model_id: str,
                 sample_snapshot: Callable[[], MemorySnapshot] | None = None) -> None:
        self._ledger = ledger
        self._sample = sample_snapshot
        self.lease_id = f"ssd_index:{model_id}:{next(_leases)}"
        self.nbytes = 0  # = the ledger's bytes under `lease_id` while it is outstanding

    def charge(self, nbytes: int) -> bool:
        snapshot = self._sample() if self._sample is not None else None
        kind = ReservationKind.PREFIX_INDEX
        if self.nbytes:
            granted = self._ledger.grow(self.lease_id, kind, nbytes, snapshot=snapshot).granted
        else:
            granted = self._ledger.reserve(self.lease_id, kind, nbytes, snapshot=snapshot).granted
        if granted:
            self.nbytes += nbytes
        return granted

    def discharge(self, nbytes: int) -> None:
        self.nbytes = max(0, self.nbytes - nbytes)
        if self.nbytes:
            self._ledger.reduce(self.lease_id, nbytes)
        else:
            self._ledger.release(self.lease_id)


@dataclass(frozen=True, slots=True)
class PurgeResult:
    ram_bytes: int
    disk_bytes: int


class KvCacheManager:
    """Every loaded model's `ModelKvCache`. Thread-safe; one per process."""

    def __init__(self, ledger: Ledger, *, ssd: SsdStore | None = None,
                 sample_snapshot: Callable[[], MemorySnapshot] | None = None,
                 ram_max_bytes: int | None = None, write_executor: Executor | None = None,
                 write_delay_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        """`write_delay_s`: how long a conversation's latest turn stays quiet before it goes to the
        SSD tier (0: at once, like a new sequence)."""
        self._ledger = ledger
        self._ssd = ssd
        self._delay = write_delay_s
        self._clock = clock
        self._sample = sample_snapshot
        self._ram_max = ram_max_bytes
        self._executor = write_executor
        self._lock = threading.Lock()
        self._models: dict[str, ModelKvCache] = {}
        self._retired = PrefixCacheStats()  # counters of purged models, so totals never go back

    def attach(self, model_id: str, weight_hash: str) -> ModelKvCache:
        """A fresh, empty cache for a model that was just loaded."""
        with self._lock:
            if model_id in self._models:
                raise RuntimeError("model already attached; purge it first")
            ram = PrefixCache(model_id, self._ledger, sample_snapshot=self._sample, max_bytes=self._ram_max)
            if self._ssd is not None:
                self._ssd.open(model_id, weight_hash, meter=IndexLease(self._ledger, model_id, self._sample))
            mc = ModelKvCache(model_id, weight_hash, ram, self._ssd, self._executor,
                              write_delay_s=self._delay, clock=self._clock)
            self._models[model_id] = mc
            return mc

    def get(self, model_id: str) -> ModelKvCache | None:
        with self._lock:
            return self._models.get(model_id)

    def purge(self, model_id: str) -> PurgeResult:
        """Remove the model's RAM and SSD state (the `kv_purge` hook of every unload). Idempotent."""
        with self._lock:
            mc = self._models.pop(model_id, None)
        if mc is not None:
            mc.close()
        ram = mc.ram.purge() if mc is not None else 0
        if mc is not None:
            s = mc.stats()
            with self._lock:
                self._retired += PrefixCacheStats(s.hits, s.partial_hits, s.misses, ssd_hits=s.ssd_hits,
                                                  reused_tokens=s.reused_tokens)
        disk = self._ssd.purge(model_id) if self._ssd is not None else 0
        return PurgeResult(ram, disk)

    def evict_for(self, nbytes: int) -> int:
        """Free at least `nbytes` of RAM entries, least recently used first across models."""
        freed = 0
        while freed < nbytes:
            with self._lock:
                caches = list(self._models.values())
            candidates = [(u, mc) for mc in caches if (u := mc.ram.oldest_use()) is not None]
            if not candidates:
                break
            freed += min(candidates, key=lambda c: c[0])[1].ram.evict_oldest()
        return freed

    def relieve(self, level: PressureLevel) -> int:
        """Under RED pressure or worse, drop the whole RAM tier. Returns bytes freed."""
        if level < PressureLevel.RED:
            return 0
        with self._lock:
            caches = list(self._models.values())
        return sum(mc.ram.evict_all() for mc in caches)

    def stats(self, model_id: str | None = None) -> PrefixCacheStats:
        with self._lock:
            caches = list(self._models.values()) if model_id is None else [
                mc for mc in [self._models.get(model_id)] if mc is not None]
        total = self._retired if model_id is None else PrefixCacheStats()
        for mc in caches:
            total += mc.stats()
        return total
