"""The local server's requests in flight, and what its drain does to them.

    requests = InFlight()
    requests.begin(rid)                        # a chat request arrived (not refused as draining)
    body, stream = await requests.unless_expired(opened.__aenter__())
    requests.attach(rid, stream)               # from here the drain can end its stream
    ...
    requests.end(rid)                          # its response is over, whichever way

    await requests.wait_idle(timeout_s)        # the drain: True when every request ended in time
    requests.expire()                          # else: each stream's last event becomes Failed(ENGINE_CLOSED)

Expiring costs nothing per token: a stream is ended through the engine (`RequestStream.interrupt`),
whose queue the response is already reading, so the response writes its error event and `[DONE]`
as for any other failure. A request still opening (waiting for admission or its model) is awaited in
the request's own task, not in a task of its own: the expiry cancels that task where it waits, and
`unless_expired` turns that cancellation, and only that one, into `Refused(draining)` (as
`asyncio.timeout` turns its own into `TimeoutError`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from protocol.errors import Failure
from provider.engine import EngineFailure, RequestStream
from provider.local.backend import Refused

T = TypeVar("T")


class InFlight:
    def __init__(self) -> None:
        self._streams: dict[str, RequestStream | None] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._expired = False
        self._opening: dict[asyncio.Task[Any], bool] = {}  # tasks in `unless_expired` -> cancelled by the expiry

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def expired(self) -> bool:
        return self._expired

    def begin(self, request_id: str) -> None:
        self._streams[request_id] = None
        self._idle.clear()

    def attach(self, request_id: str, stream: RequestStream) -> None:
        if request_id in self._streams:
            self._streams[request_id] = stream
            if self.expired:
                stream.interrupt(EngineFailure.ENGINE_CLOSED)

    def end(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    async def unless_expired(self, step: Coroutine[Any, Any, T]) -> T:
        """`step`'s result, awaited in the caller's task, or `Refused(draining)` if the drain runs out
        first (`step` is cancelled where it waits). A cancellation from elsewhere stays one."""
        if self._expired:
            step.close()
            raise Refused(Failure.draining())
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("unless_expired runs in a task")
        self._opening[task] = False
        try:
            return await step
        except asyncio.CancelledError:
            if self._opening.pop(task) and task.uncancel() == 0:  # the expiry's cancellation, and no other
                raise Refused(Failure.draining()) from None
            raise
        finally:
            if self._opening.pop(task, False):
                task.uncancel()  # the step ended otherwise as the expiry cancelled it: that one is spent

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def expire(self) -> int:
        """The drain ran out: end every request now; returns how many were still running."""
        self._expired = True
        for task, cancelled in self._opening.items():
            if not cancelled:
                self._opening[task] = True
                task.cancel()
        for stream in self._streams.values():
            if stream is not None:
                stream.interrupt(EngineFailure.ENGINE_CLOSED)
        return len(self._streams)


__all__ = ["InFlight"]
