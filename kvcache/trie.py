"""An MLX-free index of token sequences: longest common prefix lookup plus LRU order.

Keys are tuples of token ids. `lookup(query)` finds the stored key that shares the longest common
prefix with `query`: a stored key may be shorter than the query (a plain prefix) or longer (a past
conversation that went on; its KV is trimmed back to the common part by the caller, which works
because mlx-lm's `KVCache` is trimmable). Among keys with the same common length the one that ends
exactly there wins (nothing to trim); otherwise any key below that point does (all tie).

The trie holds one node per distinct (prefix, token); each node counts the stored keys in its
subtree so a lookup walks down once and then follows any non-empty child to a key. LRU order is an
`OrderedDict` next to it. Values are opaque, so the index is property-tested against a brute-force
model without MLX (tests/test_kvcache_trie.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")
Key = tuple[int, ...]


class _Node:
    __slots__ = ("children", "below", "terminal")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.below = 0  # stored keys in this subtree, this node included
        self.terminal = False


@dataclass(frozen=True, slots=True)
class Match(Generic[V]):
    """The best stored key for a query: `common` leading tokens are shared with the query."""

    key: Key
    value: V
    common: int


class PrefixIndex(Generic[V]):
    """Token-sequence keys → values, with longest-common-prefix lookup and LRU order. Not thread-safe:
    the owner holds its own lock."""

    def __init__(self) -> None:
        self._root = _Node()
        self._values: OrderedDict[Key, V] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def get(self, key: Key) -> V | None:
        return self._values.get(key)

    def keys_lru(self) -> Iterator[Key]:
        """Stored keys, least recently used first."""
        return iter(list(self._values))

    def oldest(self) -> Key | None:
        return next(iter(self._values), None)

    def touch(self, key: Key) -> None:
        """Mark `key` most recently used."""
        self._values.move_to_end(key)

    def insert(self, key: Sequence[int], value: V) -> V | None:
        """Store `value` under `key` as most recently used; returns the value it replaced."""
        key = tuple(key)
        previous = self._values.pop(key, None)
        if previous is None:
            path = [self._root]
            node = self._root
            for token in key:
                node = node.children.setdefault(token, _Node())
                path.append(node)
            node.terminal = True
            for n in path:
                n.below += 1
        self._values[key] = value
        return previous

    def remove(self, key: Sequence[int]) -> V | None:
        """Drop `key`; returns its value, None when it was not stored."""
        key = tuple(key)
        if key not in self._values:
            return None
        value = self._values.pop(key)
        path = [self._root]
        node = self._root
        for token in key:
            node = node.children[token]
            path.append(node)
        node.terminal = False
        for n in path:
            n.below -= 1
        # Prune the now-empty tail so the trie never holds dead paths.
        for depth in range(len(key), 0, -1):
            if path[depth].below:
                break
            del path[depth - 1].children[key[depth - 1]]
        return value

    def lookup(self, query: Sequence[int]) -> Match[V] | None:
        """The stored key sharing the longest common prefix (≥ 1 token) with `query`, or None."""
        node = self._root
        common = 0
        for token in query:
            child = node.children.get(token)
            if child is None:
                break
            node, common = child, common + 1
        if common == 0:
            return None
        key = tuple(query[:common])
        if not node.terminal:
            key += self._descend_to_key(node)
        return Match(key, self._values[key], common)

    def _descend_to_key(self, node: _Node) -> Key:
        # Any key below `node` shares the same common prefix; follow non-empty children down.
        tail: list[int] = []
        while not node.terminal:
            token, node = next((t, c) for t, c in node.children.items() if c.below)
            tail.append(token)
        return tuple(tail)

    def prefixes_of(self, key: Sequence[int]) -> list[Key]:
        """Stored keys that are proper prefixes of `key` (shortest first)."""
        found: list[Key] = []
        node = self._root
        for depth, token in enumerate(key):
            if node.terminal and depth:
                found.append(tuple(key[:depth]))
            child = node.children.get(token)
            if child is None:
                return found
            node = child
        return found

    def covers(self, key: Sequence[int]) -> bool:
        """True when some stored key has `key` as a prefix (itself included)."""
        node = self._root
        for token in key:
            child = node.children.get(token)
            if child is None:
                return False
            node = child
        return node.below > 0

    def clear(self) -> list[tuple[Key, V]]:
        """Drop everything; returns the (key, value) pairs, oldest first."""
        items = list(self._values.items())
        self._root = _Node()
        self._values.clear()
        return items
