"""kvcache RAM tier and manager on the real tiny model through mlx-lm's BatchGenerator.

Greedy outputs must be identical with and without reuse (exact hit, partial hit from a shorter
entry, partial hit trimmed from a longer entry, SSD hit, miss); every stored byte is a
`prefix_cache` lease in a real Ledger; eviction and purge give every byte back."""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kvcache.disk import DiskBudget
from kvcache.manager import MISS, KvCacheManager, PrefixCacheStats, Reuse, Tier
from kvcache.ram import PrefixCache, StoreOutcome
from kvcache.ssd import SsdStore
from memory.ledger import Ledger, ReservationKind
from memory.policy import GiB, figures
from memory.pressure import PressureLevel
from memory.snapshot import MemorySnapshot

IDLE = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=15 * GiB)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path):
    model, tokenizer = mlx_lm.load(str(tiny_model_path))
    return model


@pytest.fixture
def ledger() -> Ledger:
    return Ledger(figures(16 * GiB, env={}), sample=lambda: IDLE)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def generate(model, ids: list[int], reuse: Reuse | None = None):
    """Greedy tokens for `ids` (max MAX_TOKENS, no EOS) and the finished request's (cache, tokens)."""
    gen = BatchGenerator(model, stop_tokens=None)
    try:
        if reuse is not None and reuse.cache is not None:
            gen.insert([reuse.rest(ids)], max_tokens=[MAX_TOKENS], caches=[reuse.cache],
                       all_tokens=[ids[: reuse.matched]])
        else:
            gen.insert([ids], max_tokens=[MAX_TOKENS])
        out = []
        while True:
            _, responses = gen.next()
            for r in responses:
                out.append(r.token)
                if r.finish_reason is not None:
                    return out, r.prompt_cache, r.all_tokens
    finally:
        gen.close()


def ram_bytes(ledger: Ledger) -> int:
    return ledger.snapshot().bytes_by_kind[ReservationKind.PREFIX_CACHE]


def test_hit_partial_hit_and_miss_give_identical_greedy_outputs(tiny, ledger: Ledger) -> None:
    manager = KvCacheManager(ledger)
    kv = manager.attach("tiny", "w0")
    system = prompt(1, 200)
    first = system + prompt(2, 40)
    cold_first, cache, all_tokens = generate(tiny, first)
    # A finished request's cache holds prompt + completion; its token list says exactly what.
    assert all_tokens[: len(first)] == first and cache[0].offset == len(all_tokens) == len(first) + MAX_TOKENS

    assert kv.fetch(first) == Reuse(None, 0, None)  # miss before anything is stored
    assert kv.store(first, cache) is StoreOutcome.STORED
    assert kv.store(first, cache) is StoreOutcome.COVERED
    assert kv.ram.nbytes == ram_bytes(ledger) > 0

    hit = kv.fetch(first)  # exact: everything but the last prompt token is reused
    assert (hit.matched, hit.tier) == (len(first) - 1, Tier.RAM)
    assert generate(tiny, first, hit)[0] == cold_first

    second = system + prompt(3, 30)  # shares only the system prompt: the entry is trimmed to it
    cold_second = generate(tiny, second)[0]
    partial = kv.fetch(second)
    assert partial.matched == len(system) and partial.cache[0].offset == len(system)
    assert generate(tiny, second, partial)[0] == cold_second

    # The stored entry was not disturbed by the generations that used copies of it.
    again = kv.fetch(first)
    assert generate(tiny, first, again)[0] == cold_first

    longer = first + prompt(4, 25)  # the stored entry is a proper prefix of the new prompt
    cold_longer = generate(tiny, longer)[0]
    extend = kv.fetch(longer)
    assert extend.matched == len(first)
    assert generate(tiny, longer, extend)[0] == cold_longer

    miss = kv.fetch(prompt(5, 50))
    assert miss.cache is None and miss.matched == 0
    assert manager.stats() == PrefixCacheStats(hits=2, partial_hits=2, misses=2, ram_bytes=kv.ram.nbytes,
                                               disk_bytes=0, entries=1,
                                               reused_tokens=hit.matched + partial.matched + again.matched
                                               + extend.matched)


def test_entries_are_cut_to_their_key_and_shorter_ones_are_replaced(tiny, ledger: Ledger) -> None:
    ram = PrefixCache("tiny", ledger)
    base = prompt(6, 100)
    _, cache, _ = generate(tiny, base)
    per_token = cache[0].nbytes // cache[0].offset * len(cache)
    assert ram.store(base[:40], cache) is StoreOutcome.STORED
    assert ram.nbytes == 40 * per_token == ram_bytes(ledger)  # exact positions, not 256-token steps
    assert ram.store(base, cache) is StoreOutcome.STORED  # covers the 40-token entry, which goes
    assert len(ram) == 1 and ram.nbytes == 100 * per_token == ram_bytes(ledger)
    assert len(ledger) == 1


def test_refused_by_ledger_means_not_stored(tiny) -> None:
    tight = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=15 * GiB, mlx_active_bytes=9 * GiB)
    ledger = Ledger(figures(16 * GiB, env={}), sample=lambda: tight)  # no headroom left
    ram = PrefixCache("tiny", ledger)
    ids = prompt(7, 50)
    _, cache, _ = generate(tiny, ids)
    assert ram.store(ids, cache) is StoreOutcome.REFUSED
    assert len(ram) == 0 and len(ledger) == 0 and ram.fetch(ids) is None


def test_max_bytes_evicts_lru_and_unsupported_caches_are_skipped(tiny, ledger: Ledger) -> None:
    ids_a, ids_b, ids_c = prompt(8, 60), prompt(9, 60), prompt(10, 60)
    caches = {tuple(i): generate(tiny, i)[1] for i in (ids_a, ids_b, ids_c)}
    one = sum(c.keys[..., :60, :].nbytes + c.values[..., :60, :].nbytes for c in caches[tuple(ids_a)])
    ram = PrefixCache("tiny", ledger, max_bytes=2 * one)
    for ids in (ids_a, ids_b):
        assert ram.store(ids, caches[tuple(ids)]) is StoreOutcome.STORED
    assert ram.fetch(ids_a) is not None  # a becomes most recent
    assert ram.store(ids_c, caches[tuple(ids_c)]) is StoreOutcome.STORED
    assert ram.fetch(ids_b) is None and ram.fetch(ids_a) is not None and len(ram) == 2
    assert ram.nbytes == ram_bytes(ledger) == 2 * one
    rotating = [RotatingKVCache(max_size=64, keep=4) for _ in caches[tuple(ids_a)]]
    assert ram.store(ids_a, rotating) is StoreOutcome.UNSUPPORTED


def test_eviction_for_room_pressure_and_purge_return_every_byte(tiny, ledger: Ledger) -> None:
    manager = KvCacheManager(ledger)
    kv1, kv2 = manager.attach("m1", "w"), manager.attach("m2", "w")
    ids = [prompt(s, 80) for s in (11, 12, 13)]
    caches = [generate(tiny, i)[1] for i in ids]
    kv1.store(ids[0], caches[0])  # oldest
    kv2.store(ids[1], caches[1])
    kv1.store(ids[2], caches[2])  # newest
    one = kv2.ram.nbytes
    assert ram_bytes(ledger) == 3 * one

    assert manager.evict_for(1) == one  # the LRU entry across models: m1's first
    assert kv1.fetch(ids[0]).cache is None and kv2.fetch(ids[1]).cache is not None
    assert manager.relieve(PressureLevel.YELLOW) == 0
    assert manager.relieve(PressureLevel.RED) == 2 * one
    assert ram_bytes(ledger) == 0 and len(ledger) == 0

    kv1.store(ids[0], caches[0])
    result = manager.purge("m1")
    assert result.ram_bytes == one and ram_bytes(ledger) == 0
    assert kv1.store(ids[0], caches[0]) is StoreOutcome.CLOSED  # a late store after the purge
    assert manager.get("m1") is None and manager.purge("m1").ram_bytes == 0
    assert manager.attach("m1", "w").ram.nbytes == 0  # a reload starts empty
    assert manager.stats().misses == 1 and manager.stats().hits == 1  # purged counters are kept


def test_ssd_hit_after_ram_eviction_and_purge_removes_files(tiny, ledger: Ledger, tmp_path: Path) -> None:
    ssd = SsdStore(tmp_path, budget=DiskBudget(tmp_path, GiB))
    manager = KvCacheManager(ledger, ssd=ssd)
    kv = manager.attach("tiny", "w0")
    ids = prompt(14, 150)
    cold, cache, _ = generate(tiny, ids)
    kv.store(ids, cache, extends=tuple(ids[:100]), reused=100)  # it built on a stored sequence: worth keeping
    assert kv.write_quiet() == 0.0  # the entry's copy was only scheduled: handed over at the next call
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]
    assert kv.write_quiet() is None
    assert len(list(tmp_path.rglob("*"))) == 2  # the model directory and one file
    assert manager.evict_for(2**40) > 0 and kv.ram.nbytes == 0

    other = ids[:100] + prompt(15, 20)
    cold_other = generate(tiny, other)[0]
    from_disk = kv.fetch(other)
    assert (from_disk.tier, from_disk.matched) == (Tier.SSD, 100)
    assert generate(tiny, other, from_disk)[0] == cold_other
    assert kv.ram.nbytes > 0  # promoted: the next fetch is a RAM hit
    again = kv.fetch(ids)
    assert (again.tier, again.matched) == (Tier.RAM, len(ids) - 1)
    assert generate(tiny, ids, again)[0] == cold
    stats = manager.stats()
    assert (stats.ssd_hits, stats.partial_hits, stats.hits) == (1, 1, 1) and stats.disk_bytes > 0

    result = manager.purge("tiny")
    assert result.disk_bytes > 0 and result.ram_bytes > 0
    assert list(tmp_path.iterdir()) == [] and ram_bytes(ledger) == 0
    assert manager.stats().disk_bytes == 0


def test_a_line_nothing_builds_on_is_never_copied_off_the_device(tiny, ledger: Ledger, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """A sequence that reused nothing, or no more than a template's first tokens, stays
    in RAM only: no host copy, no file (most of a provider's requests are never continued)."""
    from kvcache import state

    copies: list[int] = []
    host_copy = state.host_copy
    monkeypatch.setattr(state, "host_copy", lambda cache: copies.append(1) or host_copy(cache))
    manager = KvCacheManager(ledger, ssd=SsdStore(tmp_path, budget=DiskBudget(tmp_path, GiB)))
    kv = manager.attach("tiny", "w0")
    first = prompt(30, 90)
    _, cache, sequence = generate(tiny, first)
    assert kv.store(sequence, cache) is StoreOutcome.STORED
    second = first[:8] + prompt(31, 90)  # shares a template's worth of tokens with the first
    reuse = kv.fetch(second)
    assert reuse.matched == 8 and reuse.key == tuple(sequence)
    _, cache, sequence = generate(tiny, second, reuse)
    assert kv.store(sequence, cache, extends=reuse.key, reused=reuse.matched) is StoreOutcome.STORED
    assert kv.write_quiet() is None and kv.write_quiet() is None
    assert copies == [] and not [f for f in tmp_path.rglob("*") if f.is_file()] and len(kv.ram) == 2


def test_a_conversation_turn_goes_to_ssd_once_it_is_quiet(tiny, ledger: Ledger, tmp_path: Path) -> None:
    """The first turn stays in RAM (nothing built on it yet); a turn that extends the entry it reused
    waits until it has been quiet for the delay (not while a running request extends it), and a turn
    replaced by the next one before then is never written."""
    now = [0.0]
    ssd = SsdStore(tmp_path, budget=DiskBudget(tmp_path, GiB))
    written: list[int] = []
    write = ssd.write
    ssd.write = lambda model, weights, tokens, host: written.append(len(tokens)) or write(model, weights, tokens, host)
    manager = KvCacheManager(ledger, ssd=ssd, write_delay_s=5.0, clock=lambda: now[0])
    kv = manager.attach("tiny", "w0")

    def turn(previous: list[int] | None, seed: int) -> list[int]:
        ids = (previous or []) + prompt(seed, 70)
        reuse = kv.fetch(ids)
        assert reuse.key == (None if previous is None else tuple(previous))
        _, cache, sequence = generate(tiny, ids, reuse)
        assert kv.store(sequence, cache, extends=reuse.key, reused=reuse.matched) is StoreOutcome.STORED
        return list(sequence)

    first = turn(None, 20)
    assert kv.write_quiet() is None and written == []  # a new line: nothing built on it yet
    second = turn(first, 21)
    assert written == [] and kv.write_quiet() == 5.0  # waits
    third = turn(second, 22)  # replaces the second before it was due
    now[0] = 4.0
    assert kv.write_quiet(in_use={tuple(third)}) == 5.0  # a running request extends it: it waits on
    assert written == []
    now[0] = 9.5
    assert kv.write_quiet() is None and written == [len(third)]  # due a delay after its copy: written at once
    hit = ssd.fetch("tiny", "w0", third + [7])
    assert ssd.entries("tiny") == 1 and hit is not None and hit.key == tuple(third)  # one file per conversation


def test_bfloat16_round_trips_through_host_bytes() -> None:
    from mlx_lm.models.cache import KVCache

    from kvcache.state import from_host, host_copy, prefix_copy, settle

    c = KVCache()
    k = mx.random.normal((1, 2, 9, 8)).astype(mx.bfloat16)
    c.update_and_fetch(k, k * 2)
    entry = prefix_copy([c], 7)  # what the tiers keep: exactly its tokens, contiguous
    settle(entry)
    back = from_host(host_copy(entry))
    assert back[0].keys.dtype == mx.bfloat16 and back[0].offset == 7
    assert mx.array_equal(back[0].values, (k * 2)[..., :7, :]).item()
    assert prefix_copy([c], 3)[0].keys.shape == (1, 2, 3, 8)


def synthetic(n: int, seed: int) -> list:
    """One plain KVCache layer holding `n` positions (no model needed: the tier only keeps arrays)."""
    c = KVCache()
    c.keys = mx.random.normal((1, 1, n, 4), key=mx.random.key(seed)).astype(mx.float16)
    c.values = mx.random.normal((1, 1, n, 4), key=mx.random.key(seed + 1)).astype(mx.float16)
    c.offset = n
    return [c]


def test_each_ram_tier_is_one_reservation_that_grows_and_shrinks_with_its_entries() -> None:
    """The tier is charged in aggregate: one ledger entry per model holding sequences, whose bytes are
    exactly what its entries hold, grown with the same capacity check as a new reservation, and
    released once, when the tier empties (a purged or emptied tier holds none)."""
    room = [8 * GiB]  # what the OS reports available (the ledger's room is this less A and the outstanding)
    ledger = Ledger(figures(16 * GiB, env={}))
    manager = KvCacheManager(ledger, sample_snapshot=lambda: _with_available(room[0]))
    kv1, kv2 = manager.attach("m1", "w"), manager.attach("m2", "w")
    one = 16 * 4 * 2 * 2  # 16 positions × 4 dims × keys and values × float16
    for i in range(300):
        assert (kv1 if i % 3 else kv2).store(prompt(100 + i, 16), synthetic(16, i)) is StoreOutcome.STORED
    snap = ledger.snapshot()
    assert snap.count_by_kind[ReservationKind.PREFIX_CACHE] == 2 and len(ledger) == 2
    assert snap.bytes_by_kind[ReservationKind.PREFIX_CACHE] == 300 * one == kv1.ram.nbytes + kv2.ram.nbytes
    assert ledger.bytes_of(kv1.ram.lease_id) == 200 * one and ledger.bytes_of(kv2.ram.lease_id) == 100 * one

    # A store the ledger has no room for is refused and changes nothing.
    room[0] = ledger.figures.activation_reserve_bytes + ledger.outstanding_bytes() + one - 1  # one byte short
    assert kv1.store(prompt(999, 16), synthetic(16, 999)) is StoreOutcome.REFUSED
    assert len(kv1.ram) == 200 and ledger.bytes_of(kv1.ram.lease_id) == 200 * one
    room[0] = 8 * GiB

    assert manager.evict_for(5 * one) == 5 * one  # least recently used first, across both models
    assert ram_bytes(ledger) == 295 * one and ledger.snapshot().count_by_kind[ReservationKind.PREFIX_CACHE] == 2
    held = kv2.ram.nbytes
    assert kv2.ram.evict_all() == held == ledger.release(kv2.ram.lease_id) + held
    assert kv2.ram.lease_id not in ledger and len(kv2.ram) == 0  # emptied: its reservation is released
    assert kv2.store(prompt(1000, 16), synthetic(16, 1000)) is StoreOutcome.STORED  # a fresh one is taken
    assert ledger.bytes_of(kv2.ram.lease_id) == one

    held = kv1.ram.nbytes
    assert manager.purge("m1").ram_bytes == held and kv1.ram.lease_id not in ledger
    assert kv1.store(prompt(1001, 16), synthetic(16, 1001)) is StoreOutcome.CLOSED
    again = manager.attach("m1", "w")
    assert again.ram.lease_id != kv1.ram.lease_id  # a reload's tier never shares the purged one's id
    assert manager.purge("m2").ram_bytes == one and manager.purge("m1").ram_bytes == 0
    assert len(ledger) == 0 and ledger.outstanding_bytes() == 0


def _with_available(nbytes: int) -> MemorySnapshot:
    """An idle 16 GiB machine whose OS reports `nbytes` available."""
    return MemorySnapshot(physical_bytes=16 * GiB, available_bytes=nbytes)


def test_a_prefix_shorter_than_min_tokens_is_a_miss_and_copies_nothing(tiny, ledger: Ledger) -> None:
    """A request shares a chat template's first tokens with nearly every stored sequence: below
    `min_tokens` the manager answers MISS (counted as one) instead of copying a few tokens' KV."""
    manager = KvCacheManager(ledger)
    kv = manager.attach("tiny", "w0")
    ids = prompt(21, 80)
    _, cache, _ = generate(tiny, ids)
    kv.store(ids, cache)
    short = ids[:20] + prompt(22, 40)
    assert kv.longest_match(short) == 20
    assert kv.fetch(short, min_tokens=21) is MISS
    stats = manager.stats()
    assert (stats.hits, stats.partial_hits, stats.misses, stats.reused_tokens) == (0, 0, 1, 0)
    taken = kv.fetch(short, min_tokens=20)
    assert (taken.tier, taken.matched) == (Tier.RAM, 20) and manager.stats().partial_hits == 1
    # A whole prompt but its last token is reused however short it is.
    whole = kv.fetch(ids[:11], min_tokens=48)
    assert (whole.tier, whole.matched) == (Tier.RAM, 10) and manager.stats().hits == 1
