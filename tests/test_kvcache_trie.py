"""kvcache.trie: PrefixIndex against a brute-force model (hypothesis stateful test), plus examples."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcache.trie import PrefixIndex

TOKEN_BYTES = 4  # the index packs each token id in 4 bytes

# A small alphabet and short keys make shared prefixes, prefix-of-key and longer-key cases common.
keys = st.lists(st.integers(0, 3), min_size=1, max_size=6).map(tuple)
queries = st.lists(st.integers(0, 3), min_size=0, max_size=8).map(tuple)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index: PrefixIndex[int] = PrefixIndex()
        self.model: dict[tuple[int, ...], int] = {}
        self.order: list[tuple[int, ...]] = []  # LRU, oldest first
        self.serial = 0

    def _used(self, key: tuple[int, ...]) -> None:
        if key in self.order:
            self.order.remove(key)
        self.order.append(key)

    @rule(key=keys)
    def insert(self, key: tuple[int, ...]) -> None:
        self.serial += 1
        previous = self.index.insert(key, self.serial)
        assert previous == self.model.get(key)
        self.model[key] = self.serial
        self._used(key)

    @rule(key=keys)
    def remove(self, key: tuple[int, ...]) -> None:
        assert self.index.remove(key) == self.model.pop(key, None)
        if key in self.order:
            self.order.remove(key)

    @rule(query=queries)
    def lookup(self, query: tuple[int, ...]) -> None:
        best = max((common_prefix(k, query) for k in self.model), default=0)
        match = self.index.lookup(query)
        if best == 0:
            assert match is None
            return
        assert match is not None and match.common == best
        assert match.key in self.model and match.value == self.model[match.key]
        assert common_prefix(match.key, query) == best
        if query[:best] in self.model:  # an entry ending exactly there needs no trim: it wins
            assert match.key == query[:best]

    @rule(key=keys)
    def touch(self, key: tuple[int, ...]) -> None:
        if key in self.model:
            self.index.touch(key)
            self._used(key)

    @rule(key=keys)
    def prefixes_and_covers(self, key: tuple[int, ...]) -> None:
        expected = sorted((k for k in self.model if len(k) < len(key) and key[: len(k)] == k), key=len)
        assert self.index.prefixes_of(key) == expected
        assert self.index.covers(key) == any(k[: len(key)] == key for k in self.model)

    @invariant()
    def same_contents_and_order(self) -> None:
        assert len(self.index) == len(self.model)
        assert list(self.index.keys_lru()) == self.order
        assert self.index.oldest() == (self.order[0] if self.order else None)

    @invariant()
    def no_dead_paths(self) -> None:
        # Every node is on the path of a stored key (removal prunes), counts agree, edges are keyed by
        # their first (packed) token, and a node that holds no key has at least two children (edges end only
        # where keys part), so the tree has at most two nodes per stored key.
        def walk(node, depth: int) -> int:
            below = int(node.terminal) + sum(walk(c, depth + 1) for c in node.children.values())
            assert node.below == below
            assert all(len(t) == TOKEN_BYTES and c.edge.startswith(t) for t, c in node.children.items())
            if depth:
                assert below > 0 and (node.terminal or len(node.children) >= 2)
            return below

        def count(node) -> int:
            return 1 + sum(count(c) for c in node.children.values())

        assert walk(self.index._root, 0) == len(self.model)
        assert count(self.index._root) <= 1 + 2 * len(self.model)


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase


def test_lookup_prefers_shorter_stored_prefix_or_trims_longer_one() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    index.insert((1, 2, 3, 4, 5), "conversation")
    m = index.lookup((1, 2, 3, 9))
    assert m is not None and (m.key, m.common) == ((1, 2, 3, 4, 5), 3)
    index.insert((1, 2), "system")
    m = index.lookup((1, 2, 7))
    assert m is not None and (m.key, m.value, m.common) == ((1, 2), "system", 2)
    assert index.lookup((8,)) is None and index.lookup(()) is None
    assert index.clear() == [((1, 2, 3, 4, 5), "conversation"), ((1, 2), "system")]
    assert len(index) == 0 and index.lookup((1, 2)) is None


def test_a_stored_key_costs_a_few_bytes_a_token() -> None:
    """Keys and edges are packed token ids: ~8 bytes a token held (the key, its edge), where tuples of
    Python ints held ~44 (a pointer and an int object per token in the key, another pointer in an edge)."""
    import random
    import tracemalloc

    rng = random.Random(7)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index: PrefixIndex[int] = PrefixIndex()
        for i in range(200):
            tokens = [rng.randrange(300, 150_000) for _ in range(500)]  # fresh ints, as a tokenizer makes them
            index.insert(tokens, i)
            del tokens
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == 200 and held / (200 * 500) < 12, f"{held / (200 * 500):.1f} bytes a token"
