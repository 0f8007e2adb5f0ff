"""The manager's reservations and the handle a request gets: each one released exactly once.
(A load's own reservation, `Claim`, lives with the model's record in state.py.)

* `Booking`: what admission reserved for one request (its KV, and the victims' unloads it must
  wait for before its KV may be allocated), from before `inference_accepted` to the engine.
* `VisionPlace`: a request with images' place among its vision model's `max_vision_requests`,
  taken at booking and given back exactly once when the request ends.
* `KvReservation`: one request's share of its model's batch KV (`batchkv.KvBook`). `release` is
  idempotent and thread-safe because two paths may call it: the engine's `on_released` hook (engine
  thread, once the cache has left the batch) and the `serve()` exit (event loop, when the request
  never reached the engine). The book may keep part of it while the rest of the batch needs it.
* `ServeSlot`: what `async with manager.serve(...)` yields.
* `SlotRefused`: `serve()` could not give the request a slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable

from memory import Ledger
from protocol.errors import Failure
from provider.engine import ChatRequest, Engine, RequestStream
from provider.request.media import MediaPlan
from provider.slots.batchkv import KvNeed
from provider.slots.state import ModelSlot


class SlotRefused(Exception):
    """`serve()` could not give the request a slot. `failure` becomes the frame (protocol/errors)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.code.value)
        self.failure = failure


class KvReservation:
    """A request's KV reservation. `release` is idempotent and thread-safe: it is both the engine's
    `on_released` hook (engine thread) and the context manager's fallback (event loop).
    `on_release(request_id)` (any thread) tells the manager, which wakes admissions waiting for it."""

    def __init__(self, ledger: Ledger, slot: ModelSlot, request_id: str, kv: KvNeed,
                 on_release: Callable[[str], None] | None = None) -> None:
        self.ledger_id = f"kv:{request_id}"
        self.request_id = request_id
        self.kv = kv  # the request's own need (tokens cap its output)
        self.nbytes = 0  # its share of the batch, once the book granted it
        self._ledger = ledger
        self._slot = slot
        self._on_release = on_release
        self._lock = threading.Lock()
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self, _request_id: str | None = None) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._slot.kv_book.release(self._ledger, self._slot.info.kv, self.request_id)
        if self._on_release is not None:
            self._on_release(self.request_id)


class VisionPlace:
    """One of a vision model's `max_vision_requests` places; `leave()` is idempotent (event loop)."""

    def __init__(self, slot: ModelSlot) -> None:
        self._slot = slot
        self._held = True
        slot.vision_requests += 1

    def leave(self) -> None:
        if self._held:
            self._held = False
            self._slot.vision_requests -= 1


@dataclasses.dataclass(slots=True)
class Booking:
    """What admission reserved for one request: hand it to `ModelManager.serve(booking=...)`, or
    `release()` it if the request ends before that (idempotent)."""

    model_id: str
    kv: KvNeed  # what admission sized: tokens, output budget, bytes
    reservation: KvReservation | None  # None: a vision model's request, reserved when it is served
    waits: tuple[asyncio.Task, ...] = ()  # unloads to finish before its KV may be allocated
    media: MediaPlan | None = None  # the request's checked images (vision models)
    place: VisionPlace | None = None  # a request with images: its place on the vision model

    def release(self) -> None:
        if self.reservation is not None:
            self.reservation.release()
        if self.place is not None:
            self.place.leave()


class ServeSlot:
    """A request's place on a loaded model, valid inside `async with manager.serve(...)`."""

    def __init__(self, engine: Engine, slot: ModelSlot, reservation: KvReservation,
                 on_cancel: Callable[[str], None] | None = None) -> None:
        self._engine = engine
        self._reservation = reservation
        self._on_cancel = on_cancel
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
            # A no-op once finished; else the engine removes it before its next step and releases
            # the KV from its thread. Until then the manager counts it as releasing (whoever
            # cancelled it: this exit, or the stream's own aclose just before).
            self._engine.cancel(self.request_id)
            if self._on_cancel is not None and not self._reservation.released:
                self._on_cancel(self.request_id)
        else:
            self._reservation.release()  # never reached the engine
