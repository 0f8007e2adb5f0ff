"""The manager's reservations and the handle a request gets: each one released exactly once.

* `Claim`: a load's pending-load reservation (memory-policy.md §4): the padded weights plus the
  part of MIN_KV its first requests do not already reserve (`kv_bytes`, given to later requests as
  they book); booked together with the request that causes the load; released on publish or on
  any failure path, whichever comes first.
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

from memory import Ledger, MemorySnapshot, Rejection
from protocol.errors import Failure
from provider.engine import ChatRequest, Engine, RequestStream
from provider.request.media import MediaPlan
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
        self.kv_bytes = 0  # the part of MIN_KV still held for KV (requests' bookings take it over)

    def take(self, weights_bytes: int, kv_bytes: int, *, snapshot: MemorySnapshot | None = None) -> bool:
        result = self._ledger.claim_pending_load(self.id, weights_bytes + kv_bytes, snapshot=snapshot)
        if isinstance(result, Rejection):
            return False
        self.held, self.kv_bytes = True, kv_bytes
        return True

    def gave(self, nbytes: int) -> None:
        """The ledger moved `nbytes` of the KV part to a request's reservation (`Ledger.reserve(donor=)`)."""
        self.kv_bytes = max(0, self.kv_bytes - nbytes)

    def release(self) -> None:
        if self.held:
            self.held = False
            self.kv_bytes = 0
            self._ledger.release(self.id)


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
