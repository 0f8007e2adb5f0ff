"""provider/slots: the model manager — load gate, pending-load claim, post-load guard, LRU and idle
eviction, settle, purge — and fast admission.

Modules:
* `state`     `ModelState` (NOT_LOADED → LOADING → LOADED → UNLOADING), `ModelSlot`, `SlotView`
* `admission` pure decisions over a `ManagerView` + one `MemorySnapshot`: `decide`, `plan_room`,
              `plan_kv`, `kv_need`; results `Admitted` / `Refused(failure: protocol.errors.Failure)`
* `manager`   `ModelManager`, the async shell that performs loads and unloads
* `batchkv`   the batch KV rule: `join_share` (what a request reserves to join a model's padded
              batch), `KvBook` (a model's reservations; departures keep what the rest still needs)
* `capacity`  `CapacityReport` / `SlotCapacity` for heartbeats
* `shared`    `ManagerState`: what the manager and its collaborators share (records, engine, ledger)
* `loading`, `unloading`, `reporting`: the manager's collaborators `Loader`, `Unloader` (and the
              idle reaper), `Reporter` (register, heartbeat and doctor figures)
* `vision`    a vision model's requests: place limit, `kv:` + `media:` reservations before the
              images are decoded, release hooks (`VisionServer`, a collaborator of the manager)
* `broken`    `BrokenModels`: failed loads remembered (reason, folder fingerprint, backoff) so a
              broken folder is loaded once, not once per request

API for the jobs / session code:

    manager = ModelManager(engine, inventory, ledger, ledger.figures, probe,
                           max_model_slots=3, idle_timeout_s=3600, load_wait_timeout_s=120,
                           settle_timeout_s=5, kv_purge=None, clock=time.monotonic,
                           metrics=None, eos_token_ids=None, fault=None)
    manager = ModelManager.from_settings(settings, engine, inventory, ledger, probe, **kw)

    # 1. before inference_accepted: admission that books what it admits (one synchronous step)
    match await manager.book_when_released(request_id, model_id, prompt_tokens, max_tokens):
        case Refused() as r:
            send(protocol.errors.inference_error_frame(request_id, r.failure))   # the only way to a frame
        case Booking() as booking:   # its KV share (and a cold model's load claim) are in the ledger
            send(inference_accepted)
    manager.admit(...) is the read-only form (the intake's size-bound check); manager.book(...) the
    synchronous one without the wait for releases; `booking.release()` if the request ends before
    it is served.

    # 2. serving: waits for the load (and for unloads the booking counted on), pins the model
    try:
        async with manager.serve(request_id, model_id, prompt_tokens, max_tokens, booking=booking) as slot:
            stream = slot.submit(ChatRequest(request_id, messages, params, prompt_ids=ids))
            async for event in stream: ...
    except SlotRefused as exc:       # exc.failure: protocol.errors.Failure
        send(inference_error_frame(request_id, exc.failure))

    `prompt_tokens` come from `provider.request`'s counter (the ids the engine then uses as they are).
    The request reserves its share of the model's left-padded batch (`batchkv.join_share`), which
    can exceed its own tokens' KV. The reservation is released exactly once: by the engine
    (`on_released`, engine thread) once its cache has left the batch, or by the context exit (or
    `Booking.release`) if it never reached the engine. Leaving the block early cancels the engine
    request; admissions refused only for room such cancels are giving back wait for it (the engine's next step; at most
    `RELEASE_WAIT_S`).

    # 3. lifecycle and reporting
    await manager.ensure_loaded(model_id) -> LoadedModelInfo      # warm-up (register / load_model)
    await manager.unload(model_id) -> bool                        # idle models only
    await manager.reap_idle() -> list[str]; await manager.run_idle_reaper()   # idle_timeout
    manager.keep_warm(model_id); manager.kept_warm                # preloaded: the reaper skips them
    manager.start_draining(); await manager.unload_all()          # shutdown
    manager.capacity() -> CapacityReport; manager.warm_models() -> list[str]
    manager.verdicts() -> list[tuple[ModelInfo, FitResult]]       # doctor
    manager.advertised_verdicts()                                 # register / models_update: less the broken
    manager.model_refusal(model_id) -> Failure | None             # what every request for it gets now
    manager.broken(model_id) -> Broken | None; manager.broken_models()   # failed loads remembered (/status)
    manager.state(model_id) -> ModelState; manager.view() -> ManagerView
    manager.last_unload -> UnloadReport | None                    # freed bytes, settle time

Refusals: unknown model → 404 model_unavailable; its failed load remembered → 404 model_unavailable +
model_load (`Failure.model_load_failed`); could never fit → 503 request_exceeds_node + memory_cap (these
two first, whatever else the request asks); cannot fit after evicting every idle model → 503 memory_cap;
slot cap reached with nothing evictable → 503 slot_state; resident (or loading) but KV does not
fit → 503 token_budget (in-flight requests hold it; `available_token_budget` says what fits now)
or kv_headroom (memory itself is short); `max_batch_size` requests on the model already → 503
queue_full; being unloaded → 503 slot_state; draining → 503 draining. An admitted request waits
for its model's load while the load makes progress: up to `load_wait_timeout_s` after its last step
(each part of the weights read, each measurement, each check), then 503 capacity_timeout.
Vision: images for a text model → 415 unsupported_media; media + KV above half the hard cap →
503 request_exceeds_node; more than `max_vision_requests` requests with images on one model →
503 queue_full (slot_state).
"""

from provider.slots.admission import (
    Admission,
    Admitted,
    ManagerView,
    Refused,
    RoomPlan,
    decide,
    kv_need,
    plan_kv,
    plan_room,
    pressure_victim,
)
from provider.slots.batchkv import BatchKv, KvBook, KvHold, KvNeed, join_share
from provider.slots.capacity import CapacityReport, SlotCapacity
from provider.slots.leases import Booking
from provider.slots.manager import LoadStep, ModelManager, ServeSlot, SlotRefused, UnloadReport
from provider.slots.state import GoneReason, InvalidTransition, ModelSlot, ModelState, SlotView

__all__ = [
    "GoneReason",
    "Admission",
    "Admitted",
    "BatchKv",
    "Booking",
    "KvBook",
    "KvHold",
    "CapacityReport",
    "InvalidTransition",
    "KvNeed",
    "LoadStep",
    "ManagerView",
    "ModelManager",
    "ModelSlot",
    "ModelState",
    "Refused",
    "RoomPlan",
    "ServeSlot",
    "SlotCapacity",
    "SlotRefused",
    "SlotView",
    "UnloadReport",
    "decide",
    "join_share",
    "kv_need",
    "plan_kv",
    "plan_room",
    "pressure_victim",
]
