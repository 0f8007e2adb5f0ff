"""Compiled grammars (a bounded LRU) and the per-request matcher the engine steps (`Constraint`).

Compiling a grammar against a model's vocabulary (`llguidance.LLMatcher`) builds its lexer and
parser: 1 to 3 ms for a 50-property schema on the tiny models, more for a large vocabulary or a
complex schema (it drops the GIL). Each compiled grammar is kept, keyed by the vocabulary and the
grammar text, and every request gets a copy of it (`deep_copy`, microseconds; copies share the
lexer). The cache holds at most `MAX_ENTRIES` grammars, least recently used out first.

A request's masks are the grammar's, less the tokens that would carry a number past what a double
carries (`numbers`): every constrained answer of a bounded schema closes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from llguidance import LLMatcher

from provider.grammar.formats import GrammarRejected, limits
from provider.grammar.numbers import NumberScan
from provider.grammar.vocab import TokenTable

MAX_ENTRIES = 32


class Constraint:
    """One request's place in its grammar. Stepped on the engine thread (`fill` the next token's mask,
    `consume` the token chosen); `release` gives its memory reservation back (any thread, once)."""

    __slots__ = ("_matcher", "words", "_release", "_lock", "_table", "_scan")

    def __init__(self, matcher: LLMatcher, table: TokenTable, release: Callable[[], None] | None = None) -> None:
        self._matcher = matcher
        self.words = (table.vocab_size + 31) // 32  # int32 words of one packed mask row
        self._release = release
        self._lock = threading.Lock()
        self._table = table
        self._scan = NumberScan()  # where the output is: inside a number, and where in it

    def fill(self, row: np.ndarray) -> None:
        """Write the mask of the tokens allowed next into `row` (contiguous int32, `words` long): bit
        `t % 32` of word `t // 32` is set where token t is allowed. Where the language may end, the
        EOS tokens are allowed; where it must (or after a refused token), only they are. Inside a
        number, not the tokens that would carry it past a double's digits (`numbers`)."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self._table.numbers.limit(row, self._scan.number)

    def consume(self, token: int) -> None:
        """Advance past the token chosen. A token the mask did not allow puts the matcher in its error
        state, where its masks allow nothing but EOS: the request ends there."""
        self._matcher.consume_token(token)
        self._scan.feed(self._table.token_bytes(token))

    @property
    def accepting(self) -> bool:
        """The output so far is a whole sentence of the language."""
        return self._matcher.is_accepting()

    @property
    def failed(self) -> bool:
        return self._matcher.is_error()

    def release(self) -> None:
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release()


class GrammarCache:
    """Compiled grammars by (vocabulary, grammar text), least recently used out first. Thread-safe."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._max = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[TokenTable, str], LLMatcher] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def cached(self, table: TokenTable, grammar: str) -> bool:
        with self._lock:
            return (table, grammar) in self._entries

    def constraint(self, table: TokenTable, grammar: str, release: Callable[[], None] | None = None) -> Constraint:
        """A fresh matcher of `grammar` for one request; compiles on a miss (blocking, up to hundreds of
        ms for a large grammar: call it off the event loop unless `cached`). Raises `GrammarRejected`."""
        key = (table, grammar)
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is not None:
                self._entries.move_to_end(key)
                self.hits += 1
        if compiled is None:
            compiled = LLMatcher(table.tokenizer, grammar, log_level=0, limits=limits())
            if compiled.is_error():
                raise GrammarRejected()
            with self._lock:
                self.misses += 1
                self._entries[key] = compiled
                self._entries.move_to_end(key)
                while len(self._entries) > self._max:
                    self._entries.popitem(last=False)
        return Constraint(compiled.deep_copy(), table, release)


__all__ = ["MAX_ENTRIES", "Constraint", "GrammarCache"]
