"""The manager's reservations and the handle a request gets: each one released exactly once.

* `Claim`: a load's pending-load reservation (memory-policy.md §4), released on publish or on any
  failure path, whichever comes first.
* `KvReservation`: one request's share of its model's batch KV (`batchkv.KvBook`). `release` is
  idempotent and thread-safe because two paths may call it: the engine's `on_released` hook (engine
  thread, once the cache has left the batch) and the `serve()` exit (event loop, when the request
  never reached the engine). The book may keep part of it while the rest of the batch needs it.
* `ServeSlot`: what `async with manager.serve(...)` yields.
* `SlotRefused`: `serve()` could not give the request a slot.
"""

from __future__ import annotations

import dataclasses
import threading

from memory import Ledger
from protocol.errors import Failure
from provider.engine import ChatRequest, Engine, RequestStream
from provider.slots.admission import KvNeed
from provider.slots.state import ModelSlot


class SlotRefused(Exception):
    """`serve()` could not give the request a slot. `failure` becomes the frame (protocol/errors)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.code.value)
        self.failure = failure


class Claim:
    """The load's pending-load reservation: released exactly once, whoever gets there first."""

    def __init__(self, ledger: Ledger, model_id: str) -> None:
        self.id = f"load:{model_id}"
        self._ledger = ledger
        self.held = False

    def release(self) -> None:
        if self.held:
            self.held = False
            self._ledger.release(self.id)


class KvReservation:
    """A request's KV reservation. `release` is idempotent and thread-safe: it is both the engine's
    `on_released` hook (engine thread) and the context manager's fallback (event loop)."""

    def __init__(self, ledger: Ledger, slot: ModelSlot, request_id: str, kv: KvNeed) -> None:
        self.ledger_id = f"kv:{request_id}"
        self.request_id = request_id
        self.kv = kv  # the request's own need (tokens cap its output)
        self.nbytes = 0  # its share of the batch, once the book granted it
        self._ledger = ledger
        self._slot = slot
        self._lock = threading.Lock()
        self._released = False

    def release(self, _request_id: str | None = None) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._slot.kv_book.release(self._ledger, self._slot.info.kv, self.request_id)


class ServeSlot:
    """A request's place on a loaded model, valid inside `async with manager.serve(...)`."""

    def __init__(self, engine: Engine, slot: ModelSlot, reservation: KvReservation) -> None:
        self._engine = engine
        self._reservation = reservation
        self.model_id = slot.model_id
        self.request_id = reservation.request_id
        self.kv = reservation.kv
        self.loaded = slot.loaded
        self._submitted = False

    def submit(self, request: ChatRequest) -> RequestStream:
        """Start the request. `max_tokens` is capped at what was reserved; from here on the engine
        releases the KV reservation (from its thread) once the request's cache has left the batch."""
        if self._submitted:
            raise RuntimeError("a slot serves one request")
        if request.request_id != self.request_id:
            raise ValueError("request_id differs from the one reserved")
        if request.params.max_tokens > self.kv.max_tokens > 0:
            params = dataclasses.replace(request.params, max_tokens=self.kv.max_tokens)
            request = dataclasses.replace(request, params=params)
        stream = self._engine.submit(self.model_id, request, on_released=self._reservation.release)
        self._submitted = True
        return stream

    def _close(self) -> None:
        if self._submitted:
            self._engine.cancel(self.request_id)  # a no-op once finished; the engine releases
        else:
            self._reservation.release()  # never reached the engine
