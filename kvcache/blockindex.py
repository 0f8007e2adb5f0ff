"""The SSD tier's in-memory index: stored token sequences → file names, held as digests, not tokens.

A sequence is cut into blocks of `BLOCK` tokens; each block becomes one 8-byte symbol, a keyed
BLAKE2b digest of its token ids (the key is random per process, so nobody can aim two blocks at the
same symbol), and a last partial block of r tokens becomes a "tail" symbol whose first byte is r
(a full block's is 0). The index is a radix tree over those symbols, like `kvcache/trie.py` over
tokens: each node holds the run of symbols (`edge`, one `bytes`) from its parent, so a stored
sequence costs one node where it leaves the others (two when it splits an edge), and no Python int,
list or tuple per token: what a file costs here is a few objects plus 8 bytes per 32 tokens that no
other file shares (about 0.9 KiB for a sequence of 100 tokens, 1.2 KiB for 2,000; the token-tuple
index it replaced held ~36 bytes per token and ~19 KiB per file). The tokens themselves are sealed in
the file (kvcache/ssd.py).

What a digest can and cannot say: a lookup finds the stored sequence that shares the most leading
*blocks* with the query (and a whole tail, when a stored sequence ends inside the query's last
block), so `Found.common` is a lower bound of the true common prefix, short of it by less than one
block where the two part inside a block. Two different blocks with one digest (2^-64 for any given
pair) would make it an over-statement; so nothing here is trusted to choose KV: the caller reads the
file, compares the sealed tokens with the query and reuses only what really matches
(`SsdStore.fetch`). A false match costs one read; a block split by a parting costs < `BLOCK` tokens
of prefill.

`nbytes` is what the index holds in Python objects, kept as running counts (nodes, edge bytes,
names) times the measured size of each (tests/test_kvcache_index.py checks it against tracemalloc),
so the tier can charge it to the memory ledger: a little above what it holds, never far below. Not thread-safe: `SsdStore` holds its lock.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK = 32  # tokens per symbol
SYMBOL = 8  # bytes per symbol: 1 byte tail length (0: a full block) + 7 bytes of digest
_DIGEST = SYMBOL - 1
_FULL = b"\0"
_TOKEN = 4  # bytes per token id (uint32, little-endian)

def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32: what the index hashes and what the file seals."""
    a = array("I", tokens)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


class Digested:
    """One token sequence as the index sees it: its full-block symbols, computed once, and the raw
    token bytes for the tail symbols a lookup probes. Cheap to make outside any lock."""

    __slots__ = ("raw", "length", "blocks", "_key")

    def __init__(self, tokens: Sequence[int] | bytes, key: bytes) -> None:
        self.raw = tokens if isinstance(tokens, bytes) else token_bytes(tokens)
        self.length = len(self.raw) // _TOKEN
        self._key = key
        view, step = memoryview(self.raw), BLOCK * _TOKEN
        self.blocks = b"".join(
            _FULL + hashlib.blake2b(view[at: at + step], digest_size=_DIGEST, key=key).digest()
            for at in range(0, (self.length // BLOCK) * step, step))

    def tail(self, start: int, r: int) -> bytes:
        """The tail symbol of the `r` tokens from token `start` (0 < r < BLOCK)."""
        piece = memoryview(self.raw)[start * _TOKEN: (start + r) * _TOKEN]
        return bytes((r,)) + hashlib.blake2b(piece, digest_size=_DIGEST, key=self._key).digest()

    def symbols(self) -> bytes:
        """The whole sequence: its full blocks, then its tail symbol if it ends inside a block."""
        r = self.length % BLOCK
        return self.blocks + (self.tail(self.length - r, r) if r else b"")


class _Node:
    __slots__ = ("edge", "children", "parent", "name", "tails")

    def __init__(self, edge: bytes, parent: _Node | None) -> None:
        self.edge = edge  # the symbols from the parent to this node
        self.children: dict[bytes, _Node] | None = None  # by the first symbol of the child's edge
        self.parent = parent
        self.name: str | None = None  # the file of the sequence that ends here
        self.tails = 0  # bit r set: a child is the tail symbol of r tokens


# What the index's objects take, from this interpreter's own sizes: a node with its edge's `bytes`
# header, its key in its parent's dict and its share of that dict's table (~1.5 slots of 8 + 24
# bytes); a children dict of one entry (more entries: the slots above); an entry's by-name slot.
_SLOT_BYTES = 48
NODE_BYTES = sys.getsizeof(_Node(b"", None)) + sys.getsizeof(b"") + sys.getsizeof(bytes(SYMBOL)) + _SLOT_BYTES
DICT_BYTES = sys.getsizeof({b"": None})
ENTRY_BYTES = _SLOT_BYTES


@dataclass(frozen=True, slots=True)
class Found:
    """A stored sequence for a query: its file `name`, and `common` leading tokens that the digests
    say it shares with the query (a lower bound; see the module docstring)."""

    name: str
    common: int


class BlockIndex:
    """Stored sequences (as `Digested`) → file names: exact find, longest common prefix by blocks,
    stored prefixes of a sequence, removal by name."""

    def __init__(self) -> None:
        self._root = _Node(b"", None)
        self._by_name: dict[str, _Node] = {}
        self._nodes = 0  # below the root
        self._dicts = 0  # children dicts
        self._edge_bytes = 0
        self._name_bytes = 0

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def nbytes(self) -> int:
        """The Python objects this index holds (the root excepted)."""
        return (self._nodes * NODE_BYTES + self._dicts * DICT_BYTES + self._edge_bytes
                + len(self._by_name) * ENTRY_BYTES + self._name_bytes)

    # -- reading ------------------------------------------------------------------------------

    def find(self, seq: Digested) -> str | None:
        """The file stored under exactly this sequence (by its digests), or None."""
        node = self._exact(seq.symbols())
        return None if node is None else node.name

    def longest(self, seq: Digested) -> Found | None:
        """The stored sequence sharing the most leading blocks with `seq` (≥ 1 token), or None."""
        node, matched, on_edge = self._walk(seq.blocks)
        common = matched // SYMBOL * BLOCK
        tails = self._tails_at(node, on_edge, seq, common, seq.length - common)
        if tails:
            return Found(tails[-1].name, common + tails[-1].edge[-SYMBOL])
        if common == 0:
            return None
        while node.name is None:  # any sequence below shares the same blocks
            node = next(iter(node.children.values()))
        return Found(node.name, common)

    def covers(self, seq: Digested) -> bool:
        """True when the digests say a stored sequence starts with all of `seq` (itself included).
        A sequence ending inside a block counts as covered only by one stored under exactly it."""
        if seq.length % BLOCK:
            return self.find(seq) is not None
        node, matched, _ = self._walk(seq.blocks)
        return matched == len(seq.blocks) and node is not self._root

    def prefixes_of(self, seq: Digested) -> list[str]:
        """Files of stored sequences that are proper prefixes of `seq`, shortest first."""
        found: list[str] = []
        node, at, blocks = self._root, 0, seq.blocks
        while True:
            tokens = at // SYMBOL * BLOCK
            if node.name is not None and 0 < tokens < seq.length:
                found.append(node.name)
            most = min(BLOCK - 1, seq.length - tokens - 1)
            found += [t.name for t in self._tails_at(node, len(node.edge), seq, tokens, most)]
            child = node.children.get(blocks[at: at + SYMBOL]) if node.children and at < len(blocks) else None
            if child is None:
                return found
            n = _common(child.edge, blocks, at)
            if n < len(child.edge):  # the walk ends inside this edge: a tail may still end it
                start = (at + n) // SYMBOL * BLOCK
                most = min(BLOCK - 1, seq.length - start - 1)
                return found + [t.name for t in self._tails_at(child, n, seq, start, most)]
            node, at = child, at + n

    def _tails_at(self, node: _Node, on_edge: int, seq: Digested, start: int, most: int) -> list[_Node]:
        """Where a walk stopped (`on_edge` bytes down `node`'s edge, token `start` of `seq`): the
        nodes of the stored sequences that end there in a tail of at most `most` tokens that `seq`
        has there, shortest first. A tail is a child of its own at a node, or the last symbol of an
        edge (a merge in `remove` puts it there)."""
        if most <= 0:
            return []
        if on_edge < len(node.edge):
            nxt = node.edge[on_edge:]
            r = nxt[0]
            return [node] if len(nxt) == SYMBOL and 0 < r <= most and seq.tail(start, r) == nxt else []
        found = []
        bits = node.tails & ((2 << most) - 1)
        while bits:
            r = (bits & -bits).bit_length() - 1  # the shortest left
            child = node.children.get(seq.tail(start, r))
            if child is not None:
                found.append(child)
            bits &= bits - 1
        return found

    def _walk(self, symbols: bytes) -> tuple[_Node, int, int]:
        """Follow `symbols` down: the deepest node reached, the bytes of `symbols` matched, and how
        many of them lie on that node's edge (all of it when the match ends at the node)."""
        node, at, on_edge = self._root, 0, 0
        while at < len(symbols) and node.children:
            child = node.children.get(symbols[at: at + SYMBOL])
            if child is None:
                break
            n = _common(child.edge, symbols, at)
            node, at, on_edge = child, at + n, n
            if n < len(child.edge):
                break
        return node, at, on_edge

    def _exact(self, symbols: bytes) -> _Node | None:
        node, matched, on_edge = self._walk(symbols)
        if matched == len(symbols) and on_edge == len(node.edge) and node.name is not None:
            return node
        return None

    # -- writing ------------------------------------------------------------------------------

    def insert(self, seq: Digested, name: str) -> str | None:
        """Store `name` under `seq`; returns the name it replaced (None if there was none)."""
        if name in self._by_name:
            raise ValueError("name already stored")
        symbols = seq.symbols()
        if not symbols:
            raise ValueError("an empty sequence")
        node, at = self._root, 0
        while at < len(symbols):
            head = symbols[at: at + SYMBOL]
            child = node.children.get(head) if node.children else None
            if child is None:  # it leaves every stored one here: one node for the rest
                child = self._attach(node, symbols[at:])
                at = len(symbols)
            else:
                n = _common(child.edge, symbols, at)
                if n < len(child.edge):  # it leaves inside an edge: split it there
                    child = self._split(child, n)
                at += n
            node = child
        previous = node.name
        if previous is not None:
            del self._by_name[previous]
            self._name_bytes -= sys.getsizeof(previous)
        node.name = name
        self._by_name[name] = node
        self._name_bytes += sys.getsizeof(name)
        return previous

    def remove(self, name: str) -> bool:
        """Forget the sequence stored as `name`; False when there is none."""
        node = self._by_name.pop(name, None)
        if node is None:
            return False
        self._name_bytes -= sys.getsizeof(name)
        node.name = None
        # Prune the now-empty tail so the tree never holds dead paths, and merge a node left with
        # one child and no file of its own into that child, so every edge ends where sequences part.
        while node.parent is not None:
            parent = node.parent
            if node.name is not None:
                break
            if not node.children:
                self._detach(node)  # the parent lost a child: look at it next
                node = parent
                continue
            if len(node.children) == 1:
                (only,) = node.children.values()
                only.edge, only.parent = node.edge + only.edge, parent  # the edge bytes move, not go
                parent.children[node.edge[:SYMBOL]] = only
                node.children = node.parent = None
                self._nodes -= 1
                self._dicts -= 1
            break
        return True

    def clear(self) -> list[str]:
        """Drop everything; returns the names."""
        names = list(self._by_name)
        self.__init__()
        return names

    def _attach(self, parent: _Node, edge: bytes) -> _Node:
        child = _Node(edge, parent)
        if parent.children is None:
            parent.children = {}
            self._dicts += 1
        parent.children[edge[:SYMBOL]] = child
        if edge[0]:  # a tail symbol: it is the whole edge
            parent.tails |= 1 << edge[0]
        self._nodes += 1
        self._edge_bytes += len(edge)
        return child

    def _detach(self, node: _Node) -> None:
        """Unhook `node` (and count it out) from its parent."""
        parent = node.parent
        del parent.children[node.edge[:SYMBOL]]
        if node.edge[0]:
            parent.tails &= ~(1 << node.edge[0])
        if not parent.children:
            parent.children = None
            self._dicts -= 1
        self._nodes -= 1
        self._edge_bytes -= len(node.edge)

    def _split(self, child: _Node, n: int) -> _Node:
        """Put a new node `n` bytes down `child`'s edge, between it and its parent; returns it."""
        parent = child.parent
        self._detach(child)
        mid = self._attach(parent, child.edge[:n])
        child.edge = child.edge[n:]
        child.parent = mid
        mid.children = {child.edge[:SYMBOL]: child}
        if child.edge[0]:
            mid.tails |= 1 << child.edge[0]
        self._dicts += 1
        self._nodes += 1
        self._edge_bytes += len(child.edge)
        return mid


def _common(edge: bytes, symbols: bytes, start: int) -> int:
    """How many leading bytes of `edge` equal `symbols[start:]`, in whole symbols (slices compared
    in C, halving on a miss)."""
    n = min(len(edge), len(symbols) - start)
    if edge[:n] == symbols[start: start + n]:
        return n - n % SYMBOL
    lo, hi = 0, n // SYMBOL  # lo symbols match, hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edge[: mid * SYMBOL] == symbols[start: start + mid * SYMBOL]:
            lo = mid
        else:
            hi = mid
    return lo * SYMBOL


def common_tokens(a: bytes, b: bytes) -> int:
    """How many leading token ids two `token_bytes` strings share (slices compared in C)."""
    n = min(len(a), len(b)) // _TOKEN
    if a[: n * _TOKEN] == b[: n * _TOKEN]:
        return n
    lo, hi = 0, n  # lo tokens match, hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * _TOKEN] == b[: mid * _TOKEN]:
            lo = mid
        else:
            hi = mid
    return lo


__all__ = ["BLOCK", "BlockIndex", "Digested", "Found", "common_tokens", "token_bytes"]
