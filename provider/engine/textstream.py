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
    __slots__ = ("_stops", "_held")

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> Filtered:
        if not self._stops:
            return Filtered(text, False)
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return Filtered(buf[: min(hits)], True)
        keep = self._longest_stop_prefix_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return Filtered(buf[: len(buf) - keep], False)

    def flush(self) -> str:
        """The held-back tail, once no more text will come."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
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
        return Filtered(out.text + self._filter.flush(), False)
