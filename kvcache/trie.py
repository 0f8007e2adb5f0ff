"""An MLX-free index of token sequences: longest common prefix lookup plus LRU order.

Keys are sequences of token ids (tuples in and out). `lookup(query)` finds the stored key that shares
the longest common prefix with `query`: a stored key may be shorter than the query (a plain prefix) or
longer (a past conversation that went on; its KV is trimmed back to the common part by the caller,
which works because mlx-lm's `KVCache` is trimmable). Among keys with the same common length the one
that ends exactly there wins (nothing to trim); otherwise any key below that point does (all tie).

A radix tree: each node holds the run of tokens (`edge`) from its parent, so a stored sequence costs
one node where it leaves the others (two when it splits an edge), not one per token: a store, a
lookup and the memory an entry pins stay small however long the sequences are (a token-per-node trie
spent ~36 KB of Python objects and ~100 us of node building per 180-token sequence). Inside, keys and
edges are packed token ids (`bytes`, 4 per token, compared as slices in C), not tuples of Python ints
(~36 bytes a token: the RAM tier of a small model held ~2 % of its KV bytes again in keys); a key is
a tuple again only where it is handed out. Each node counts the stored keys in its subtree, so a
lookup walks down once and then follows any non-empty child to a key. LRU order is an `OrderedDict`
next to it. Values are opaque, so the index is property-tested against a brute-force model without
MLX (tests/test_kvcache_trie.py).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")
Key = tuple[int, ...]
_T = array("I").itemsize  # bytes per packed token id


def _pack(tokens: Sequence[int]) -> bytes:
    return array("I", tokens).tobytes()


def _unpack(packed: bytes) -> Key:
    a = array("I")
    a.frombytes(packed)
    return tuple(a)


class _Node:
    __slots__ = ("edge", "children", "below", "terminal")

    def __init__(self, edge: bytes = b"") -> None:
        self.edge = edge  # the packed tokens from the parent to this node
        self.children: dict[bytes, _Node] = {}  # by the first packed token of the child's edge
        self.below = 0  # stored keys in this subtree, this node included
        self.terminal = False


def _common(edge: bytes, key: bytes, start: int) -> int:
    """How many leading bytes of `edge` equal `key[start:]`, in whole tokens (slices compared in C,
    halving on a miss)."""
    n = min(len(edge), len(key) - start)
    if edge[:n] == key[start:start + n]:
        return n
    lo, hi = 0, n // _T  # lo tokens match, hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edge[:mid * _T] == key[start:start + mid * _T]:
            lo = mid
        else:
            hi = mid
    return lo * _T


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
        self._values: OrderedDict[bytes, V] = OrderedDict()  # packed key -> value, oldest first

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        try:
            return _pack(key) in self._values
        except (TypeError, OverflowError):  # not a sequence of token ids: never stored
            return False

    def get(self, key: Sequence[int]) -> V | None:
        return self._values.get(_pack(key))

    def keys_lru(self) -> Iterator[Key]:
        """Stored keys, least recently used first."""
        return iter([_unpack(k) for k in self._values])

    def oldest(self) -> Key | None:
        packed = next(iter(self._values), None)
        return None if packed is None else _unpack(packed)

    def touch(self, key: Sequence[int]) -> None:
        """Mark `key` most recently used."""
        self._values.move_to_end(_pack(key))

    def insert(self, key: Sequence[int], value: V) -> V | None:
        """Store `value` under `key` as most recently used; returns the value it replaced."""
        key = _pack(key)
        previous = self._values.pop(key, None)
        if previous is None:
            node, at = self._root, 0
            path = [node]
            while at < len(key):
                head = key[at:at + _T]
                child = node.children.get(head)
                if child is None:  # the key leaves every stored one here: one node for the rest
                    child = node.children[head] = _Node(key[at:])
                    at = len(key)
                else:
                    n = _common(child.edge, key, at)
                    if n < len(child.edge):  # it leaves inside an edge: split it there
                        mid = node.children[head] = _Node(child.edge[:n])
                        child.edge = child.edge[n:]
                        mid.children[child.edge[:_T]] = child
                        mid.below = child.below
                        child = mid
                    at += n
                node = child
                path.append(node)
            node.terminal = True
            for n in path:
                n.below += 1
        self._values[key] = value
        return previous

    def remove(self, key: Sequence[int]) -> V | None:
        """Drop `key`; returns its value, None when it was not stored."""
        key = _pack(key)
        if key not in self._values:
            return None
        value = self._values.pop(key)
        path = [self._root]
        node, at = self._root, 0
        while at < len(key):
            node = node.children[key[at:at + _T]]
            at += len(node.edge)
            path.append(node)
        node.terminal = False
        for n in path:
            n.below -= 1
        # Prune the now-empty tail so the tree never holds dead paths, and merge a node left with
        # one child and no key of its own into that child, so every edge ends where keys part.
        for depth in range(len(path) - 1, 0, -1):
            child, parent = path[depth], path[depth - 1]
            if not child.below:
                del parent.children[child.edge[:_T]]
            elif not child.terminal and len(child.children) == 1:
                (only,) = child.children.values()
                only.edge = child.edge + only.edge
                parent.children[child.edge[:_T]] = only
        return value

    def _walk(self, query: bytes) -> tuple[_Node, int, int]:
        """Follow `query` down: the deepest node reached, the bytes matched, and how many of them lie
        on that node's edge (all of it when the match ends at the node)."""
        node, common, on_edge = self._root, 0, 0
        while common < len(query):
            child = node.children.get(query[common:common + _T])
            if child is None:
                break
            n = _common(child.edge, query, common)
            node, common, on_edge = child, common + n, n
            if n < len(child.edge):
                break
        return node, common, on_edge

    def lookup(self, query: Sequence[int]) -> Match[V] | None:
        """The stored key sharing the longest common prefix (≥ 1 token) with `query`, or None."""
        query = _pack(query)
        node, common, on_edge = self._walk(query)
        if common == 0:
            return None
        key = query[:common]
        if on_edge < len(node.edge):
            key += node.edge[on_edge:]  # the match ends inside this edge: its keys run on
        if not node.terminal:
            key += self._descend_to_key(node)
        return Match(_unpack(key), self._values[key], common // _T)

    def _descend_to_key(self, node: _Node) -> bytes:
        # Any key below `node` shares the same common prefix; follow non-empty children down.
        tail = b""
        while not node.terminal:
            node = next(c for c in node.children.values() if c.below)
            tail += node.edge
        return tail

    def prefixes_of(self, key: Sequence[int]) -> list[Key]:
        """Stored keys that are proper prefixes of `key` (shortest first)."""
        key = _pack(key)
        found: list[Key] = []
        node, at = self._root, 0
        while at < len(key):
            if node.terminal and at:
                found.append(_unpack(key[:at]))
            child = node.children.get(key[at:at + _T])
            if child is None or _common(child.edge, key, at) < len(child.edge):
                return found
            node, at = child, at + len(child.edge)
        return found

    def covers(self, key: Sequence[int]) -> bool:
        """True when some stored key has `key` as a prefix (itself included)."""
        key = _pack(key)
        node, common, _ = self._walk(key)
        return common == len(key) and node.below > 0

    def clear(self) -> list[tuple[Key, V]]:
        """Drop everything; returns the (key, value) pairs, oldest first."""
        items = [(_unpack(k), v) for k, v in self._values.items()]
        self._root = _Node()
        self._values.clear()
        return items
