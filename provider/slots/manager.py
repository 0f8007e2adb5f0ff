"""The model manager: loads and unloads models without crossing the cap, and serves requests.

Decide synchronously, then do I/O: every decision (admit, what to evict, whether a load may claim
memory) is a pure function in `admission.py` over a `ManagerView` and one snapshot; this module
performs the loads, unloads and settles that follow, on the engine thread or in `to_thread`.

MLX's buffer cache counts as used (memory/snapshot.py) but never costs a request or a model: when a
decision would refuse or evict while the cache holds bytes, it is taken again on the snapshot as it
will be once the cache is cleared, and when that averts the refusal or an eviction the clear is done
first — queued on the engine thread by a booking (ahead of that request's load and KV,
`Engine.request_reclaim`), awaited by a load's pressure step, a warm-up plan and the idle reaper's
prefix relief. A refusal no clear lifts (a full batch) queues none.

Admission books what it admits: `book` decides (admission.py) and reserves in the same step the
request's share of its model's batch KV and, for a model that is not resident, the load's claim —
the load task then starts (slots/loading.py) — and starts unloading the idle models the plan evicts
(slots/unloading.py); `serve` waits for those, pins the model and yields the request's slot.

Prefix cache (`prefix_cache=`, kvcache/): each model's RAM tier is a ledger reservation that gives way:
when the ledger refuses a request's KV or a load's claim, entries are evicted (LRU) and the
reservation retried once before any refusal; under RED pressure the RAM tier is dropped (before a
load and on each idle-reaper tick). Admission counts those bytes as available (`ManagerView`).

The manager's parts are collaborators handed the state they share (`ManagerState`, slots/shared.py):
loads are `Loader` (slots/loading.py), unloads and the idle reaper `Unloader` (slots/unloading.py),
figures for register, heartbeats and doctor `Reporter` (slots/reporting.py), a vision model's
requests `VisionServer` (slots/vision.py). The manager keeps admission, booking and serving, and
answers for the others' public calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Mapping

from kvcache.manager import KvCacheManager
from memory import (
    CapFigures,
    FitResult,
    GiB,
    Ledger,
    MemorySnapshot,
    Probe,
    Rejection,
    ReservationKind,
    after_eviction,
    padded_weight_bytes,
)
from memory import (
    RejectionReason as LedgerRejection,
)
from memory.diagnostics import RestartAdvice, RestartThresholds
from memory.media import DEFAULT_MAX_VISION_REQUESTS
from protocol.errors import ErrorReason, Failure, RejectionReason
from provider.engine import Engine, LoadedModelInfo
from provider.guest.availability import Paused
from provider.metrics import EvictionCause, Metrics
from provider.models import Inventory, ModelInfo, on_disk
from provider.models.activation import ActivationStore
from provider.progress import ProgressFactory
from provider.request.media import NO_MEDIA, MediaPlan
from provider.slots.admission import (
    Admission,
    Admitted,
    ManagerView,
    Refused,
    RoomPlan,
    decide,
    model_refusal,
    plan_room,
)
from provider.slots.broken import Broken
from provider.slots.capacity import CapacityReport
from provider.slots.diagnostics import MemoryDiagnostics
from provider.slots.leases import (
    Booking,
    KvReservation,
    ServeSlot,
    SlotRefused,
    VisionPlace,
)
from provider.slots.loading import FaultHook, Loader, LoadStep
from provider.slots.prefix import PrefixRoom, WeightHashes
from provider.slots.rates import RateBook
from provider.slots.reporting import Reporter
from provider.slots.shared import ManagerState
from provider.slots.state import Claim, GoneReason, ModelSlot, ModelState
from provider.slots.unloading import KvPurge, Unloader, UnloadReport
from provider.slots.vision import VisionServer
from provider.telemetry import get_logger

log = get_logger("provider.slots")

# How long an admission waits for KV that cancelled requests are giving back (the engine removes them
# before its next step: in practice one step, tens of milliseconds; the bound covers a slow step).
RELEASE_WAIT_S = 5.0


class ModelManager:
    """See the package docstring for the API. Loads are `Loader` (slots/loading.py), unloads and the
    idle reaper `Unloader` (slots/unloading.py), read-only figures `Reporter` (slots/reporting.py),
    requests to a vision model `VisionServer` (slots/vision.py): collaborators over the state they
    share with the manager (`ManagerState`)."""

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
        activation_store: ActivationStore | None = None,
    ) -> None:
        if figures != ledger.figures:
            raise ValueError("figures must be the ledger's own (one cap, one source)")
        if max_model_slots < 1:
            raise ValueError("max_model_slots must be >= 1")
        if max_vision_requests < 1:
            raise ValueError("max_vision_requests must be >= 1")
        prefix = PrefixRoom(prefix_cache, weight_hash)
        self._s = ManagerState(engine, ledger, probe, prefix, clock, metrics,
                               {m.id: ModelSlot(m) for m in inventory.models}, activation_store=activation_store)
        self._s.sync_activation_reserve()  # nothing loaded: no pass to hold room for
        self._inventory = inventory
        self._max_slots = max_model_slots
        self._max_vision = max_vision_requests
        self._load_wait_s = load_wait_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._releasing: set[str] = set()  # cancelled in the engine, KV not yet released
        self._release_waiters: list[asyncio.Future[None]] = []
        self.diagnostics = MemoryDiagnostics(lambda: self._s.ledger.figures, restart_thresholds or RestartThresholds(),
                                             wall_clock=time.time)
        self.gone: dict[str, GoneReason] = {}  # models dropped from the inventory since start (`forget`)
        self.on_capacity_change: Callable[[], None] | None = None  # called on the loop after a publish/unload
        self.rates = RateBook(clock)  # measured rates per model (heartbeat evidence, quotes)
        self._room: frozenset[str] = frozenset()  # models with room for one more request, last we looked
        self.pause_source: Callable[[], Paused | None] = _never_paused  # provider/guest: asked at every view
        self._unloader = Unloader(
            self._s, self.diagnostics,
            kv_purge=kv_purge if kv_purge is not None or prefix_cache is None else prefix.purge,
            settle_timeout_s=settle_timeout_s,
            idle_timeout_s=idle_timeout_s if idle_timeout_s else None,  # 0 / None = never
            on_resident_change=self._resident_set_changed)
        self._loader = Loader(self._s, self._unloader, self.rates, view=self.view,
                              on_resident_change=self._resident_set_changed, eos_token_ids=eos_token_ids or {},
                              fault=fault, progress=progress)
        self._reporter = Reporter(self._s, self.diagnostics, self.rates, view=self.view)
        self._vision = VisionServer(self._s, self._unloader, view=self.view, wait_loaded=self._wait_loaded)

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
        return self._s.figures

    @property
    def draining(self) -> bool:
        return self._s.draining

    @property
    def ledger(self) -> Ledger:
        return self._s.ledger

    def context_length(self, model_id: str) -> int | None:
        slot = self._s.slots.get(model_id)
        return slot.info.context_length if slot is not None else None

    def state(self, model_id: str) -> ModelState:
        slot = self._s.slots.get(model_id)
        return slot.state if slot is not None else ModelState.NOT_LOADED

    # -- fast admission (synchronous, read-only) ------------------------------------------------

    def view(self) -> ManagerView:
        """The state the pure decisions read, copied now."""
        by_kind = self._s.ledger.snapshot().bytes_by_kind
        slots = {s.model_id: s.view(self._s.engine.stats(s.model_id))
                 for s in self._s.slots.values() if s.state is not ModelState.NOT_LOADED}
        return ManagerView(slots, self._max_slots, self._s.draining, sum(by_kind.values()),
                           by_kind[ReservationKind.REQUEST_KV],
                           self._s.prefix.evictable_bytes(by_kind[ReservationKind.PREFIX_CACHE]),
                           self._max_vision,
                           {s.model_id: s.vision_requests for s in self._s.slots.values() if s.vision_requests},
                           batch_size=self._s.engine.batch_size, paused=self.pause_source(),
                           broken=self._s.broken.holding(s.info for s in self._s.slots.values()
                                                         if s.state is ModelState.NOT_LOADED))

    def max_concurrency(self, model_id: str) -> int:
        """Requests one model runs at once: the engine's decode batch (admission's ceiling)."""
        return self._s.engine.batch_size

    @property
    def prefix_cache(self) -> KvCacheManager | None:
        return self._s.prefix.cache

    def loaded(self, model_id: str) -> LoadedModelInfo | None:
        """What the engine reported at the model's last load (None while it is not loaded)."""
        slot = self._s.slots.get(model_id)
        return slot.loaded if slot is not None and slot.state is ModelState.LOADED else None

    def forget(self, model_id: str, reason: GoneReason) -> None:
        """Drop a model that is not loaded from the inventory for good (its folder went away): it is no
        longer advertised (the next register, `/v1/models`) and requests for it are 404s."""
        slot = self._s.slots.get(model_id)
        if slot is None or slot.state is not ModelState.NOT_LOADED:
            return
        del self._s.slots[model_id]
        self.gone[model_id] = reason
        log.warning("model_gone", model=model_id, reason=reason.value, path=str(slot.info.path))
        self._resident_set_changed()

    def adopt(self, info: ModelInfo) -> None:
        """A model that arrived while running (a verified prefetch): a slot, not loaded."""
        if info.id in self._s.slots:
            return
        self._s.slots[info.id] = ModelSlot(info)
        self.gone.pop(info.id, None)
        log.info("model_adopted", model=info.id)

    def info(self, model_id: str) -> ModelInfo | None:
        """The model's info as the manager sizes it (KV per token checked after its last load)."""
        slot = self._s.slots.get(model_id)
        return slot.info if slot is not None else None

    def admit(self, model_id: str, prompt_tokens: int, max_tokens: int | None = None, *,
              media: MediaPlan | None = None) -> Admission:
        """Would this request be admitted now? Read-only: no load, no reservation, no allocation
        (callers use it with a lower bound on the prompt, before counting it exactly).
        `media`: the request's checked images (their count and projected decode bytes)."""
        slot = self._s.slots.get(model_id)
        plan = media or NO_MEDIA
        info = slot.info if slot is not None else None
        media_bytes = plan.decode_bytes(info.vision.input_pixels if info is not None and info.vision else 0)
        view, snap = self.view(), self._s.probe.recent()
        verdict = decide(view, self.figures, snap, model_id=model_id, info=info, prompt_tokens=prompt_tokens,
                         max_tokens=max_tokens, images=plan.count, media_bytes=media_bytes)
        if _gives_way(verdict, snap):  # a booking would clear MLX's buffer cache first: judge as then
            cleared = decide(view, self.figures, snap.after_reclaim(), model_id=model_id, info=info,
                             prompt_tokens=prompt_tokens, max_tokens=max_tokens, images=plan.count,
                             media_bytes=media_bytes)
            if _clearing_helps(verdict, cleared):
                verdict = cleared
        return self._with_eta(verdict)

    def model_refusal(self, model_id: str) -> Failure | None:
        """The refusal every request for this model gets now, whatever it asks (`admission.model_refusal`:
        its failed load is remembered, or it can never load under the cap here); None otherwise, and for
        a model that is not ours. Read-only and cheap (a stat of the folder of a model marked broken);
        the intake may ask it from the bulk lane's thread."""
        slot = self._s.slots.get(model_id)
        if slot is None:
            return None
        broken = slot.state is ModelState.NOT_LOADED and self._s.broken.holds(slot.info) is not None
        refused = model_refusal(self.figures, self._s.probe.recent(), slot.info, broken=broken)
        return refused.failure if refused is not None else None

    def broken(self, model_id: str) -> Broken | None:
        """The model's failed load while it is remembered (its reason, when it is tried again)."""
        slot = self._s.slots.get(model_id)
        return self._s.broken.holds(slot.info) if slot is not None else None

    def broken_models(self) -> dict[str, dict[str, object]]:
        """`/status`'s `models_broken`: each model whose failed load is remembered, with its reason."""
        return self._s.broken.as_json(s.info for s in self._s.slots.values())

    def precheck(self, model_id: str, prompt_tokens: int, max_tokens: int | None = None, *,
                 queued: bool = False) -> Failure | None:
        """The refusal a request of at least `prompt_tokens` would get now, before it is counted
        exactly (the intake's size bound); None when it may be admitted, or when only room that
        cancelled requests are about to give back (or, `queued`, any request in flight) stands in the
        way (`book_when_released` waits)."""
        decision = self.admit(model_id, prompt_tokens, max_tokens)
        if not isinstance(decision, Refused):
            return None
        if (self._releasing or queued) and _room_refusal(decision.failure):
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
        slot = self._s.slots.get(model_id)
        if slot is not None and slot.state is ModelState.NOT_LOADED and not on_disk(slot.info):
            self.forget(model_id, GoneReason.FOLDER_MISSING)  # deleted since discovery: a load could only fail
            return Refused(Failure.model_unavailable())
        if slot is not None and slot.info.is_vision:  # KV and media reserved when served (slots/vision.py)
            checked = self.admit(model_id, prompt_tokens, max_tokens, media=media)
            if isinstance(checked, Refused):
                return checked
            place = VisionPlace(slot) if media is not None and media.count else None  # checked just now
            return Booking(model_id, checked.kv, None, media=media, place=place)
        if media is not None and media.count:
            return Refused(Failure.unsupported_media())
        snap, view = self._s.probe.recent(), self.view()
        info = slot.info if slot is not None else None
        decision = decide(view, self.figures, snap, model_id=model_id, info=info, prompt_tokens=prompt_tokens,
                          max_tokens=max_tokens)
        if _gives_way(decision, snap):
            # MLX's buffer cache goes before a refusal or an eviction it would avert (memory/snapshot.py).
            # The clear is queued on the engine thread now, ahead of this request's load and KV allocations.
            cleared = decide(view, self.figures, snap.after_reclaim(), model_id=model_id, info=info,
                             prompt_tokens=prompt_tokens, max_tokens=max_tokens)
            if _clearing_helps(decision, cleared):
                self._s.engine.request_reclaim()
                snap, decision = snap.after_reclaim(), cleared
        if isinstance(decision, Refused):
            return self._with_eta(decision)
        assert slot is not None
        for victim in decision.evict:
            self._unloader.start_unload(self._s.slots[victim], EvictionCause.LRU)
        leaving = [s for s in self._s.slots.values() if s.state is ModelState.UNLOADING and s.unload_task is not None]
        # Memory committed to leave (idle models unloading now) counts as free for this booking;
        # its KV is allocated only after those unloads end (`Booking.waits`, awaited in serve).
        booked_on = after_eviction(snap, sum(s.resident_bytes for s in leaving)) if leaving else snap
        if decision.claim_bytes > 0 and not self._book_load(slot, decision, snapshot=booked_on):
            return Refused(Failure.capacity(RejectionReason.MEMORY_CAP))
        reservation = KvReservation(self._s.ledger, slot, request_id, decision.kv, on_release=self._released)
        failure = self._reserve_share(slot, reservation, decision, booked_on)
        if failure is not None:  # a load booked just now goes on: the model then idles, LRU-evictable
            return Refused(failure)
        self._check_room()
        return Booking(model_id, decision.kv, reservation, tuple(s.unload_task for s in leaving))

    async def book_when_released(self, request_id: str, model_id: str, prompt_tokens: int,
                                 max_tokens: int | None = None, *, media: MediaPlan | None = None,
                                 wait_s: float = RELEASE_WAIT_S, queue_s: float = 0.0) -> Booking | Refused:
        """`book`, but a refusal for room that cancelled requests are about to give back (the engine
        removes them before its next step) waits for those releases first, up to `wait_s`: after
        a mass disconnect, the next wave is admitted as the first was, never refused for KV that is
        already on its way out. With `queue_s` (the owner's own server, which has no other node to
        send a client to) a refusal for room waits up to that long for any request in flight to end
        (a chat's next turn beside a full batch), as `mlx_lm.server` queues; the network front keeps
        its fast refusal (0). Waits on release events, never on a clock tick."""
        now = asyncio.get_running_loop().time()
        release_deadline, queue_deadline = now + wait_s, now + queue_s
        while True:
            result = self.book(request_id, model_id, prompt_tokens, max_tokens, media=media)
            if not isinstance(result, Refused) or not _room_refusal(result.failure):
                return result
            deadline = max(release_deadline if self._releasing else 0.0,
                           queue_deadline if queue_s > 0 and self._requests_in_flight() else 0.0)
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
            result, share = slot.kv_book.reserve(self._s.ledger, info.kv, reservation.request_id, reservation.ledger_id,
                                                 kv.tokens, kv.max_tokens, kv.nbytes, snapshot=snapshot,
                                                 donor=donor, donated=gift)
            if not isinstance(result, Rejection):
                if claim is not None and donor is not None:
                    claim.gave(min(gift, share))
                reservation.nbytes = share
                return None
            if result.reason is LedgerRejection.DUPLICATE_ID:
                return Failure.invalid_request()
            if attempt == 0 and self._s.prefix.evict_for(share - result.available_bytes, reason="request_kv"):
                continue
            break
        return Failure.capacity(RejectionReason.KV_HEADROOM)

    def _book_load(self, slot: ModelSlot, decision: Admitted | None, *, snapshot: MemorySnapshot) -> bool:
        """Claim the load (padded weights + what MIN_KV its first request does not cover) and start
        it: LOADING from now on, so the next admission sees the claim and waits for this load."""
        claim = Claim(self._s.ledger, slot.model_id)
        weights = padded_weight_bytes(slot.info.weight_bytes)
        kv_part = (decision.claim_bytes - weights) if decision is not None else self.figures.min_kv_bytes
        for attempt in range(2):
            if claim.take(weights, kv_part, snapshot=snapshot):
                break
            if attempt == 0 and self._s.prefix.evict_for(weights + kv_part, reason="load"):
                continue
            return False
        slot.claim = claim
        slot.state = ModelState.LOADING
        self._s.sync_activation_reserve()  # its passes run from now on (its measuring ones first)
        slot.load_moved()
        slot.load_task = asyncio.create_task(self._loader.load(slot), name=f"load:{slot.model_id}")
        return True

    def _requests_in_flight(self) -> bool:
        """Some request holds a place in a batch: its end will free room (a residue alone will not)."""
        return any(slot.kv_book for slot in self._s.slots.values())

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
        self._check_room()
        waiters, self._release_waiters = self._release_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _with_eta(self, decision: Admission) -> Admission:
        """A refusal that requests in flight will lift gets ``feasible_after_ms``: when the soonest of
        them should end (``kv_headroom`` is memory short even without them: none), at its model's
        measured decode rate, from its output bound less what it has
        had time to make (an upper bound: a request may stop early). None when no rate is known."""
        if not isinstance(decision, Refused) or decision.failure.feasible_after_ms is not None \
                or not _room_refusal(decision.failure) or decision.failure.rejection is RejectionReason.KV_HEADROOM:
            return decision
        now = time.monotonic()
        soonest = None
        for slot in self._s.slots.values():
            rate = self.rates.decode_tps(slot.model_id)
            if rate <= 0:
                continue
            for hold in slot.kv_book.holds():
                left = max(0.0, hold.max_tokens / rate - (now - hold.booked_at))
                soonest = left if soonest is None else min(soonest, left)
        if soonest is None:
            return decision
        return Refused(dataclasses.replace(decision.failure, feasible_after_ms=max(1, round(soonest * 1000))))

    def _check_room(self) -> None:
        """A heartbeat at once when a model goes from room for one more request to none, or back
        the coordinator's view must never say room where admission would refuse."""
        room = self.models_with_room()
        if room != self._room:
            self._room = room
            if self.on_capacity_change is not None:
                self.on_capacity_change()

    def _cancelling(self, request_id: str) -> None:
        self._releasing.add(request_id)

    # -- serving ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serve(self, request_id: str, model_id: str, prompt_tokens: int, max_tokens: int | None = None,
                    *, booking: Booking | None = None, media: MediaPlan | None = None) -> AsyncIterator[ServeSlot]:
        """Wait for the model (and for any unload its booking relies on), pin it, yield a `ServeSlot`.

        Without a `booking`, books first (`SlotRefused` when admission refuses). Raises `SlotRefused`
        before yielding when the load fails, or makes no progress for `load_wait_timeout_s` (`_wait_load`:
        a load that takes its steps keeps its waiters, however long it takes). The model is
        never evicted while a request is inside. On exit (cancellation included) a submitted
        request is cancelled in the engine, whose release hook frees its KV; an unsubmitted one's
        KV is released here. A vision model's request (with its checked images, `media`) goes
        through `VisionServer.serve`, which reserves its KV and media there.
        """
        self._loop = asyncio.get_running_loop()
        if booking is None:
            result = self.book(request_id, model_id, prompt_tokens, max_tokens, media=media)
            if isinstance(result, Refused):
                raise SlotRefused(result.failure)
            booking = result
        slot = self._s.slots[booking.model_id]
        if booking.reservation is None:  # a vision model
            async with self._vision.serve(slot, request_id, prompt_tokens, max_tokens, booking) as vision:
                yield vision
            return
        slot.pins += 1
        handle: ServeSlot | None = None
        try:
            arrived = asyncio.get_running_loop().time()
            for task in booking.waits:
                await self._wait(task, arrived + self._load_wait_s)
            await self._ensure_loaded(slot, arrived)
            handle = ServeSlot(self._s.engine, slot, booking.reservation, on_cancel=self._cancelling)
            yield handle
        finally:
            if handle is not None:
                handle._close()
            else:
                booking.release()
            slot.pins -= 1
            slot.last_used = self._s.clock()

    async def ensure_loaded(self, model_id: str) -> LoadedModelInfo:
        """Load a model (or wait for its load) without serving anything; raises `SlotRefused`."""
        self._loop = asyncio.get_running_loop()
        slot = self._s.slots.get(model_id)
        if slot is None:
            raise SlotRefused(Failure.model_unavailable())
        slot.pins += 1
        try:
            await self._wait_loaded(slot)
            assert slot.loaded is not None
            return slot.loaded
        finally:
            slot.pins -= 1
            slot.last_used = self._s.clock()

    async def _wait_loaded(self, slot: ModelSlot) -> None:
        """Load the model if no booking did (planning room, evicting and settling as needed), or wait
        for the load under way while it makes progress (`_wait_load`). Raises `SlotRefused`."""
        arrived = asyncio.get_running_loop().time()
        while slot.state is ModelState.UNLOADING and slot.unload_task is not None:
            await self._wait(slot.unload_task, arrived + self._load_wait_s)
        if slot.state is ModelState.NOT_LOADED:
            if self._s.draining:
                raise SlotRefused(Failure.draining())
            if self._s.broken.holds(slot.info) is not None:
                raise SlotRefused(Failure.model_load_failed())
            failure = await self._plan_and_book_load(slot)
            if failure is not None:
                raise SlotRefused(failure)
        await self._ensure_loaded(slot, arrived)

    async def _plan_and_book_load(self, slot: ModelSlot) -> Failure | None:
        """A load nobody's request booked (warm-up): plan room (evicting idle models and settling),
        then book it in one step. None once the load is started (or already under way)."""
        async with self._s.room_lock:
            while True:
                if slot.state is not ModelState.NOT_LOADED:
                    return None
                if self._s.draining:
                    return Failure.draining()
                leaving = self._s.leaving()
                if leaving:
                    await asyncio.gather(*(asyncio.shield(t) for t in leaving), return_exceptions=True)
                    continue
                snap = self._s.probe.snapshot()
                plan = plan_room(self.view(), self.figures, snap, target=slot.model_id,
                                 weight_bytes_on_disk=slot.info.weight_bytes,
                                 activation_reserve_bytes=slot.info.activation_reserve_bytes)
                if _gives_way(plan, snap):  # MLX's buffer cache goes first (memory/snapshot.py)
                    await self._s.engine.reclaim()
                    continue
                if isinstance(plan, Refused):
                    return plan.failure
                if plan.victims:
                    await self._unloader.evict_if_idle(plan.victims[0], EvictionCause.LRU)
                    continue
                if not self._book_load(slot, None, snapshot=snap):
                    return Failure.capacity(RejectionReason.MEMORY_CAP)
                return None

    async def _ensure_loaded(self, slot: ModelSlot, arrived: float) -> None:
        """Wait for the load a booking started (or that another request started); `arrived`: the loop's
        time when the waiter came."""
        while True:
            match slot.state:
                case ModelState.LOADED:
                    return
                case ModelState.LOADING:
                    assert slot.load_task is not None
                    failure = await self._wait_load(slot, slot.load_task, arrived)
                    if failure is not None:
                        raise SlotRefused(failure)
                case _:  # the load this request was booked with failed (its failure said so) or was undone
                    failed = self._s.broken.holds(slot.info) is not None
                    raise SlotRefused(Failure.model_load_failed() if failed else Failure.model_unloaded())

    async def _wait_load(self, slot: ModelSlot, task: asyncio.Task, arrived: float) -> Failure | None:
        """Await a shared load task while it makes progress: up to `load_wait_timeout_s` after its last
        step (loading.py: each part of the weights read, each measurement, each check), or after
        `arrived`, whichever is later. A load that stalls refuses its waiters (503 capacity_timeout,
        retryable) and goes on; one that progresses keeps them, however long it takes. The waiter
        wakes at its deadline, never on a tick: a step since then only moves the deadline on."""
        loop = asyncio.get_running_loop()
        while True:
            deadline = max(arrived, slot.load_moved_at) + self._load_wait_s
            if deadline <= loop.time():
                raise SlotRefused(Failure.admission_timeout())
            try:
                return await asyncio.wait_for(asyncio.shield(task), deadline - loop.time())
            except TimeoutError:
                continue  # the load may have moved meanwhile: the next turn decides

    async def _wait(self, task: asyncio.Task, deadline: float):
        """Await a shared unload task without cancelling it for the others, up to `deadline`."""
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(asyncio.shield(task), max(0.0, remaining))
        except TimeoutError:
            raise SlotRefused(Failure.admission_timeout()) from None

    # -- unloads, the idle reaper, shutdown (Unloader) ------------------------------------------

    @property
    def last_unload(self) -> UnloadReport | None:
        """The most recent unload's figures (freed bytes, settle time)."""
        return self._unloader.last_unload

    @property
    def baseline_listeners(self) -> list[Callable[[], None]]:
        """Called on the loop after each no-model baseline sample (append to it)."""
        return self._unloader.baseline_listeners

    async def unload(self, model_id: str, *, cause: EvictionCause = EvictionCause.IDLE) -> bool:
        """Unload an idle model now. False if it is not loaded or is busy (never evicted then)."""
        return await self._unloader.unload(model_id, cause=cause)

    def keep_warm(self, model_id: str) -> None:
        """Exempt a model from the idle reaper (a preloaded model)."""
        self._unloader.keep_warm(model_id)

    @property
    def kept_warm(self) -> frozenset[str]:
        return self._unloader.kept_warm

    async def reap_idle(self) -> list[str]:
        """Unload every model idle for `idle_timeout_s` or more, except those kept warm; returns their ids."""
        return await self._unloader.reap_idle()

    async def run_idle_reaper(self, interval_s: float | None = None) -> None:
        """Call `reap_idle` periodically until cancelled (a session task)."""
        await self._unloader.run_idle_reaper(interval_s)

    def start_draining(self) -> None:
        """Refuse every new request (503 draining) and every new load; in-flight ones continue."""
        self._unloader.start_draining()

    async def unload_all(self) -> None:
        """Shutdown: drain, let loads in progress finish (and be undone), unload every model."""
        await self._unloader.unload_all()

    # -- figures (Reporter) ---------------------------------------------------------------------

    def resident_bytes(self, model_id: str) -> int:
        return self._reporter.resident_bytes(model_id)

    def idle_seconds(self, model_id: str) -> float | None:
        """How long a loaded model has served nothing; None while it is busy or not loaded."""
        return self._reporter.idle_seconds(model_id)

    def warm_models(self) -> list[str]:
        return self._reporter.warm_models()

    def restart_advice(self) -> RestartAdvice:
        return self._reporter.restart_advice()

    def verdicts(self) -> list[tuple[ModelInfo, FitResult]]:
        """Fit verdict per inventory model (register, doctor)."""
        return self._reporter.verdicts()

    def advertised_verdicts(self) -> list[tuple[ModelInfo, FitResult]]:
        """`verdicts()` less the models whose failed load is remembered: what register and
        models_update offer the coordinator (those that can never fit are left out there)."""
        broken = self.view().broken
        return [(m, v) for m, v in self.verdicts() if m.id not in broken]

    def register_rates(self) -> tuple[float, float]:
        """register's (prefill_tps, decode_tps)."""
        return self._reporter.register_rates()

    def models_with_room(self) -> frozenset[str]:
        """Loaded models that could take one more request of one KV block now."""
        return self._reporter.models_with_room()

    def available_tokens(self, model_id: str) -> int:
        """Whole KV blocks of this model the ledger could still give a request now."""
        return self._reporter.available_tokens(model_id)

    def capacity(self) -> CapacityReport:
        """The heartbeat's `backend_capacity` figures, from one snapshot."""
        return self._reporter.capacity()

    # -- metrics ------------------------------------------------------------------------------

    def _resident_set_changed(self) -> None:
        """A model was published or unloaded: the gauge, and whoever reports capacity (the session
        sends a heartbeat at once rather than letting the coordinator route on a stale one)."""
        self._s.probe.invalidate()  # weights came or went: the next decision reads the machine afresh
        self._s.sync_activation_reserve()
        if self._s.metrics is not None:
            self._s.metrics.set_loaded_models(len(self.warm_models()))
        self._room = self.models_with_room()  # this heartbeat reports it: no second one for the same change
        if self.on_capacity_change is not None:
            self.on_capacity_change()


def _gives_way(decision: Admission | RoomPlan, snapshot: MemorySnapshot) -> bool:
    """The decision would refuse or evict while MLX's buffer cache holds bytes a clear gives back."""
    if not snapshot.reclaimable_bytes:
        return False
    if isinstance(decision, Refused):
        return decision.failure.reason is not ErrorReason.DRAINING  # a clear lifts no drain and no pause
    return bool(decision.evict if isinstance(decision, Admitted) else decision.victims)


def _never_paused() -> Paused | None:
    return None


def _clearing_helps(before: Admission, cleared: Admission) -> bool:
    """Judged on the after-clear snapshot, the request is admitted where it was refused, or evicts
    fewer models: then the clear is worth it (a refusal the clear cannot lift, e.g. a full batch,
    queues none)."""
    if isinstance(cleared, Refused):
        return False
    return isinstance(before, Refused) or len(cleared.evict) < len(before.evict)


def _room_refusal(failure: Failure) -> bool:
    """A refusal that releases of in-flight requests can lift (their KV, their place in the batch)."""
    return failure.rejection in (RejectionReason.TOKEN_BUDGET, RejectionReason.KV_HEADROOM,
                                 RejectionReason.MEMORY_CAP, RejectionReason.SLOT_STATE) \
        and failure.reason is not ErrorReason.REQUEST_EXCEEDS_NODE \
        and failure.reason is not ErrorReason.REQUEST_EXCEEDS_NODE_BUDGET


__all__ = ["RELEASE_WAIT_S", "FaultHook", "KvPurge", "LoadStep", "ModelManager", "ServeSlot", "SlotRefused", "UnloadReport"]
