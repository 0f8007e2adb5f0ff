"""Token ids in, safe text deltas out: incremental detokenisation plus stop strings.

`StopStringFilter` is pure. It holds back the longest tail of the text that could still be the
start of a stop string, so a stop string split across tokens is never half-emitted.
`CompletionText` feeds one request's tokens through mlx-lm's streaming detokenizer (which holds
back incomplete UTF-8 sequences) and then through the filter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Filtered:
    text: str  # safe to emit now
    stopped: bool  # a stop string was found; `text` ends right before it


class StopStringFilter:
    """Cuts a text stream at the earliest-starting occurrence of any stop string.

    A tail that could still grow into a stop string is held back; so is everything after it
    when a shorter stop string matched later in that tail (a longer one starting earlier wins).
    """

    __slots__ = ("_stops", "_held")

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> Filtered:
        if not self._stops:
            return Filtered(text, False)
        buf = self._held + text
        hit = self._earliest_match(buf)
        pending = len(buf) - self._longest_open_suffix(buf)  # where an unfinished match starts
        if hit is not None and hit <= pending:
            self._held = ""
            return Filtered(buf[:hit], True)
        self._held = buf[pending:]
        return Filtered(buf[:pending], False)

    def flush(self) -> Filtered:
        """The held-back tail, once no more text will come (it may still hold a match)."""
        held, self._held = self._held, ""
        hit = self._earliest_match(held)
        return Filtered(held, False) if hit is None else Filtered(held[:hit], True)

    def _earliest_match(self, buf: str) -> int | None:
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _longest_open_suffix(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best


class CompletionText:
    """One request's detokenizer and stop filter. `detokenizer` must be a fresh copy."""

    __slots__ = ("_detok", "_filter")

    def __init__(self, detokenizer, stops: Sequence[str]):
        self._detok = detokenizer
        self._filter = StopStringFilter(stops)

    def add(self, token: int) -> Filtered:
        self._detok.add_token(token)
        return self._filter.feed(self._detok.last_segment)

    def finish(self) -> Filtered:
        """Flush everything held back at the end of the completion."""
        self._detok.finalize()
        out = self._filter.feed(self._detok.last_segment)
        if out.stopped:
            return out
        tail = self._filter.flush()
        return Filtered(out.text + tail.text, tail.stopped)
