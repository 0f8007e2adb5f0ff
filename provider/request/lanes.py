"""The bulk lane: one dedicated thread for the big request bodies, so they never hold up the small.

A request body that is large (megabytes of prompt, thousands of messages) costs tens of
milliseconds to seconds to decrypt, parse, render and tokenize. Run on the event loop it stalls
every other request; run in asyncio's default pool it competes with file hashing and loads for a
few threads, and every short prompt's `to_thread` hop waits behind it (measured 19–26 ms
per hop under a storm). So short work stays on the loop (see `tokens.INLINE_CHARS`,
`intake.INLINE_BYTES`) and long work goes here: one thread, a short queue. When the queue is full
`run` raises `LaneFull` at once, which the caller turns into a 503 the coordinator reroutes.

The queue is bounded by the work in it, not by how many tasks it holds: it takes `MAX_WAITING`
large tasks behind the one in progress, and a task of `size` characters (or bytes) under
`LARGE_TASK` takes that share of a place. A prompt a little over `tokens.INLINE_CHARS` (a long
system prompt and a short question) costs the thread milliseconds, a body of megabytes up to
seconds: a batch's worth of such prompts arriving together is queued, not refused.

The thread keeps running a task whose caller was cancelled (a thread cannot be interrupted); the
queue slot is given back when the work really ends, and so are the callbacks' resources
(`on_done`), never earlier.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

MAX_WAITING = 16  # large tasks queued behind the one in progress (their memory is in the ledger); more are refused
LARGE_TASK = 64 * 1024  # characters (or bytes) from which a task takes a whole place in the queue: a large body's


class LaneFull(Exception):
    """The bulk lane's queue holds `MAX_WAITING` large tasks' worth of work already."""


def _share(size: int | None) -> int:
    """How much of the queue a task of `size` characters (or bytes) takes; no size: a whole place."""
    return LARGE_TASK if size is None else min(LARGE_TASK, max(1, size))


class BulkLane:
    def __init__(self, *, max_waiting: int = MAX_WAITING, name: str = "request-bulk") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._limit = (1 + max(0, max_waiting)) * LARGE_TASK  # the one in progress and those waiting
        self._busy = 0  # tasks submitted and not yet finished on the thread
        self._load = 0  # their shares (`_share`)

    @property
    def busy(self) -> int:
        return self._busy

    def has_room(self, size: int | None = None) -> bool:
        """Whether a task of `size` characters (or bytes; None: a large one) would be taken now."""
        return self._load + _share(size) <= self._limit

    async def run(self, fn: Callable[..., T], *args: object, on_done: Callable[[], None] | None = None,
                  size: int | None = None) -> T:
        """`fn(*args)` on the lane's thread; `size`: the characters (or bytes) it works on, which
        decide its share of the queue (None: a whole place). `on_done` runs on the loop once the
        thread is done with it, whether or not the caller still waits."""
        share = _share(size)
        if self._load + share > self._limit:
            raise LaneFull()
        loop = asyncio.get_running_loop()
        self._busy += 1
        self._load += share
        context = contextvars.copy_context()  # the request's bound log context, in the thread too
        future = loop.run_in_executor(self._executor, context.run, fn, *args)

        def finished(done: asyncio.Future) -> None:
            self._busy -= 1
            self._load -= share
            if not done.cancelled():
                done.exception()  # retrieved here: a caller that was cancelled will not
            if on_done is not None:
                on_done()

        future.add_done_callback(finished)
        try:
            return await asyncio.shield(future)
        finally:
            # A failure's traceback holds this frame, and the frame `future`, which holds the
            # failure: a cycle that would keep `args` (a request body of megabytes) alive until the
            # next full garbage collection, long after the answer.
            del future

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["LARGE_TASK", "MAX_WAITING", "BulkLane", "LaneFull"]
