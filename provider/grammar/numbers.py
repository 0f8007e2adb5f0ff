"""Numbers under a grammar, held to what a double carries, so a constrained answer closes.

llguidance's JSON compiler lets a number take digits for ever: `[0-9]+` in every fraction, `[1-9][0-9]*`
in an integer part with no upper bound, any exponent. Random weights, or a real model stuck in a
digit loop, then spend all of `max_tokens` on one number (``"lat": 28.2439029284223276112912…``) and
the answer never closes. Here a constrained output's numbers take at most `MAX_DIGITS` digits in the
mantissa (integer and fraction together; a lone leading ``0`` is not counted) and `MAX_EXPONENT_DIGITS`
in the exponent: what a double carries (17 significant digits, exponents to 308).

How: the output's bytes are watched as they are consumed (`NumberScan`: outside JSON strings, a digit
or ``-`` opens a number, JSON's number syntax continues it, anything else closes it), and while a number
is open, the tokens that would carry it past the bound (a digit past the 17th, the ``.`` that would need
one more, a fourth exponent digit) are taken out of the grammar's mask (`NumberIndex.limit`). Which
tokens those are depends only on where the number is (`NumberState`, some sixty places), so every
place's cut is computed once, with the vocabulary's token table, off the decode step. The grammar itself is unchanged: this only narrows what it allows, so
what comes out is still a sentence of it. Where the grammar allows nothing but more digits (an integer
schema whose minimum has more than 17 digits), the mask is left as the grammar gives it: a schema's own
bounds come first, and bounded integer schemas are already finite in llguidance's compilation.

Pure: numpy on the packed mask rows, no MLX, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

MAX_DIGITS = 17  # a double's significant decimal digits
MAX_EXPONENT_DIGITS = 3  # a double's exponents reach 308

# Where an open number is (JSON's number syntax), named by what was read last.
SIGN, ZERO, INT, DOT, FRAC, E, E_SIGN, EXP = range(1, 9)
_NUMERIC = frozenset(b"0123456789.eE+-")
_DIGITS = frozenset(b"0123456789")


class NumberState(NamedTuple):
    place: int  # SIGN ... EXP
    digits: int = 0  # mantissa digits so far (a lone leading 0 not counted)
    exponent: int = 0  # exponent digits so far


def advance(state: NumberState, byte: int) -> tuple[NumberState | None, bool]:
    """The number after one more byte: (its state, or None when the byte is not part of it; whether the
    byte breaks the bound)."""
    place, digits, exponent = state
    digit = byte in _DIGITS
    if place == SIGN:
        if byte == 0x30:
            return NumberState(ZERO), False
        return (NumberState(INT, 1), False) if digit else (None, False)
    if place in (ZERO, INT):
        if digit and place == INT:
            return NumberState(INT, digits + 1), digits >= MAX_DIGITS
        if byte == 0x2E:  # "."
            return NumberState(DOT, digits), digits >= MAX_DIGITS  # a fraction needs a digit more
        if byte in (0x45, 0x65):  # "E", "e"
            return NumberState(E), False
        return None, False
    if place in (DOT, FRAC):
        if digit:
            return NumberState(FRAC, digits + 1), digits >= MAX_DIGITS
        if place == FRAC and byte in (0x45, 0x65):
            return NumberState(E), False
        return None, False
    if place == E and byte in (0x2B, 0x2D):  # "+", "-"
        return NumberState(E_SIGN), False
    if digit:  # E, E_SIGN, EXP
        return NumberState(EXP, 0, exponent + 1), exponent >= MAX_EXPONENT_DIGITS
    return None, False


def opens(byte: int) -> NumberState | None:
    """The number a byte opens outside a string (None: it opens none)."""
    if byte == 0x2D:
        return NumberState(SIGN)
    if byte == 0x30:
        return NumberState(ZERO)
    return NumberState(INT, 1) if byte in _DIGITS else None


def breaks(state: NumberState, text: bytes) -> bool:
    """Whether `text`, read on from `state`, carries the open number past the bound."""
    for byte in text:
        state, over = advance(state, byte)
        if over:
            return True
        if state is None:
            return False  # the number closed inside the text
    return False


class NumberScan:
    """Where one output is: inside a string, inside a number (and where in it), or neither. Fed the
    bytes of each token consumed, in order."""

    __slots__ = ("_escaped", "_in_string", "number")

    def __init__(self) -> None:
        self._in_string = False
        self._escaped = False
        self.number: NumberState | None = None

    def feed(self, text: bytes) -> None:
        for byte in text:
            if self.number is not None:
                self.number, _ = advance(self.number, byte)
                if self.number is not None:
                    continue
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif byte == 0x5C:  # backslash
                    self._escaped = True
                elif byte == 0x22:  # quote
                    self._in_string = False
            elif byte == 0x22:
                self._in_string = True
            else:
                self.number = opens(byte)


class _Cut(NamedTuple):
    words: np.ndarray  # indexes of the mask words that lose a token
    keep: np.ndarray  # int32, per word: the bits that stay


class NumberIndex:
    """One vocabulary's tokens that can continue a number, and, for every place in a number, the mask
    bits to clear there: all computed when the vocabulary is read, so a step only looks them up.
    Immutable: any thread may read it."""

    __slots__ = ("_cuts",)

    def __init__(self, tokens: Iterable[tuple[int, bytes]]) -> None:
        by_text: dict[bytes, list[int]] = {}
        for token, text in tokens:
            run = _numeric_run(text)
            if run:
                by_text.setdefault(run, []).append(token)
        self._cuts: dict[NumberState, _Cut] = {}
        for state in _places():
            ids = [np.array(ids, dtype=np.int64) for run, ids in by_text.items() if breaks(state, run)]
            if ids:
                self._cuts[state] = _packed_cut(np.concatenate(ids))

    @classmethod
    def of(cls, vocab_size: int, token_bytes: Callable[[int], bytes]) -> NumberIndex:
        """From a vocabulary's spelling (a pass over every token: ~0.1 s for 150k)."""
        return cls((token, token_bytes(token)) for token in range(vocab_size))

    def limit(self, row: np.ndarray, state: NumberState | None) -> None:
        """Clear from the packed mask `row` the tokens that would carry the number open at `state` past
        the bound, unless nothing else would be left."""
        if state is None:
            return
        cut = self._cuts.get(state._replace(digits=min(state.digits, MAX_DIGITS),
                                            exponent=min(state.exponent, MAX_EXPONENT_DIGITS)))
        if cut is None:
            return
        before = row[cut.words]
        row[cut.words] = before & cut.keep
        if not row.any():  # the grammar wants more digits here: its own bounds rule
            row[cut.words] = before


def _places() -> list[NumberState]:
    """Every place in a number where a cut may apply (counts past the bound cut as at it)."""
    return [NumberState(SIGN), NumberState(ZERO), NumberState(E), NumberState(E_SIGN),
            *(NumberState(INT, d) for d in range(1, MAX_DIGITS + 1)),
            *(NumberState(DOT, d) for d in range(MAX_DIGITS)),
            *(NumberState(FRAC, d) for d in range(1, MAX_DIGITS + 1)),
            *(NumberState(EXP, 0, x) for x in range(1, MAX_EXPONENT_DIGITS + 1))]


def _numeric_run(text: bytes) -> bytes:
    """The bytes a token starts with that a number may hold (b"": it cannot continue one)."""
    end = 0
    while end < len(text) and text[end] in _NUMERIC:
        end += 1
    return text[:end]


def _packed_cut(ids: np.ndarray) -> _Cut:
    ids = np.unique(ids)
    words = ids // 32
    bits = np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32))
    starts = np.flatnonzero(np.r_[True, words[1:] != words[:-1]])
    cleared = np.bitwise_or.reduceat(bits, starts)
    return _Cut(words[starts], (~cleared).view(np.int32))


__all__ = ["MAX_DIGITS", "MAX_EXPONENT_DIGITS", "NumberIndex", "NumberScan", "NumberState"]
