"""The bulk lane: one dedicated thread for the big request bodies, so they never hold up the small.

A request body that is large (megabytes of prompt, thousands of messages) costs tens of
milliseconds to seconds to decrypt, parse, render and tokenize. Run on the event loop it stalls
every other request; run in asyncio's default pool it competes with file hashing and loads for a
few threads, and every short prompt's `to_thread` hop waits behind it (measured 19–26 ms
per hop under a storm). So short work stays on the loop (see `tokens.INLINE_CHARS`,
`intake.INLINE_BYTES`) and long work goes here: one thread, a short queue. When the queue is full
`run` raises `LaneFull` at once, which the caller turns into a 503 the coordinator reroutes.

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

MAX_WAITING = 16  # bodies queued behind the one in progress (their memory is in the ledger); more are refused


class LaneFull(Exception):
    """The bulk lane has `MAX_WAITING` bodies queued already."""


class BulkLane:
    def __init__(self, *, max_waiting: int = MAX_WAITING, name: str = "request-bulk") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._limit = 1 + max(0, max_waiting)
        self._busy = 0  # tasks submitted and not yet finished on the thread

    @property
    def busy(self) -> int:
        return self._busy

    def has_room(self) -> bool:
        return self._busy < self._limit

    async def run(self, fn: Callable[..., T], *args: object, on_done: Callable[[], None] | None = None) -> T:
        """`fn(*args)` on the lane's thread. `on_done` runs on the loop once the thread is done
        with it, whether or not the caller still waits."""
        if self._busy >= self._limit:
            raise LaneFull()
        loop = asyncio.get_running_loop()
        self._busy += 1
        context = contextvars.copy_context()  # the request's bound log context, in the thread too
        future = loop.run_in_executor(self._executor, context.run, fn, *args)

        def finished(done: asyncio.Future) -> None:
            self._busy -= 1
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


__all__ = ["MAX_WAITING", "BulkLane", "LaneFull"]
