"""Handing the engine thread's events to the asyncio loops that wait for them.

A step's events go to each loop in one `call_soon_threadsafe` (`flush`). With `stream_interval_s`
set, while more than `STREAM_INTERVAL_MIN_REQUESTS` requests run, the text a request generates after
its first text is held and handed over at most once per interval, a request's held text as one
`TextDelta` (several tokens): on a GPU a step takes a few ms, and the event loop's work per delivered
event (a wake-up, an SSE chunk, a write) competes with the engine thread for the GIL. First tokens,
terminal events (after the request's held text) and every event of a smaller batch go out at once.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

from provider.engine.active import Active
from provider.engine.commands import EventSink
from provider.engine.types import Event, TextDelta

STREAM_INTERVAL_MIN_REQUESTS = 8  # text is held for `stream_interval_s` only while more requests than this run


class Delivery:
    """The outbox of one engine thread. `running()` says how many requests the engine holds."""

    def __init__(self, stream_interval_s: float, running: Callable[[], int]) -> None:
        self._interval = stream_interval_s
        self._running = running
        self._outbox: list[tuple[EventSink, Event]] = []
        self.held: dict[int, tuple[EventSink, TextDelta]] = {}  # id(sink) -> its text not yet handed over
        self._released_at = 0.0

    def emit(self, sink: EventSink, event: Event) -> None:
        self.send_held(sink)  # the text held for this request goes first
        self._outbox.append((sink, event))

    def request_text(self, active: Active, text: str) -> None:
        """A request's newly decoded text, with the log-probabilities of the tokens it is from."""
        if not text:
            return
        if active.answer is not None:
            active.answer.append(text)
        logprobs, active.logprobs = tuple(active.logprobs), []
        self.text(active.sink, TextDelta(text, logprobs) if logprobs else TextDelta(text), first=not active.text_sent)
        active.text_sent = True

    def text(self, sink: EventSink, delta: TextDelta, *, first: bool) -> None:
        """A request's text: at once when it is its first text or nothing is held, else held."""
        if not first and self._holding():
            held = self.held.get(id(sink))
            if held is not None:
                delta = TextDelta(held[1].text + delta.text, held[1].logprobs + delta.logprobs)
            self.held[id(sink)] = (sink, delta)
        else:
            self.emit(sink, delta)

    def send_held(self, sink: EventSink) -> None:
        held = self.held.pop(id(sink), None)
        if held is not None:
            self._outbox.append(held)

    def _holding(self) -> bool:
        """Whether text after a request's first token may wait for the next release."""
        return self._interval > 0 and self._running() > STREAM_INTERVAL_MIN_REQUESTS

    def _release_held(self) -> None:
        now = time.monotonic()
        if self.held and (now - self._released_at >= self._interval or not self._holding()):
            self._outbox.extend(self.held.values())
            self.held.clear()
            self._released_at = now

    def flush(self) -> None:
        self._release_held()
        if not self._outbox:
            return
        by_loop: dict[object, list[tuple[EventSink, Event]]] = defaultdict(list)
        for sink, event in self._outbox:
            by_loop[sink.loop].append((sink, event))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass


def _deliver(items: list[tuple[EventSink, Event]]) -> None:
    for sink, event in items:
        sink.push(event)


__all__ = ["STREAM_INTERVAL_MIN_REQUESTS", "Delivery"]
