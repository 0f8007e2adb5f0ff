"""Serving a vision model's requests: reserve media and KV before any image is decoded.

`ModelManager.serve()` hands a request for a vision model (`ModelInfo.vision`) to
`VisionServer.serve` (handed the manager's shared state, slots/shared.py), which, in this order:

1. holds the place among the model's `max_vision_requests` its booking took (requests with images
   only; admission refuses the next one at once with 503 `queue_full`, so slow consumers cannot
   pin vision reservations), and gives it back when the request ends;
2. waits for (or does) the model load, like any request;
3. reserves, atomically against one snapshot, the request's KV span (`kv:<id>`, kind
   `request_kv`) and the projected decode bytes of its images (`media:<id>`, kind `media`) —
   giving way first to the prefix cache and then evicting idle models, as a request's KV share does;
4. decodes the images off the event loop (`provider.request.media.decode_images`); if the request
   is cancelled meanwhile, the media reservation is released only once the decoding thread has
   finished and its rasters are dropped;
5. yields a `VisionServeSlot`; `submit()` gives the engine the images, the reserved span and both
   release hooks: the engine releases `media` once the vision encoder has run (the rasters and
   the pixel tensor are gone) and the KV when the request ends.

Every exit — finished, cancelled, disconnected, failed, refused — releases both reservations
exactly once (`VisionLeases`: idempotent, thread-safe, engine thread or event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from memory import Ledger, Rejection, ReservationKind
from memory import RejectionReason as LedgerRejection
from protocol.errors import Failure
from provider.engine import ChatRequest, Engine, RequestStream
from provider.metrics import EvictionCause
from provider.request.media import NO_MEDIA, MediaPlan, decode_images
from provider.slots.admission import (
    ManagerView,
    VisionNeed,
    kv_refusal,
    plan_kv,
    vision_limit_refusal,
    vision_need,
)
from provider.slots.batchkv import KvHold
from provider.slots.leases import Booking, SlotRefused
from provider.slots.shared import ManagerState
from provider.slots.state import ModelSlot
from provider.slots.unloading import Unloader


class VisionLeases:
    """One vision request's two ledger reservations, each released exactly once."""

    def __init__(self, ledger: Ledger, slot: ModelSlot, request_id: str) -> None:
        self.request_id = request_id
        self.kv_id = f"kv:{request_id}"
        self.media_id = f"media:{request_id}"
        self._ledger = ledger
        self._slot = slot
        self._lock = threading.Lock()
        self._held: set[str] = set()

    def hold(self, ledger_id: str) -> None:
        with self._lock:
            self._held.add(ledger_id)

    def _release(self, ledger_id: str) -> None:
        with self._lock:
            if ledger_id not in self._held:
                return
            self._held.discard(ledger_id)
        self._ledger.release(ledger_id)

    def release_media(self, _request_id: str | None = None) -> None:
        self._release(self.media_id)

    def release_kv(self, _request_id: str | None = None) -> None:
        self._slot.vision_holds.pop(self.request_id, None)
        self._release(self.kv_id)

    def release_all(self) -> None:
        self.release_media()
        self.release_kv()


class VisionServeSlot:
    """A vision request's place on a loaded model, valid inside `async with manager.serve(...)`."""

    def __init__(self, engine: Engine, slot: ModelSlot, leases: VisionLeases, need: VisionNeed,
                 images: list[Any]) -> None:
        self._engine = engine
        self._leases = leases
        self._images = images
        self.model_id = slot.model_id
        self.request_id = leases.request_id
        self.kv = need.kv
        self.vision = need
        self.loaded = slot.loaded
        self._submitted = False

    def submit(self, request: ChatRequest) -> RequestStream:
        """Start the request with its decoded images; output capped at the reserved span. From
        here on the engine releases the media (after encoding) and the KV (at the end)."""
        if self._submitted:
            raise RuntimeError("a slot serves one request")
        if request.request_id != self.request_id:
            raise ValueError("request_id differs from the one reserved")
        params = request.params
        if params.max_tokens > self.kv.max_tokens > 0:
            params = dataclasses.replace(params, max_tokens=self.kv.max_tokens)
        request = dataclasses.replace(request, params=params, images=tuple(self._images), kv_tokens=self.kv.tokens)
        self._images = []  # the engine owns them now
        stream = self._engine.submit(self.model_id, request, on_released=self._leases.release_kv,
                                     on_media_released=self._leases.release_media)
        self._submitted = True
        return stream

    def _close(self) -> None:
        self._images = []
        if self._submitted:
            self._engine.cancel(self.request_id)  # a no-op once finished; the engine releases
        else:
            self._leases.release_all()  # never reached the engine


class _Decoded:
    """The decoding thread's output, kept where a cancelled caller can still drop it."""

    def __init__(self) -> None:
        self.images: list[Any] = []


def _decode_into(plan: MediaPlan, box: _Decoded) -> None:
    box.images = decode_images(plan)


async def decode_held(plan: MediaPlan, leases: VisionLeases) -> list[Any]:
    """Decode off the loop while the media reservation is held. Cancelled or failed: the media
    reservation is released only after the thread has finished and its rasters are dropped."""
    box = _Decoded()
    future = asyncio.get_running_loop().run_in_executor(None, _decode_into, plan, box)
    try:
        await asyncio.shield(future)
    except BaseException:
        def drop(_: asyncio.Future | None = None) -> None:
            box.images = []
            leases.release_media()

        if future.done():  # it failed: nothing is decoding any more
            drop()
        else:  # cancelled while the thread still decodes: release when it has finished
            future.add_done_callback(drop)
        raise
    images, box.images = box.images, []
    return images


class VisionServer:
    """The model manager's vision path, over its shared state. `view()` and `wait_loaded(slot)` are
    the manager's (what the pure decisions read; the load a request waits for), `unloader` evicts
    idle models for room."""

    def __init__(self, state: ManagerState, unloader: Unloader, *, view: Callable[[], ManagerView],
                 wait_loaded: Callable[[ModelSlot], Awaitable[None]]) -> None:
        self._s = state
        self._unloader = unloader
        self._view = view
        self._wait_loaded = wait_loaded

    @contextlib.asynccontextmanager
    async def serve(self, slot: ModelSlot, request_id: str, prompt_tokens: int, max_tokens: int | None,
                    booking: Booking) -> AsyncIterator[VisionServeSlot]:
        plan = booking.media or NO_MEDIA
        slot.pins += 1
        leases = VisionLeases(self._s.ledger, slot, request_id)
        handle: VisionServeSlot | None = None
        decoding = False
        try:
            await self._wait_loaded(slot)
            need = vision_need(self._s.figures, slot.info, prompt_tokens, max_tokens, images=plan.count,
                               media_bytes=plan.decode_bytes(slot.info.vision.input_pixels))
            refused = vision_limit_refusal(self._s.figures, need)
            if refused is not None:
                raise SlotRefused(refused.failure)
            await self._reserve(slot, leases, need)
            decoding = bool(plan.count)
            images = await decode_held(plan, leases) if plan.count else []
            handle = VisionServeSlot(self._s.engine, slot, leases, need, images)
            yield handle
        finally:
            if handle is not None:
                handle._close()
            else:
                leases.release_kv()
                if not decoding:  # a started decode releases the media itself, once its thread is done
                    leases.release_media()
            slot.pins -= 1
            booking.release()  # its place among the vision requests (no KV booked at admission)
            slot.last_used = self._s.clock()

    async def _reserve(self, slot: ModelSlot, leases: VisionLeases, need: VisionNeed) -> None:
        """Reserve the KV span and the media together against one snapshot (see the module doc)."""
        tried_prefix = False
        while True:
            if self._s.draining:
                raise SlotRefused(Failure.draining())
            snap = self._s.probe.snapshot()
            available = self._s.ledger.available_bytes(snap)
            if need.total_bytes <= available:
                kv = self._s.ledger.reserve(leases.kv_id, ReservationKind.REQUEST_KV, need.kv_bytes, snapshot=snap)
                if isinstance(kv, Rejection):
                    if kv.reason is LedgerRejection.DUPLICATE_ID:
                        raise SlotRefused(Failure.invalid_request())
                    continue  # another reservation took the room meanwhile: replan
                leases.hold(leases.kv_id)
                slot.vision_holds[leases.request_id] = KvHold(need.span.tokens, need.span.max_tokens, need.kv_bytes)
                if not need.media_bytes:
                    return
                got = self._s.ledger.reserve(leases.media_id, ReservationKind.MEDIA, need.media_bytes, snapshot=snap)
                if not isinstance(got, Rejection):
                    leases.hold(leases.media_id)
                    return
                leases.release_kv()
                if got.reason is LedgerRejection.DUPLICATE_ID:
                    raise SlotRefused(Failure.invalid_request())
                continue
            view = self._view()
            if not tried_prefix:  # the prefix cache gives way first, then retry once
                tried_prefix = True
                if self._s.prefix.evict_for(need.total_bytes - available, reason="vision"):
                    continue
            room = plan_kv(view, self._s.figures, snap, target=slot.model_id, kv_bytes=need.total_bytes)
            if room is None or not room.victims:
                total = dataclasses.replace(need.kv, nbytes=need.total_bytes)
                raise SlotRefused(kv_refusal(view, self._s.figures, snap, slot.info, total).failure)
            async with self._s.room_lock:
                await self._unloader.evict_if_idle(room.victims[0], EvictionCause.LRU)

