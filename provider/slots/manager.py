"""The model manager: loads and unloads models without crossing the cap, and serves requests.

Decide synchronously, then do I/O: every decision (admit, what to evict, whether a load may claim
memory) is a pure function in `admission.py` over a `ManagerView` and one snapshot; this module
performs the loads, unloads and settles that follow, on the engine thread or in `to_thread`.

MLX's buffer cache counts as used (memory/snapshot.py) but never costs a request or a model: when a
decision would refuse or evict while the cache holds bytes, it is taken again on the snapshot as it
will be once the cache is cleared, and the clear is done first — queued on the engine thread by a
booking (ahead of that request's load and KV, `Engine.request_reclaim`), awaited by a load's
pressure step, a warm-up plan and the idle reaper's prefix relief.

Load, in this order (memory-policy.md §5), inside one single-flight task per model:
  1. sample memory; plan: `required = padded weights + A + MIN_KV`; if short, check first that
     evicting every idle model could reach it (refuse if not), then evict the LRU idle model,
     settle, resample, repeat (under `_room_lock`, so two loads never plan on the same bytes);
     then, while the load would run at pressure YELLOW or worse (§8), evict idle models the same way;
  2. atomically claim the pending load in the ledger (same snapshot, no await in between);
  3. load on the engine thread; `mx.clear_cache()`; every await is followed by a re-check;
  4. post-load guard: measured headroom ≥ MIN_KV + other reservations, else unload, clear,
     release, refuse; check the config's KV bytes per token against the engine's real cache and
     keep the larger (§4); only then publish the model as LOADED and attach its prefix cache.
Every failure path (a refusal, an engine error, an injected fault, cancellation) undoes the
engine load if it happened and releases the claim exactly once (`Claim`).

Prefix cache (`prefix_cache=`, kvcache/): its RAM entries are ledger reservations that give way:
when the ledger refuses a request's KV or a load's claim, entries are evicted (LRU) and the
reservation retried once before any refusal; under RED pressure the RAM tier is dropped (before a
load and on each idle-reaper tick). Admission counts those bytes as available (`ManagerView`).

Unload (§6): the engine stops the model (its requests fail, their KV is released from the
engine thread), purge its KV (`kv_purge` hook, the prefix cache's purge by default), gc + `mx.clear_cache()` + glibc `malloc_trim(0)`
(`memory.settle.reclaim`), then the settle barrier; freed bytes and settle time are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from kvcache.manager import KvCacheManager
from memory.diagnostics import RestartAdvice, RestartThresholds
from memory.media import DEFAULT_MAX_VISION_REQUESTS
from memory import (
    GiB,
    CapFigures,
    FitResult,
    Ledger,
    PressureLevel,
    Probe,
    MemorySnapshot,
    Rejection,
    RejectionReason as LedgerRejection,
    ReservationKind,
    after_eviction,
    fit,
    free_for_load_bytes,
    padded_weight_bytes,
    pressure,
    settle,
)
from protocol.errors import ErrorReason, Failure, RejectionReason
from protocol.vocab import SlotState
from provider.engine import Engine, EngineError, EngineFailure, LoadedModelInfo
from provider.metrics import EvictionCause, LoadResult, Metrics
from provider.models import Inventory, ModelInfo
from provider.progress import ProgressFactory
from provider.request.media import NO_MEDIA, MediaPlan
from provider.slots.admission import (
    Admission,
    Admitted,
    ManagerView,
    Refused,
    RoomPlan,
    decide,
    plan_room,
    pressure_victim,
    tokens_for_bytes,
)
from provider.slots.diagnostics import MemoryDiagnostics, UnloadEvent
from provider.slots.capacity import CapacityReport, SlotCapacity, max_concurrency
from provider.slots.leases import Booking, Claim, KvReservation, ServeSlot, SlotRefused, VisionPlace
from provider.slots.prefix import PrefixRoom, WeightHashes, with_measured_kv
from provider.slots.state import ModelSlot, ModelState, log
from provider.slots.vision import VisionServing


@dataclasses.dataclass(frozen=True, slots=True)
class UnloadReport:
    """What one unload freed and how long memory took to settle (also logged as `model_unloaded`)."""

    model_id: str
    cause: EvictionCause
    resident_bytes: int
    freed_bytes: int
    settled: bool
    settle_seconds: float
    total_seconds: float


class LoadStep(enum.Enum):
    """Points in a load where a test may inject a failure (`fault=`)."""

    CLAIMED = "claimed"  # pending load claimed; the engine not yet asked
    ENGINE_LOADING = "engine_loading"  # the engine is loading; its result not yet awaited
    LOADED = "loaded"  # weights resident; before clear_cache and the guard
    GUARD = "guard"  # guard snapshot taken; before its verdict
    GUARD_UNLOAD = "guard_unload"  # the guard refused; before the unload that undoes the load


FaultHook = Callable[[LoadStep, str], Awaitable[None]]
KvPurge = Callable[[str], Awaitable[None]]
# How long an admission waits for KV that cancelled requests are giving back (the engine removes them
# before its next step: in practice one step, tens of milliseconds; the bound covers a slow step).
RELEASE_WAIT_S = 5.0
_PROGRESS_INTERVAL_S = 0.2  # how often a terminal's load progress line is redrawn


class ModelManager(VisionServing):
    """See the package docstring for the API; the module docstring for the load/unload order.
    Requests to a vision model are served by `VisionServing` (slots/vision.py)."""

    def __init__(
        self,
        engine: Engine,
        inventory: Inventory,
        ledger: Ledger,
        figures: CapFigures,
        probe: Probe,
        *,
        max_model_slots: int = 3,
        max_vision_requests: int = DEFAULT_MAX_VISION_REQUESTS,
        idle_timeout_s: float | None = 3600.0,
        load_wait_timeout_s: float = 120.0,
        settle_timeout_s: float = 5.0,
        kv_purge: KvPurge | None = None,
        prefix_cache: KvCacheManager | None = None,
        weight_hash: WeightHashes | None = None,
        clock: Callable[[], float] = time.monotonic,
        restart_thresholds: RestartThresholds | None = None,
        metrics: Metrics | None = None,
        eos_token_ids: Mapping[str, frozenset[int]] | None = None,
        fault: FaultHook | None = None,
        progress: ProgressFactory | None = None,
    ) -> None:
        if figures != ledger.figures:
            raise ValueError("figures must be the ledger's own (one cap, one source)")
        if max_model_slots < 1:
            raise ValueError("max_model_slots must be >= 1")
        self._engine = engine
        self._inventory = inventory
        self._ledger = ledger
        self._probe = probe
        self._max_slots = max_model_slots
        if max_vision_requests < 1:
            raise ValueError("max_vision_requests must be >= 1")
        self._max_vision = max_vision_requests
        self._idle_timeout_s = idle_timeout_s if idle_timeout_s else None  # 0 / None = never
        self._load_wait_s = load_wait_timeout_s
        self._settle_s = settle_timeout_s
        self._prefix = PrefixRoom(prefix_cache, weight_hash)
        self._kv_purge = kv_purge if kv_purge is not None or prefix_cache is None else self._prefix.purge
        self._clock = clock
        self._metrics = metrics
        self._eos = dict(eos_token_ids or {})
        self._fault = fault
        self._progress = progress
        self._slots: dict[str, ModelSlot] = {m.id: ModelSlot(m) for m in inventory.models}
        self._room_lock = asyncio.Lock()
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._releasing: set[str] = set()  # cancelled in the engine, KV not yet released
        self._release_waiters: list[asyncio.Future[None]] = []
        self._topups = 0
        self.last_unload: UnloadReport | None = None  # the most recent unload's figures
        self.baseline_listeners: list[Callable[[], None]] = []  # called on the loop after each baseline sample
        self.diagnostics = MemoryDiagnostics(lambda: self._ledger.figures, restart_thresholds or RestartThresholds(),
                                             wall_clock=time.time)
        self._kept_warm: set[str] = set()  # preloaded: the idle reaper leaves them resident
        self.on_capacity_change: Callable[[], None] | None = None  # called on the loop after a publish/unload

    @classmethod
    def from_settings(cls, settings, engine: Engine, inventory: Inventory, ledger: Ledger, probe: Probe,
                      **kwargs) -> ModelManager:
        """Build from `provider.config.Settings` (slots, idle timeout, load wait, settle timeout)."""
        return cls(engine, inventory, ledger, ledger.figures, probe,
                   max_model_slots=settings.max_model_slots, max_vision_requests=settings.max_vision_requests,
                   idle_timeout_s=settings.idle_timeout_s,
                   load_wait_timeout_s=settings.load_wait_timeout_s,
                   settle_timeout_s=settings.settle_timeout_s,
                   restart_thresholds=RestartThresholds(drift_fraction=settings.restart_drift_fraction,
                                                        drift_bytes=int(settings.restart_drift_gb * GiB),
                                                        failed_settles=settings.restart_failed_settles),
                   **kwargs)

    @property
    def figures(self) -> CapFigures:
        return self._ledger.figures

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    def context_length(self, model_id: str) -> int | None:
        slot = self._slots.get(model_id)
        return slot.info.context_length if slot is not None else None

    def state(self, model_id: str) -> ModelState:
        slot = self._slots.get(model_id)
        return slot.state if slot is not None else ModelState.NOT_LOADED

    # -- fast admission (synchronous, read-only) ------------------------------------------------

    def view(self) -> ManagerView:
        """The state the pure decisions read, copied now."""
        by_kind = self._ledger.snapshot().bytes_by_kind
        slots = {s.model_id: s.view(self._engine.stats(s.model_id))
                 for s in self._slots.values() if s.state is not ModelState.NOT_LOADED}
        return ManagerView(slots, self._max_slots, self._draining, sum(by_kind.values()),
                           by_kind[ReservationKind.REQUEST_KV],
                           self._prefix.evictable_bytes(by_kind[ReservationKind.PREFIX_CACHE]),
                           self._max_vision,
                           {s.model_id: s.vision_requests for s in self._slots.values() if s.vision_requests},
                           batch_size=self._engine.batch_size)

    def max_concurrency(self, model_id: str) -> int:
        """Requests one model runs at once: the engine's decode batch (admission's ceiling)."""
        return self._engine.batch_size

    @property
    def prefix_cache(self) -> KvCacheManager | None:
        return self._prefix.cache

    def info(self, model_id: str) -> ModelInfo | None:
        """The model's info as the manager sizes it (KV per token checked after its last load)."""
        slot = self._slots.get(model_id)
        return slot.info if slot is not None else None

    def admit(self, model_id: str, prompt_tokens: int, max_tokens: int | None = None, *,
              media: MediaPlan | None = None) -> Admission:
        """Would this request be admitted now? Read-only: no load, no reservation, no allocation
        (callers use it with a lower bound on the prompt, before counting it exactly).
        `media`: the request's checked images (their count and projected decode bytes)."""
        slot = self._slots.get(model_id)
        plan = media or NO_MEDIA
        info = slot.info if slot is not None else None
        media_bytes = plan.decode_bytes(info.vision.input_pixels if info is not None and info.vision else 0)
        view, snap = self.view(), self._probe.snapshot()
        verdict = decide(view, self.figures, snap, model_id=model_id, info=info, prompt_tokens=prompt_tokens,
                         max_tokens=max_tokens, images=plan.count, media_bytes=media_bytes)
        if _gives_way(verdict, snap):  # a booking would clear MLX's buffer cache first: judge as then
            verdict = decide(view, self.figures, snap.after_reclaim(), model_id=model_id, info=info,
                             prompt_tokens=prompt_tokens, max_tokens=max_tokens, images=plan.count,
                             media_bytes=media_bytes)
        return verdict

    def precheck(self, model_id: str, prompt_tokens: int, max_tokens: int | None = None) -> Failure | None:
        """The refusal a request of at least `prompt_tokens` would get now, before it is counted
        exactly (the intake's size bound); None when it may be admitted, or when only room that
        cancelled requests are about to give back stands in the way (`book_when_released` waits)."""
        decision = self.admit(model_id, prompt_tokens, max_tokens)
        if not isinstance(decision, Refused):
            return None
        if self._releasing and _room_refusal(decision.failure):
            return None
        return decision.failure

    # -- booking: admission that reserves (before inference_accepted) ---------------------------

    def book(self, request_id: str, model_id: str, prompt_tokens: int,
             max_tokens: int | None = None, *, media: MediaPlan | None = None) -> Booking | Refused:
        """Admit and reserve in one synchronous step: the request's KV share and, for a model that
        is not resident, its load's claim (the load starts now); idle victims start unloading now.
        What is booked is in the ledger before the next request is decided, so concurrent
        admissions never promise the same bytes twice. Release with `Booking.release()` unless it
        is handed to `serve(booking=...)`."""
        slot = self._slots.get(model_id)
        if slot is not None and slot.info.is_vision:  # KV and media reserved in `_serve_vision` (slots/vision.py)
            checked = self.admit(model_id, prompt_tokens, max_tokens, media=media)
            if isinstance(checked, Refused):
                return checked
            place = VisionPlace(slot) if media is not None and media.count else None  # checked just now
            return Booking(model_id, checked.kv, None, media=media, place=place)
        if media is not None and media.count:
            return Refused(Failure.unsupported_media())
        snap, view = self._probe.snapshot(), self.view()
        info = slot.info if slot is not None else None
        decision = decide(view, self.figures, snap, model_id=model_id, info=info, prompt_tokens=prompt_tokens,
                          max_tokens=max_tokens)
        if _gives_way(decision, snap):
            # MLX's buffer cache goes before a refusal or an eviction (memory/snapshot.py). The clear is
            # queued on the engine thread now, ahead of this request's load and KV allocations.
            self._engine.request_reclaim()
            snap = snap.after_reclaim()
            decision = decide(view, self.figures, snap, model_id=model_id, info=info, prompt_tokens=prompt_tokens,
                              max_tokens=max_tokens)
        if isinstance(decision, Refused):
            return decision
        assert slot is not None
        for victim in decision.evict:
            self._start_unload(self._slots[victim], EvictionCause.LRU)
        leaving = [s for s in self._slots.values() if s.state is ModelState.UNLOADING and s.unload_task is not None]
        # Memory committed to leave (idle models unloading now) counts as free for this booking;
        # its KV is allocated only after those unloads end (`Booking.waits`, awaited in serve).
        booked_on = after_eviction(snap, sum(s.resident_bytes for s in leaving)) if leaving else snap
        if decision.claim_bytes > 0 and not self._book_load(slot, decision, snapshot=booked_on):
            return Refused(Failure.capacity(RejectionReason.MEMORY_CAP))
        reservation = KvReservation(self._ledger, slot, request_id, decision.kv, on_release=self._released)
        failure = self._reserve_share(slot, reservation, decision, booked_on)
        if failure is not None:  # a load booked just now goes on: the model then idles, LRU-evictable
            return Refused(failure)
        return Booking(model_id, decision.kv, reservation, tuple(s.unload_task for s in leaving))

    async def book_when_released(self, request_id: str, model_id: str, prompt_tokens: int,
                                 max_tokens: int | None = None, *, media: MediaPlan | None = None,
                                 wait_s: float = RELEASE_WAIT_S) -> Booking | Refused:
        """`book`, but a refusal for room that cancelled requests are about to give back (the engine
        removes them before its next step) waits for those releases first, up to `wait_s`: after
        a mass disconnect, the next wave is admitted as the first was, never refused for KV that is
        already on its way out. Waits on release events, never on a clock tick."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            result = self.book(request_id, model_id, prompt_tokens, max_tokens, media=media)
            if not isinstance(result, Refused) or not self._releasing or not _room_refusal(result.failure):
                return result
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return result
            waiter = asyncio.get_running_loop().create_future()
            self._release_waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                return result
            finally:
                if waiter in self._release_waiters:
                    self._release_waiters.remove(waiter)

    def _reserve_share(self, slot: ModelSlot, reservation: KvReservation, decision: Admitted,
                       snapshot: MemorySnapshot) -> Failure | None:
        """Reserve the request's share through the model's book (a loading model's claim gives its
        KV part first); the prefix cache gives way once if the ledger is short."""
        info, kv = slot.info, decision.kv
        for attempt in range(2):
            claim = slot.claim
            donor, gift = (claim.id, claim.kv_bytes) if claim is not None and claim.held else (None, 0)
            result, share = slot.kv_book.reserve(self._ledger, info.kv, reservation.request_id, reservation.ledger_id,
                                                 kv.tokens, kv.max_tokens, kv.nbytes, snapshot=snapshot,
                                                 donor=donor, donated=gift)
            if not isinstance(result, Rejection):
                if claim is not None and donor is not None:
                    claim.gave(min(gift, share))
                reservation.nbytes = share
                return None
            if result.reason is LedgerRejection.DUPLICATE_ID:
                return Failure.invalid_request()
            if attempt == 0 and self._prefix.evict_for(share - result.available_bytes, reason="request_kv"):
                continue
            break
        return Failure.capacity(RejectionReason.KV_HEADROOM)

    def _book_load(self, slot: ModelSlot, decision: Admitted | None, *, snapshot: MemorySnapshot) -> bool:
        """Claim the load (padded weights + what MIN_KV its first request does not cover) and start
        it: LOADING from now on, so the next admission sees the claim and waits for this load."""
        claim = Claim(self._ledger, slot.model_id)
        weights = padded_weight_bytes(slot.info.weight_bytes)
        kv_part = (decision.claim_bytes - weights) if decision is not None else self.figures.min_kv_bytes
        for attempt in range(2):
            if claim.take(weights, kv_part, snapshot=snapshot):
                break
            if attempt == 0 and self._prefix.evict_for(weights + kv_part, reason="load"):
                continue
            return False
        slot.claim = claim
        slot.state = ModelState.LOADING
        slot.load_task = asyncio.create_task(self._load(slot), name=f"load:{slot.model_id}")
        return True

    def _released(self, request_id: str) -> None:
        """A request's KV went back to the ledger (any thread): wake admissions waiting for room."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._wake_waiters, request_id)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _wake_waiters(self, request_id: str) -> None:
        self._releasing.discard(request_id)
        waiters, self._release_waiters = self._release_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _cancelling(self, request_id: str) -> None:
        self._releasing.add(request_id)

    # -- serving ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serve(self, request_id: str, model_id: str, prompt_tokens: int, max_tokens: int | None = None,
                    *, booking: Booking | None = None, media: MediaPlan | None = None) -> AsyncIterator[ServeSlot]:
        """Wait for the model (and for any unload its booking relies on), pin it, yield a `ServeSlot`.

        Without a `booking`, books first (`SlotRefused` when admission refuses). Raises `SlotRefused`
        before yielding when the load fails or takes longer than `load_wait_timeout_s`. The model is
        never evicted while a request is inside. On exit (cancellation included) a submitted
        request is cancelled in the engine, whose release hook frees its KV; an unsubmitted one's
        KV is released here. A vision model's request (with its checked images, `media`) goes
        through `_serve_vision`, which reserves its KV and media there.
        """
        self._loop = asyncio.get_running_loop()
        if booking is None:
            result = self.book(request_id, model_id, prompt_tokens, max_tokens, media=media)
            if isinstance(result, Refused):
                raise SlotRefused(result.failure)
            booking = result
        slot = self._slots[booking.model_id]
        if booking.reservation is None:  # a vision model
            async with self._serve_vision(slot, request_id, prompt_tokens, max_tokens, booking) as vision:
                yield vision
            return
        slot.pins += 1
        handle: ServeSlot | None = None
        try:
            deadline = asyncio.get_running_loop().time() + self._load_wait_s
            for task in booking.waits:
                await self._wait(task, deadline)
            await self._ensure_loaded(slot, deadline)
            handle = ServeSlot(self._engine, slot, booking.reservation, on_cancel=self._cancelling)
            yield handle
        finally:
            if handle is not None:
                handle._close()
            else:
                booking.release()
            slot.pins -= 1
            slot.last_used = self._clock()

    async def ensure_loaded(self, model_id: str) -> LoadedModelInfo:
        """Load a model (or wait for its load) without serving anything; raises `SlotRefused`."""
        self._loop = asyncio.get_running_loop()
        slot = self._slots.get(model_id)
        if slot is None:
            raise SlotRefused(Failure.model_unavailable())
        slot.pins += 1
        try:
            await self._wait_loaded(slot)
            assert slot.loaded is not None
            return slot.loaded
        finally:
            slot.pins -= 1
            slot.last_used = self._clock()

    async def _wait_loaded(self, slot: ModelSlot) -> None:
        """Load the model if no booking did (planning room, evicting and settling as needed), or wait
        for the load under way; up to `load_wait_timeout_s`. Raises `SlotRefused`."""
        deadline = asyncio.get_running_loop().time() + self._load_wait_s
        while slot.state is ModelState.UNLOADING and slot.unload_task is not None:
            await self._wait(slot.unload_task, deadline)
        if slot.state is ModelState.NOT_LOADED:
            if self._draining:
                raise SlotRefused(Failure.draining())
            failure = await self._plan_and_book_load(slot)
            if failure is not None:
                raise SlotRefused(failure)
        await self._ensure_loaded(slot, deadline)

    async def _plan_and_book_load(self, slot: ModelSlot) -> Failure | None:
        """A load nobody's request booked (warm-up): plan room (evicting idle models and settling),
        then book it in one step. None once the load is started (or already under way)."""
        async with self._room_lock:
            while True:
                if slot.state is not ModelState.NOT_LOADED:
                    return None
                if self._draining:
                    return Failure.draining()
                leaving = [s.unload_task for s in self._slots.values()
                           if s.state is ModelState.UNLOADING and s.unload_task is not None]
                if leaving:
                    await asyncio.gather(*(asyncio.shield(t) for t in leaving), return_exceptions=True)
                    continue
                snap = self._probe.snapshot()
                plan = plan_room(self.view(), self.figures, snap, target=slot.model_id,
                                 weight_bytes_on_disk=slot.info.weight_bytes)
                if _gives_way(plan, snap):  # MLX's buffer cache goes first (memory/snapshot.py)
                    await self._engine.reclaim()
                    continue
                if isinstance(plan, Refused):
                    return plan.failure
                if plan.victims:
                    await self._evict_if_idle(plan.victims[0], EvictionCause.LRU)
                    continue
                if not self._book_load(slot, None, snapshot=snap):
                    return Failure.capacity(RejectionReason.MEMORY_CAP)
                return None

    async def _ensure_loaded(self, slot: ModelSlot, deadline: float) -> None:
        """Wait for the load a booking started (or that another request started)."""
        while True:
            match slot.state:
                case ModelState.LOADED:
                    return
                case ModelState.LOADING:
                    assert slot.load_task is not None
                    failure = await self._wait(slot.load_task, deadline)
                    if failure is not None:
                        raise SlotRefused(failure)
                case _:  # the load this request was booked with failed (its failure said so) or was undone
                    raise SlotRefused(Failure.model_load_failed())

    async def _wait(self, task: asyncio.Task, deadline: float):
        """Await a shared load/unload task without cancelling it for the others, up to `deadline`."""
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(asyncio.shield(task), max(0.0, remaining))
        except TimeoutError:
            raise SlotRefused(Failure.admission_timeout()) from None

    # -- loading ------------------------------------------------------------------------------

    async def _load(self, slot: ModelSlot) -> Failure | None:
        """The single-flight load task, started with its claim held (`_book_load`). Returns None
        when published, else the failure to report to the requests that wait for it."""
        model_id = slot.model_id
        claim = slot.claim
        assert claim is not None and claim.held
        load_fut: asyncio.Future[LoadedModelInfo] | None = None
        started = self._clock()
        try:
            async with self._room_lock:
                await self._settle_leaving_and_pressure(slot)
            if self._draining:
                return Failure.draining()
            await self._step(LoadStep.CLAIMED, model_id)
            load_fut = asyncio.ensure_future(
                self._engine.load(model_id, slot.info.path, eos_token_ids=self._eos.get(model_id),
                                  vision=slot.info.is_vision))
            await self._step(LoadStep.ENGINE_LOADING, model_id)
            loaded = await self._await_load(model_id, load_fut)
            if loaded.vision and slot.info.vision is not None:  # what the processor adds per image
                slot.info = dataclasses.replace(slot.info, vision=dataclasses.replace(
                    slot.info.vision, image_text_tokens=loaded.image_text_tokens))
            await self._step(LoadStep.LOADED, model_id)
            if not await self._check_kv_per_token(slot):
                self._count_load(LoadResult.REFUSED)
                return Failure.capacity(RejectionReason.MEMORY_CAP)
            await self._engine.reclaim()  # mx.clear_cache() on the thread that owns MLX
            snap = self._probe.snapshot()
            await self._step(LoadStep.GUARD, model_id)
            if self._draining:
                return Failure.draining()
            # MIN_KV of room beyond every reservation, less the KV its own requests already reserved.
            floor = max(0, self.figures.min_kv_bytes - slot.kv_book.view().reserved_bytes)
            if not self._ledger.load_is_serveable(snap, pending_load_id=claim.id, kv_floor_bytes=floor):
                log.warning("post_load_guard_refused", model=model_id, weights_bytes=loaded.weights_bytes,
                            headroom_bytes=self.figures.live_headroom_bytes(snap),
                            required_bytes=floor + self._ledger.outstanding_bytes(excluding=claim.id))
                self._count_load(LoadResult.REFUSED)
                await self._step(LoadStep.GUARD_UNLOAD, model_id)
                return Failure.capacity(RejectionReason.MEMORY_CAP)
            weight_hash = await self._prefix.attach_hash(model_id)  # cached by the runtime: no re-read
            if self._draining:
                return Failure.draining()
            self._prefix.attach(model_id, weight_hash)  # same step as the publish: no await between
            claim.release()
            slot.claim = None
            slot.loaded = loaded
            slot.last_used = self._clock()
            slot.state = ModelState.LOADED
            self._count_load(LoadResult.LOADED)
            self._resident_set_changed()
            log.info("model_loaded", model=model_id, weights_bytes=loaded.weights_bytes,
                     estimate_bytes=padded_weight_bytes(slot.info.weight_bytes),
                     load_s=round(loaded.load_seconds, 3), total_s=round(self._clock() - started, 3))
            return None
        except EngineError as exc:
            log.warning("model_load_failed", model=model_id, code=exc.code)
            self._count_load(LoadResult.FAILED)
            return Failure.model_load_failed()
        except Exception as exc:  # an edge: a load must always end in a typed failure and a clean slate
            log.error("model_load_failed", model=model_id, exc_type=type(exc).__name__)
            self._count_load(LoadResult.FAILED)
            return Failure.model_load_failed()
        finally:
            if slot.state is ModelState.LOADING:  # anything but a publish: undo, release, forget
                await self._undo_engine_load(model_id, load_fut)
                claim.release()
                slot.claim = None
                slot.state = ModelState.NOT_LOADED

    async def _settle_leaving_and_pressure(self, slot: ModelSlot) -> None:
        """Before the engine allocates: wait until the models the booking counted as leaving have
        settled, and (§8) while the load would run at pressure YELLOW or worse, evict idle models
        one at a time; under RED the RAM prefix tier goes first."""
        estimate = padded_weight_bytes(slot.info.weight_bytes)
        while True:
            leaving = [s.unload_task for s in self._slots.values()
                       if s.state is ModelState.UNLOADING and s.unload_task is not None]
            if leaving:
                await asyncio.gather(*(asyncio.shield(t) for t in leaving), return_exceptions=True)
                continue
            snap = self._probe.snapshot()
            if snap.reclaimable_bytes and pressure(snap, incoming_bytes=estimate).evict_before_load:
                await self._engine.reclaim()  # MLX's buffer cache goes before the prefix tier or a model
                snap = self._probe.snapshot()
            if self._prefix.relieve(pressure(snap, incoming_bytes=estimate).level):
                continue
            victim = pressure_victim(self.view(), snap, target=slot.model_id, incoming_bytes=estimate)
            if victim is None or not await self._evict_if_idle(victim, EvictionCause.PRESSURE):
                return

    async def _check_kv_per_token(self, slot: ModelSlot) -> bool:
        """memory-policy.md §4: the engine's real KV growth vs the config's; keep the larger. The
        requests booked with the load reserved at the estimate: top them up, or fail the load
        (False) when the ledger cannot."""
        try:
            measured = await self._engine.kv_bytes_per_token(slot.model_id)
        except EngineError as exc:  # the config estimate stands
            log.warning("kv_bytes_per_token_unmeasured", model=slot.model_id, code=exc.code)
            return True
        before = slot.info
        slot.info = with_measured_kv(slot.info, measured)
        if slot.info is before:
            return True
        self._topups += 1
        return slot.kv_book.top_up(self._ledger, slot.info.kv, f"kvtopup:{slot.model_id}:{self._topups}")

    async def _await_load(self, model_id: str, load_fut: asyncio.Future[LoadedModelInfo]) -> LoadedModelInfo:
        """The engine's load, with a progress line on a terminal: MLX active-memory growth against
        the padded on-disk estimate (the worker evaluates the weights as it reads them)."""
        if self._progress is None:
            return await asyncio.shield(load_fut)
        expected = padded_weight_bytes(self._slots[model_id].info.weight_bytes)
        before = self._probe.snapshot().mlx_active_bytes
        with self._progress(f"loading {model_id}") as bar:
            while True:
                done, _ = await asyncio.wait({load_fut}, timeout=_PROGRESS_INTERVAL_S)
                if done:
                    bar.update(expected, expected)
                    return load_fut.result()
                bar.update(max(0, self._probe.snapshot().mlx_active_bytes - before), expected)

    async def _undo_engine_load(self, model_id: str, load_fut: asyncio.Future | None) -> None:
        """Make sure nothing of a failed load stays resident. A load the engine already started
        cannot be stopped, so wait for it, then unload what it produced."""
        if load_fut is None:
            return
        if not load_fut.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(load_fut)
        if load_fut.cancelled() or load_fut.exception() is not None:
            return  # the engine cleaned up its own failed load
        try:
            await self._engine.unload(model_id)
        except EngineError as exc:
            if exc.code is not EngineFailure.MODEL_NOT_LOADED:
                log.error("model_unload_failed", model=model_id, code=exc.code)
        await self._engine.reclaim()

    async def _step(self, step: LoadStep, model_id: str) -> None:
        if self._fault is not None:
            await self._fault(step, model_id)

    # -- unloading ----------------------------------------------------------------------------

    async def _evict_if_idle(self, model_id: str, cause: EvictionCause) -> bool:
        """Unload `model_id` if it is still idle now (the plan may be stale after an await)."""
        slot = self._slots[model_id]
        if not slot.view(self._engine.stats(model_id)).idle:
            return False
        await self._unload_slot(slot, cause)
        return True

    def _start_unload(self, slot: ModelSlot, cause: EvictionCause) -> asyncio.Task:
        """UNLOADING from this step on (its memory counts as leaving); the unload runs as a task."""
        slot.state = ModelState.UNLOADING
        slot.unload_task = asyncio.create_task(self._unload(slot, cause), name=f"unload:{slot.model_id}")
        return slot.unload_task

    async def _unload_slot(self, slot: ModelSlot, cause: EvictionCause) -> None:
        await asyncio.shield(self._start_unload(slot, cause))

    async def _unload(self, slot: ModelSlot, cause: EvictionCause) -> None:
        model_id = slot.model_id
        resident = slot.resident_bytes
        started = self._clock()
        active_before = self._probe.snapshot().mlx_active_bytes
        try:
            try:
                await self._engine.unload(model_id)  # fails its requests; their KV is released
            except EngineError as exc:
                if exc.code is not EngineFailure.MODEL_NOT_LOADED:
                    log.error("model_unload_failed", model=model_id, code=exc.code)
            # engine.unload ran gc + mx.clear_cache() + malloc_trim(0) on its thread; a purge drops
            # more buffers (the model's prefix cache), so it is followed by one more round.
            if self._kv_purge is not None:
                try:
                    await self._kv_purge(model_id)
                except Exception as exc:  # an edge: the unload must finish; the startup sweep cleans up
                    log.error("kv_purge_failed", model=model_id, exc_type=type(exc).__name__)
                await self._engine.reclaim()
            result = await asyncio.to_thread(settle, resident_bytes=resident, active_before_bytes=active_before,
                                             timeout_s=self._settle_s, reclaim=self._engine.reclaim_blocking)
        finally:
            slot.loaded = None
            slot.state = ModelState.NOT_LOADED
            self._resident_set_changed()
        report = UnloadReport(model_id, cause, resident, result.freed_bytes, result.settled, result.seconds,
                              self._clock() - started)
        self.last_unload = report
        self.diagnostics.unloaded(UnloadEvent(time.time(), model_id, str(cause), resident, result.freed_bytes,
                                              result.settled, result.seconds))
        if result.settled:
            await self._sample_baseline()
        if self._metrics is not None:
            self._metrics.model_evicted(cause)
            self._metrics.settled(result.seconds)
        log.info("model_unloaded", model=model_id, cause=cause, resident_bytes=resident,
                 freed_bytes=result.freed_bytes, settle_s=round(result.seconds, 3),
                 outcome="settled" if result.settled else "unsettled", total_s=round(report.total_seconds, 3))

    async def unload(self, model_id: str, *, cause: EvictionCause = EvictionCause.IDLE) -> bool:
        """Unload an idle model now. False if it is not loaded or is busy (never evicted then)."""
        async with self._room_lock:
            if model_id not in self._slots or self.state(model_id) is not ModelState.LOADED:
                return False
            return await self._evict_if_idle(model_id, cause)

    def keep_warm(self, model_id: str) -> None:
        """Exempt a model from the idle reaper (a preloaded model). Memory pressure and the slot cap
        can still evict it, as any idle model."""
        self._kept_warm.add(model_id)

    @property
    def kept_warm(self) -> frozenset[str]:
        return frozenset(self._kept_warm)

    async def reap_idle(self) -> list[str]:
        """Unload every model idle for `idle_timeout_s` or more, except those kept warm; returns their ids."""
        snap = self._probe.snapshot()
        if snap.reclaimable_bytes and pressure(snap).level >= PressureLevel.RED:
            await self._engine.reclaim()  # MLX's buffer cache goes before the prefix tier (memory/snapshot.py)
            snap = self._probe.snapshot()
        self._prefix.relieve(pressure(snap).level)
        if self._idle_timeout_s is None:
            return []
        now = self._clock()
        stale = [s.model_id for s in self._slots.values() if s.model_id not in self._kept_warm
                 and s.view(self._engine.stats(s.model_id)).idle and now - s.last_used >= self._idle_timeout_s]
        reaped = []
        async with self._room_lock:
            for model_id in stale:
                slot = self._slots[model_id]
                if self._clock() - slot.last_used >= self._idle_timeout_s and \
                        await self._evict_if_idle(model_id, EvictionCause.IDLE):
                    reaped.append(model_id)
        return reaped

    async def run_idle_reaper(self, interval_s: float | None = None) -> None:
        """Call `reap_idle` periodically until cancelled (a session task); each tick also relieves
        the prefix cache under RED pressure. Returns at once when there is nothing to do."""
        if self._idle_timeout_s is None and not self._prefix.enabled:
            return
        idle = self._idle_timeout_s if self._idle_timeout_s is not None else 240.0  # prefix relief only
        period = interval_s if interval_s is not None else min(60.0, max(1.0, idle / 4))
        while True:
            await asyncio.sleep(period)  # a real period, not synchronisation
            await self.reap_idle()

    def start_draining(self) -> None:
        """Refuse every new request (503 draining) and every new load; in-flight ones continue."""
        if not self._draining:
            self._draining = True
            log.info("slots_draining")

    async def unload_all(self) -> None:
        """Shutdown: drain, let loads in progress finish (and be undone), unload every model.
        Requests still running fail with MODEL_UNLOADED; the engine releases their KV."""
        self.start_draining()
        loading = [s.load_task for s in self._slots.values() if s.load_task is not None and not s.load_task.done()]
        await asyncio.gather(*(asyncio.shield(t) for t in loading), return_exceptions=True)
        async with self._room_lock:
            for slot in self._slots.values():
                if slot.state is ModelState.UNLOADING and slot.unload_task is not None:
                    await asyncio.shield(slot.unload_task)
                if slot.state is ModelState.LOADED:
                    await self._unload_slot(slot, EvictionCause.SHUTDOWN)

    # -- reporting ----------------------------------------------------------------------------

    def resident_bytes(self, model_id: str) -> int:
        slot = self._slots.get(model_id)
        return slot.resident_bytes if slot is not None else 0

    def warm_models(self) -> list[str]:
        return [s.model_id for s in self._slots.values() if s.state is ModelState.LOADED]

    def _evictable_bytes(self, *, also: str | None = None) -> int:
        return sum(s.resident_bytes for s in self._slots.values()
                   if s.view(self._engine.stats(s.model_id)).idle or (also == s.model_id and s.loaded))

    async def _sample_baseline(self) -> None:
        """After a full settle: the no-model baseline. With nothing resident it is MLX's active memory;
        with models still resident, what is left of it once their measured weights, the KV their
        batches hold (read on the engine thread with the active figure, between two steps) and the
        RAM prefix cache are taken out. Skipped while a load is under way (its weights are half in)."""
        if any(s.state in (ModelState.LOADING, ModelState.UNLOADING) for s in self._slots.values()):
            return
        try:
            active, batch_kv = await self._engine.memory_reading()
        except EngineError:
            return
        weights = sum(s.resident_bytes for s in self._slots.values() if s.state is ModelState.LOADED)
        prefix = self._ledger.snapshot().bytes_by_kind[ReservationKind.PREFIX_CACHE]
        snap = self._probe.snapshot()
        baseline = max(0, active - weights - batch_kv - prefix)
        self.diagnostics.sample(dataclasses.replace(snap, mlx_active_bytes=baseline))
        for listener in list(self.baseline_listeners):
            listener()

    def restart_advice(self) -> RestartAdvice:
        """memory.diagnostics' verdict: the baseline's drift against the largest model advertised here."""
        largest = max((v.required_bytes for _, v in self.verdicts() if v.ever_fits), default=0)
        return self.diagnostics.advice(largest)

    def verdicts(self) -> list[tuple[ModelInfo, FitResult]]:
        """Fit verdict per inventory model (register, doctor): could it load here now, or after
        evicting idle models? A resident model is judged as if it were reloaded."""
        snap = self._probe.snapshot()
        outstanding = self.view().firm_outstanding_bytes
        return [(s.info, fit(self.figures, snap, s.info.weight_bytes,
                             evictable_bytes=self._evictable_bytes(also=s.model_id),
                             outstanding_bytes=outstanding))
                for s in self._slots.values()]

    def capacity(self) -> CapacityReport:
        """The heartbeat's `backend_capacity` figures, from one snapshot."""
        snap = self._probe.snapshot()
        figures = self.figures
        ledger = self._ledger.snapshot()
        firm = self.view().firm_outstanding_bytes  # the prefix cache gives way to requests and loads
        available = figures.available_bytes(snap, firm)
        slots = []
        for slot in self._slots.values():
            if slot.state not in (ModelState.LOADED, ModelState.LOADING):
                continue
            stats = self._engine.stats(slot.model_id)
            holds = slot.reservations()
            used = sum(h.tokens for h in holds)
            budget_max = used + tokens_for_bytes(slot.info, available)
            slots.append(SlotCapacity(
                model=slot.model_id,
                state=SlotState.RUNNING if slot.state is ModelState.LOADED else SlotState.RELOADING,
                num_running=stats.num_running if stats else 0,
                num_waiting=stats.num_waiting if stats else 0,
                active_tokens=stats.active_tokens if stats else 0,
                max_tokens_potential=sum(h.max_tokens for h in holds),
                max_concurrency=min(self._engine.batch_size, max_concurrency(budget_max, slot.info.context_length)),
                kv_bytes_per_token=slot.info.kv_bytes_per_token,
                active_token_budget_used=used,
                active_token_budget_max=budget_max,
                model_load_time_ms=round(slot.loaded.load_seconds * 1000) if slot.loaded else None,
            ))
        return CapacityReport(
            slots=tuple(slots), mlx_active_bytes=snap.mlx_active_bytes, mlx_peak_bytes=snap.mlx_peak_bytes,
            mlx_cache_bytes=snap.mlx_cache_bytes, total_memory_bytes=snap.physical_bytes,
            free_for_load_bytes=free_for_load_bytes(figures, snap, evictable_bytes=self._evictable_bytes(),
                                                    outstanding_bytes=firm),
            available_bytes=available, pressure=pressure(snap), ledger=ledger)

    # -- metrics ------------------------------------------------------------------------------

    def _count_load(self, result: LoadResult) -> None:
        if self._metrics is not None:
            self._metrics.model_load(result)

    def _resident_set_changed(self) -> None:
        """A model was published or unloaded: the gauge, and whoever reports capacity (the session
        sends a heartbeat at once rather than letting the coordinator route on a stale one)."""
        if self._metrics is not None:
            self._metrics.set_loaded_models(len(self.warm_models()))
        if self.on_capacity_change is not None:
            self.on_capacity_change()


def _gives_way(decision: Admission | RoomPlan, snapshot: MemorySnapshot) -> bool:
    """The decision would refuse or evict while MLX's buffer cache holds bytes a clear gives back."""
    if not snapshot.reclaimable_bytes:
        return False
    if isinstance(decision, Refused):
        return True
    return bool(decision.evict if isinstance(decision, Admitted) else decision.victims)


def _room_refusal(failure: Failure) -> bool:
    """A refusal that releases of in-flight requests can lift (their KV, their place in the batch)."""
    return failure.rejection in (RejectionReason.TOKEN_BUDGET, RejectionReason.KV_HEADROOM,
                                 RejectionReason.MEMORY_CAP, RejectionReason.SLOT_STATE) \
        and failure.reason is not ErrorReason.REQUEST_EXCEEDS_NODE \
        and failure.reason is not ErrorReason.REQUEST_EXCEEDS_NODE_BUDGET
