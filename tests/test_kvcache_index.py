"""kvcache.blockindex: the SSD tier's index of block digests, against a brute-force model of the
sequences it holds (hypothesis stateful test), its structure after every step, what it holds in
memory per stored sequence (tracemalloc) through `SsdStore` as the tier uses it, and its bytes in
the memory ledger."""

from __future__ import annotations

import random
import tracemalloc
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcache.blockindex import BLOCK, BlockIndex, Digested, _Node, common_tokens, token_bytes
from kvcache.disk import DiskBudget
from kvcache.host import HostArray, HostCache
from kvcache.manager import KvCacheManager
from kvcache.ssd import SsdStore, WriteOutcome
from kvcache.trie import PrefixIndex
from memory.ledger import Ledger, ReservationKind
from memory.policy import GiB, figures
from memory.snapshot import MemorySnapshot

KEY = bytes(range(32))
MODEL, WEIGHTS = "org/tiny-model", "sha256:abc"

# Sequences cut from a few long base sequences at any point, then run on with a few tokens of a
# small alphabet: shared prefixes that part inside a block, at a block's edge, in a tail; stored
# sequences that are prefixes of others, and queries that run past them or stop short.
BASES = [random.Random(i).choices(range(50_000), k=4 * BLOCK) for i in range(3)]
seqs = st.builds(lambda b, cut, rest: tuple(BASES[b][:cut] + rest),
                 st.integers(0, len(BASES) - 1), st.integers(1, 4 * BLOCK),
                 st.lists(st.integers(0, 2), max_size=BLOCK + 3))


def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def promised(key: tuple[int, ...], query: tuple[int, ...]) -> int:
    """What the digests can see of `key` from `query`: all of it when it is a prefix of the query,
    else its common whole blocks."""
    c = common(key, query)
    return c if c == len(key) else c // BLOCK * BLOCK


def digested(tokens: tuple[int, ...]) -> Digested:
    return Digested(tokens, KEY)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex()
        self.model: dict[tuple[int, ...], str] = {}
        self.serial = 0

    @rule(key=seqs)
    def insert(self, key: tuple[int, ...]) -> None:
        self.serial += 1
        name = f"f{self.serial}"
        assert self.index.insert(digested(key), name) == self.model.get(key)
        self.model[key] = name

    @rule(key=seqs)
    def remove(self, key: tuple[int, ...]) -> None:
        name = self.model.pop(key, None)
        assert self.index.remove(name if name is not None else "absent") is (name is not None)

    @rule(query=seqs)
    def find(self, query: tuple[int, ...]) -> None:
        assert self.index.find(digested(query)) == self.model.get(query)

    @rule(query=seqs)
    def longest(self, query: tuple[int, ...]) -> None:
        best = max((promised(k, query) for k in self.model), default=0)
        found = self.index.longest(digested(query))
        if best == 0:
            assert found is None
            return
        by_name = {v: k for k, v in self.model.items()}
        assert found is not None and found.common == best
        assert common(by_name[found.name], query) >= best  # never more than the stored sequence shares

    @rule(query=seqs)
    def prefixes_of(self, query: tuple[int, ...]) -> None:
        expected = {name for k, name in self.model.items() if len(k) < len(query) and query[: len(k)] == k}
        found = self.index.prefixes_of(digested(query))
        assert len(found) == len(set(found)) and set(found) == expected

    @rule(query=seqs)
    def covers(self, query: tuple[int, ...]) -> None:
        if len(query) % BLOCK:
            expected = query in self.model
        else:
            expected = any(k[: len(query)] == query for k in self.model)
        assert self.index.covers(digested(query)) is expected

    @invariant()
    def structure(self) -> None:
        """Every node below the root holds a file or parts two ways; parents, keys, tail bits and the
        running counts behind `nbytes` agree with the tree; nothing left when nothing is stored."""
        nodes = dicts = edge_bytes = 0
        names = set()
        stack: list[_Node] = [self.index._root]
        while stack:
            node = stack.pop()
            if node.name is not None:
                names.add(node.name)
            children = node.children or {}
            if node.children is not None:
                assert children
                dicts += 1
            if node is not self.index._root:
                nodes += 1
                edge_bytes += len(node.edge)
                assert node.name is not None or len(children) >= 2
            tails = 0
            for head, child in children.items():
                assert child.parent is node and child.edge[:8] == head
                if child.edge[0]:
                    tails |= 1 << child.edge[0]
                stack.append(child)
            assert node.tails == tails
        assert names == set(self.model.values()) and len(self.index) == len(self.model)
        assert (nodes, dicts, edge_bytes) == (self.index._nodes, self.index._dicts, self.index._edge_bytes)
        if not self.model:
            assert self.index.nbytes == 0


TestBlockIndex = IndexMachine.TestCase
TestBlockIndex.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_a_lookup_parts_inside_a_block_at_the_block_before_it() -> None:
    index = BlockIndex()
    stored = tuple(range(1, 3 * BLOCK + 5))
    index.insert(digested(stored), "a")
    query = stored[: 2 * BLOCK + 7] + (0,)  # parts 7 tokens into the third block
    found = index.longest(digested(query))
    assert found is not None and (found.name, found.common) == ("a", 2 * BLOCK)
    assert index.longest(digested(stored + (9, 9))).common == len(stored)  # all of it, tail included
    assert index.longest(digested((0,) + stored)) is None


def test_common_tokens_compares_id_by_id() -> None:
    a = token_bytes([5, 6, 7, 70_000, 9])
    assert common_tokens(a, token_bytes([5, 6, 7, 70_000, 9, 1])) == 5
    assert common_tokens(a, token_bytes([5, 6, 7, 70_001])) == 3  # 70,000 and 70,001 share 3 of 4 bytes
    assert common_tokens(a, token_bytes([4])) == 0
    assert common_tokens(a, b"") == 0


def tiny_cache(tokens: int) -> HostCache:
    shape = (1, 1, tokens, 1)
    return HostCache(tokens, ((HostArray("float32", shape, bytes(4 * tokens)),) * 2,))


def sequences(n: int, seed: int) -> list[list[int]]:
    """`n` conversations of 500-2,000 tokens, a third of them opening with one shared 300-token system prompt."""
    rng = random.Random(seed)
    system = rng.choices(range(50_000), k=300)
    out = []
    for i in range(n):
        head = system if i % 3 == 0 else []
        out.append(head + rng.choices(range(50_000), k=rng.randint(500, 2_000) - len(head)))
    return out


def test_the_ssd_tier_holds_a_small_constant_per_file(tmp_path: Path) -> None:
    """What the tier keeps in memory for each file (its index and its disk budget's record), measured
    with tracemalloc: under 1 KiB a file for sequences of 500-2,000 tokens, where the index of token
    tuples it had before held ~40 bytes a token (20-80 KiB a file) and one of packed token ids holds ~5;
    and what it charges to the ledger (`index_bytes`) is at least what it holds and not much more."""
    n = 200
    seqs = sequences(n, seed=1)
    store = SsdStore(tmp_path, budget=DiskBudget(tmp_path, 2**30, free_bytes_fn=lambda _: 2**40))
    store.open(MODEL, WEIGHTS)
    caches = [tiny_cache(len(s)) for s in seqs]
    store.write(MODEL, WEIGHTS, [1, 2, 3], tiny_cache(3))  # first-use allocations out of the count
    charged = store.index_bytes(MODEL)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for s, cache in zip(seqs, caches, strict=True):
            assert store.write(MODEL, WEIGHTS, s, cache) is WriteOutcome.WRITTEN
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    charged = store.index_bytes(MODEL) - charged
    assert store.entries(MODEL) == n + 1
    assert held / n < 1024, f"{held / n:.0f} bytes a file"
    assert held <= charged < 1.3 * held, (held, charged)
    # the same sequences in a token index (kvcache/trie: the RAM tier's, token ids packed 4 bytes each): more
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        old: PrefixIndex[str] = PrefixIndex()
        for i, s in enumerate(seqs):
            old.insert(s, f"{i:032x}")
        old_held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert old_held > 5 * held, (old_held, held)


def test_the_index_costs_the_same_for_short_and_long_sequences() -> None:
    """Bytes per entry for 200 sequences of 2,000 tokens are within 1 KiB of those for 200 of 100
    tokens: 8 bytes per 32 tokens, not an object per token."""
    def per_entry(length: int) -> float:
        rng = random.Random(length)
        seqs = [Digested(rng.choices(range(50_000), k=length), KEY) for _ in range(200)]
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            index = BlockIndex()
            for i, s in enumerate(seqs):
                index.insert(s, f"{i:032x}")
            return (tracemalloc.get_traced_memory()[0] - before) / len(seqs)
        finally:
            tracemalloc.stop()

    short, long = per_entry(100), per_entry(2_000)
    assert long - short < 1024, (short, long)


IDLE = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=15 * GiB)


def index_reserved(ledger: Ledger) -> tuple[int, int]:
    snap = ledger.snapshot()
    return snap.count_by_kind[ReservationKind.PREFIX_INDEX], snap.bytes_by_kind[ReservationKind.PREFIX_INDEX]


def test_the_index_is_charged_to_the_ledger_from_its_first_file_to_the_purge(tmp_path: Path) -> None:
    ledger = Ledger(figures(16 * GiB, env={}), sample=lambda: IDLE)
    store = SsdStore(tmp_path, budget=DiskBudget(tmp_path, GiB, free_bytes_fn=lambda _: 100 * GiB))
    manager = KvCacheManager(ledger, ssd=store)
    manager.attach(MODEL, WEIGHTS)  # opens the model's SSD directory with its ledger lease
    assert index_reserved(ledger) == (0, 0)
    seqs = sequences(6, seed=2)
    for s in seqs:
        assert store.write(MODEL, WEIGHTS, s, tiny_cache(len(s))) is WriteOutcome.WRITTEN
    assert index_reserved(ledger) == (1, store.index_bytes(MODEL)) and store.index_bytes(MODEL) > 0
    longer = seqs[0] + [1, 2, 3]  # replaces the file it extends: the index shrinks and grows again
    assert store.write(MODEL, WEIGHTS, longer, tiny_cache(len(longer))) is WriteOutcome.WRITTEN
    assert store.entries(MODEL) == 6 and index_reserved(ledger) == (1, store.index_bytes(MODEL))
    manager.purge(MODEL)
    assert index_reserved(ledger) == (0, 0) and store.index_bytes() == 0


def test_a_file_the_ledger_has_no_room_for_is_not_written(tmp_path: Path) -> None:
    full = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=GiB)  # under the activation reserve
    ledger = Ledger(figures(16 * GiB, env={}), sample=lambda: full)
    store = SsdStore(tmp_path, budget=DiskBudget(tmp_path, GiB, free_bytes_fn=lambda _: 100 * GiB))
    KvCacheManager(ledger, ssd=store).attach(MODEL, WEIGHTS)
    s = sequences(1, seed=3)[0]
    assert store.write(MODEL, WEIGHTS, s, tiny_cache(len(s))) is WriteOutcome.NO_MEMORY
    assert store.entries(MODEL) == 0 and store.disk_bytes() == 0 and store.index_bytes() == 0
    assert not [f for f in tmp_path.rglob("*") if f.is_file()] and index_reserved(ledger) == (0, 0)
