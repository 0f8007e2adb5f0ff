"""The local server's requests in flight, and what its drain does to them (issue 29 item 7).

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
as for any other failure. Only a request still waiting for admission or its model races the
expiry, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from protocol.errors import Failure
from provider.engine import EngineFailure, RequestStream
from provider.local.backend import Refused

T = TypeVar("T")


class InFlight:
    def __init__(self) -> None:
        self._streams: dict[str, RequestStream | None] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._expired = asyncio.Event()

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def expired(self) -> bool:
        return self._expired.is_set()

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

    async def unless_expired(self, step: Awaitable[T]) -> T:
        """`step`'s result, or `Refused(draining)` if the drain runs out first (`step` is cancelled)."""
        task = asyncio.ensure_future(step)
        expiry = asyncio.ensure_future(self._expired.wait())
        try:
            await asyncio.wait({task, expiry}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            expiry.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise Refused(Failure.draining())
        return task.result()

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def expire(self) -> int:
        """The drain ran out: end every request now; returns how many were still running."""
        self._expired.set()
        for stream in self._streams.values():
            if stream is not None:
                stream.interrupt(EngineFailure.ENGINE_CLOSED)
        return len(self._streams)


__all__ = ["InFlight"]
