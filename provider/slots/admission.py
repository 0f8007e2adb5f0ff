"""Fast admission and room planning: synchronous, read-only decisions over a snapshot.

Nothing here awaits, loads, allocates or reserves. The manager copies its state into a
`ManagerView`, samples one `MemorySnapshot`, and calls:

* `decide(...)` → `Admitted | Refused`, the answer before `inference_accepted`;
* `plan_room(...)` → `RoomPlan | Refused`: which idle models to evict, least recently used first, so a
  cold model can load (if evicting every idle model cannot make room, refuse at once and evict
  nothing);
* `plan_kv(...)` → the same for a resident model whose request KV does not fit;
* `pressure_victim(...)` → the pressure watermark (memory/pressure.py): an idle model to evict before
  a load that would run at YELLOW or worse, even though the cap allows it.

Every memory figure comes from `memory/` (`fit`, `CapFigures`); this module only chooses victims and
maps outcomes to `protocol.errors.Failure`, the one vocabulary that becomes a frame.

KV sizing (one function, `kv_need`, used by admission, reservation and capacity reports): the policy
decides *how many tokens* a request may hold (`CapFigures.request_kv`: `max_tokens` defaults to
min(context, 8192), prompt + output clamped to the context window); the model's layout turns those
tokens into the bytes mlx-lm really allocates (`provider.models.kv_bytes_for_tokens`: 256-token
blocks, sliding windows capped), which is never less than `kv_bytes_per_token × tokens` for a
full-attention model, so the reservation covers the real allocation. What a request reserves on a
resident model is its share of the model's padded batch, `batchkv.join_share` (the same function
`ModelManager._reserve_kv` reserves with), read from `SlotView.kv`.

Vision requests (a VLM, `ModelInfo.vision`; memory/media.py is the rule): the KV span is prompt
text + the image soft tokens, clamped to the context, + the output bound (`vision_need`), in its
own cache (no batch share); the projected decode bytes of the images are reserved beside it as
`media`. Media + KV must stay within half the hard cap, must fit now (or after evicting idle
models) like any request's KV, and at most `max_vision_requests` requests with images may run or
wait per model. An image for a model that cannot take one is 415 `unsupported_media`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from memory import (
    MIN_KV_BYTES,
    CapFigures,
    FitResult,
    MemorySnapshot,
    default_max_tokens,
    fit,
    padded_weight_bytes,
    pressure,
)
from memory.media import DEFAULT_MAX_VISION_REQUESTS, VisionSpan, vision_reservation, vision_span
from protocol.errors import ErrorReason, Failure, FailureCode, RejectionReason
from provider.guest.availability import Paused
from provider.models import ALLOC_STEP, ModelInfo, kv_bytes_for_tokens
from provider.slots.batchkv import EMPTY, KvNeed, join_share
from provider.slots.state import ModelState, SlotView

_NO_CONTEXT_OUTPUT = default_max_tokens(2**62)  # the 8192 default when the config names no context


@dataclass(frozen=True, slots=True)
class VisionNeed:
    """What a request to a vision model reserves: its KV span (own cache) and its media."""

    images: int
    span: VisionSpan
    kv_bytes: int
    media_bytes: int  # projected decode bytes (memory.media.projected_decode_bytes)

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.media_bytes

    @property
    def kv(self) -> KvNeed:
        return KvNeed(self.span.tokens, self.span.max_tokens, self.kv_bytes)


@dataclass(frozen=True, slots=True)
class ManagerView:
    """The manager's state at one instant (only models that are not NOT_LOADED are listed)."""

    slots: Mapping[str, SlotView]
    max_model_slots: int
    draining: bool
    outstanding_bytes: int  # Σ ledger reservations, every kind
    request_kv_bytes: int  # the part held by in-flight requests (it frees as they finish)
    prefix_cache_bytes: int = 0  # the part held by the RAM prefix cache, evicted before a refusal
    max_vision_requests: int = DEFAULT_MAX_VISION_REQUESTS  # requests with images per model
    vision_requests: Mapping[str, int] = field(default_factory=dict)  # in serve() now, any state
    batch_size: int = 2**31  # requests one model runs at once (the engine's decode batch)
    paused: Paused | None = None  # the owner's Mac is not serving now (provider/guest)
    broken: frozenset[str] = frozenset()  # models whose failed load is remembered (slots/broken.py)

    @property
    def firm_outstanding_bytes(self) -> int:
        """Reservations that stay put: the prefix cache gives way to requests and loads, so every
        decision here counts its bytes as available (the manager evicts them before it refuses)."""
        return max(0, self.outstanding_bytes - self.prefix_cache_bytes)


@dataclass(frozen=True, slots=True)
class Admitted:
    model_id: str
    kv: KvNeed
    cold: bool  # the model is not resident: a load (and maybe evictions) comes first
    evict: tuple[str, ...] = ()  # idle models to evict first, LRU first
    share: int = 0  # the request's ledger reservation: its share of the model's batch KV
    claim_bytes: int = 0  # > 0: the model is not loaded; its load's claim, booked with the request
    vision: VisionNeed | None = None  # a request to a vision model: `kv` is its span's KV (reserved in serve)


@dataclass(frozen=True, slots=True)
class Refused:
    """A refusal. Turn it into a frame only with `protocol.errors.inference_error_frame(rid, r.failure)`."""

    failure: Failure

    @property
    def status_code(self) -> int:
        return self.failure.status_code

    @property
    def failure_code(self) -> FailureCode:
        return self.failure.code

    @property
    def error_reason(self) -> ErrorReason | None:
        return self.failure.reason

    @property
    def rejection_reason(self) -> RejectionReason | None:
        return self.failure.rejection

    @property
    def available_token_budget(self) -> int | None:
        return self.failure.available_token_budget


Admission = Admitted | Refused


@dataclass(frozen=True, slots=True)
class RoomPlan:
    victims: tuple[str, ...]  # evict these, in order, then the target fits
    fit: FitResult  # the verdict for the target with those victims gone


# --------------------------------------------------------------------------------------------
# KV sizing


def kv_need(figures: CapFigures, info: ModelInfo, prompt_tokens: int, max_tokens: int | None) -> KvNeed:
    """The request's reservation: tokens from the policy, bytes from the model's real layout."""
    prompt = max(0, prompt_tokens)
    context = info.context_length
    if context is None:  # no window to clamp to: the request's own span is the bound
        context = prompt + (_NO_CONTEXT_OUTPUT if max_tokens is None else max(0, max_tokens))
    rk = figures.request_kv(kv_bytes_per_token=info.kv.max_bytes_per_token, prompt_tokens=prompt,
                            context_length=context, max_tokens=max_tokens)
    return KvNeed(rk.tokens, rk.max_tokens, kv_bytes_for_tokens(info.kv, rk.tokens))


def vision_need(figures: CapFigures, info: ModelInfo, prompt_tokens: int, max_tokens: int | None, *,
                images: int = 0, media_bytes: int = 0) -> VisionNeed:
    """A vision model's reservation: span = min(prompt + soft tokens × images, context) + output,
    in the model's real KV layout; media = the projected decode bytes, as given. Prompt text counts
    the text the processor wraps around each image too (`VisionInfo.image_text_tokens`)."""
    soft = info.vision.soft_tokens_per_image if info.vision is not None else None
    wrapper = info.vision.image_text_tokens if info.vision is not None else 0
    span = vision_span(prompt_tokens=prompt_tokens + max(0, images) * wrapper, images=images,
                       soft_tokens_per_image=soft, context_length=info.context_length, max_tokens=max_tokens)
    return VisionNeed(images, span, kv_bytes_for_tokens(info.kv, span.tokens), max(0, media_bytes))


def vision_limit_refusal(figures: CapFigures, need: VisionNeed) -> Refused | None:
    """Media + KV above half the hard cap: bigger than this node serves (another may)."""
    if vision_reservation(figures, media_bytes=need.media_bytes, kv_bytes=need.kv_bytes).within_limit:
        return None
    kv_alone = need.kv_bytes > figures.single_request_limit_bytes
    return Refused(Failure.exceeds_node(RejectionReason.TOKEN_BUDGET if kv_alone else RejectionReason.MEMORY_CAP))


def vision_queue_full() -> Refused:
    return Refused(Failure.capacity(RejectionReason.SLOT_STATE, reason=ErrorReason.QUEUE_FULL))


def tokens_for_bytes(info: ModelInfo, nbytes: int) -> int:
    """Whole 256-token blocks of KV that `nbytes` can hold (the token budget we report)."""
    per_token = max(1, info.kv.max_bytes_per_token)
    return max(0, nbytes) // per_token // ALLOC_STEP * ALLOC_STEP


def model_refusal(figures: CapFigures, snapshot: MemorySnapshot, info: ModelInfo, *, broken: bool) -> Refused | None:
    """What every request for this model is told, whatever else it asks (its prompt, its images, its
    tools), so that one question gets one answer however often and by whichever check it is asked:
    its load failed and is remembered (`model_load_failed`, slots/broken.py), or it can never load
    under the cap here, not even with the least KV beside its weights (`request_exceeds_node`)."""
    if broken:
        return Refused(Failure.model_load_failed())
    if not fit(figures, snapshot, info.weight_bytes, activation_reserve_bytes=info.activation_reserve_bytes).ever_fits:
        return Refused(Failure.exceeds_node(RejectionReason.MEMORY_CAP))
    return None


def exceeds_context(info: ModelInfo, prompt_tokens: int) -> bool:
    """The prompt leaves no room for one output token: no machine can serve it."""
    return info.context_length is not None and prompt_tokens >= info.context_length


# --------------------------------------------------------------------------------------------
# Room plans


def _idle_lru(view: ManagerView, target: str) -> list[SlotView]:
    idle = [s for s in view.slots.values() if s.model_id != target and s.idle]
    return sorted(idle, key=lambda s: (s.last_used, s.model_id))


def _unloading_bytes(view: ManagerView) -> int:
    return sum(s.resident_bytes for s in view.slots.values() if s.state is ModelState.UNLOADING)


def _occupied(view: ManagerView, target: str) -> int:
    """Models that hold (or will hold) a slot besides the target; unloading ones are leaving."""
    return sum(1 for s in view.slots.values()
               if s.model_id != target and s.state in (ModelState.LOADING, ModelState.LOADED))


def plan_room(view: ManagerView, figures: CapFigures, snapshot: MemorySnapshot, *, target: str,
              weight_bytes_on_disk: int, extra_kv_bytes: int = 0,
              activation_reserve_bytes: int | None = None) -> RoomPlan | Refused:
    """The shortest LRU prefix of idle models whose eviction lets `target` load.

    Needs `padded weights + A + MIN_KV (+ extra_kv_bytes)` of room under the cap and a free slot, A the
    reserve in force once the target's own (`activation_reserve_bytes`) is in it (`CapFigures.reserve_for`).
    Refuses without evicting anything when even evicting every idle model would not do:
    `exceeds_node(memory_cap)` if it could never fit on this machine, `slot_state` if only the
    slot cap stands in the way, `memory_cap` otherwise.
    """
    candidates = _idle_lru(view, target)
    leaving = _unloading_bytes(view)
    occupied = _occupied(view, target)
    memory_ok_somewhere = False
    result = None
    for k in range(len(candidates) + 1):
        victims = candidates[:k]
        result = fit(figures, snapshot, weight_bytes_on_disk,
                     evictable_bytes=leaving + sum(v.resident_bytes for v in victims),
                     outstanding_bytes=view.firm_outstanding_bytes, activation_reserve_bytes=activation_reserve_bytes)
        memory_ok = result.required_bytes + max(0, extra_kv_bytes) <= result.room_after_eviction_bytes
        slot_ok = occupied - k < view.max_model_slots
        if memory_ok and slot_ok:
            return RoomPlan(tuple(v.model_id for v in victims), result)
        memory_ok_somewhere |= memory_ok
    assert result is not None
    if result.required_bytes + max(0, extra_kv_bytes) > figures.effective_cap_bytes:
        return Refused(Failure.exceeds_node(RejectionReason.MEMORY_CAP))
    if memory_ok_somewhere:
        return Refused(Failure.capacity(RejectionReason.SLOT_STATE))
    return Refused(Failure.capacity(RejectionReason.MEMORY_CAP))


def pressure_victim(view: ManagerView, snapshot: MemorySnapshot, *, target: str, incoming_bytes: int) -> str | None:
    """Eviction's second signal, after the cap: projected memory pressure (memory/pressure.py). When the
    load would put projected utilization at YELLOW or worse, the least recently used idle model to evict
    first (one at a time, re-checking after each); None when pressure is GREEN or nothing is idle. The
    cap plan alone decides refusals."""
    if not pressure(snapshot, incoming_bytes=incoming_bytes).evict_before_load:
        return None
    idle = _idle_lru(view, target)
    return idle[0].model_id if idle else None


def _available_after(view: ManagerView, figures: CapFigures, snapshot: MemorySnapshot,
                     evictable_bytes: int, outstanding_bytes: int) -> int:
    room = fit(figures, snapshot, 0, evictable_bytes=evictable_bytes,
               outstanding_bytes=outstanding_bytes).room_after_eviction_bytes
    return max(0, room - figures.activation_reserve_bytes)  # = CapFigures.available_bytes after eviction


def plan_kv(view: ManagerView, figures: CapFigures, snapshot: MemorySnapshot, *, target: str,
            kv_bytes: int) -> RoomPlan | None:
    """Idle models (LRU first) to evict so `kv_bytes` of request KV fits beside resident `target`;
    None when evicting every idle model would not be enough."""
    candidates = _idle_lru(view, target)
    leaving = _unloading_bytes(view)
    for k in range(len(candidates) + 1):
        victims = candidates[:k]
        evictable = leaving + sum(v.resident_bytes for v in victims)
        if kv_bytes <= _available_after(view, figures, snapshot, evictable, view.firm_outstanding_bytes):
            verdict = fit(figures, snapshot, 0, evictable_bytes=evictable, outstanding_bytes=view.firm_outstanding_bytes)
            return RoomPlan(tuple(v.model_id for v in victims), verdict)
    return None


def kv_refusal(view: ManagerView, figures: CapFigures, snapshot: MemorySnapshot, info: ModelInfo,
               kv: KvNeed) -> Refused:
    """Why a resident model cannot take this request's KV now.

    `token_budget` when the in-flight requests' reservations are what stands in the way (it frees
    as they finish); `kv_headroom` when memory itself is short even with none of them.
    `available_token_budget` is what would fit right now.
    """
    now = figures.available_bytes(snapshot, view.firm_outstanding_bytes)
    budget = tokens_for_bytes(info, now)
    everything_idle = _unloading_bytes(view) + sum(s.resident_bytes for s in _idle_lru(view, info.id))
    without_requests = _available_after(view, figures, snapshot, everything_idle,
                                        max(0, view.firm_outstanding_bytes - view.request_kv_bytes))
    if kv.nbytes <= without_requests:
        return Refused(Failure.capacity(RejectionReason.TOKEN_BUDGET, reason=ErrorReason.TOKEN_BUDGET_EXHAUSTED,
                                        available_token_budget=budget))
    return Refused(Failure.capacity(RejectionReason.KV_HEADROOM, available_token_budget=budget))


# --------------------------------------------------------------------------------------------
# The decision


def decide(view: ManagerView, figures: CapFigures, snapshot: MemorySnapshot, *, model_id: str,
           info: ModelInfo | None, prompt_tokens: int, max_tokens: int | None, images: int = 0,
           media_bytes: int = 0) -> Admission:
    """Accept or refuse one request. Pure: same inputs, same answer.

    What an `Admitted` says is exactly what `ModelManager.book` then reserves in the ledger, in the
    same step: the request's share of its model's batch KV (`share`) and, for a model that is not
    resident, the load's claim (`claim_bytes`). Everything already booked — requests waiting for a
    load included — is in `view` (their reservations, the loading model's claim), so a storm on a
    cold model is refused here, before the accept, once the room is spoken for.

    * at most `view.batch_size` requests per model (the engine's decode batch): a request beyond
      it would be accepted and then wait without tokens (503 queue_full);
    * resident (or loading, claim held): the share must fit what is available — for a loading
      model, the part of its claim kept for KV (`SlotView.claim_kv_bytes`, MIN_KV less what its
      requests already reserved) becomes this request's first, so the two are not counted twice;
    * not resident: the load must fit with `max(MIN_KV, share)` of KV beside the weights (evicting
      idle models, LRU first, if needed); the claim is then `weights_est + MIN_KV − min(share, MIN_KV)`;
    * a model whose failed load is remembered, or that can never load under the cap here, is
      refused before anything the request asks is looked at (`model_refusal`);
    * a model being unloaded right now is refused (503 slot_state): another provider serves it
      sooner than this one reloads it;
    * while the owner's Mac is paused (`view.paused`: outside its serving windows, in use, on
      battery, hot — provider/guest), every request is refused first: 503 ``draining`` with
      ``feasible_after_ms`` = the seconds until it serves again (capped).

    `images` / `media_bytes`: the request's image count and projected decode bytes; a vision model's
    requests are decided by `_decide_vision` (their KV and media are reserved when served).
    """
    if view.draining:
        return Refused(Failure.draining())
    if view.paused is not None:
        return Refused(Failure.paused(view.paused.retry_hint_s))
    if info is None:
        return Refused(Failure.model_unavailable())
    refused = model_refusal(figures, snapshot, info, broken=model_id in view.broken)
    if refused is not None:
        return refused
    if images and not info.is_vision:
        return Refused(Failure.unsupported_media())
    if exceeds_context(info, prompt_tokens):
        return Refused(Failure.request_exceeds_context())
    if info.is_vision:
        return _decide_vision(view, figures, snapshot, model_id, info,
                              vision_need(figures, info, prompt_tokens, max_tokens, images=images,
                                          media_bytes=media_bytes))
    kv = kv_need(figures, info, prompt_tokens, max_tokens)
    if kv.nbytes > figures.single_request_limit_bytes:
        return Refused(Failure.exceeds_node(RejectionReason.TOKEN_BUDGET))

    slot = view.slots.get(model_id)
    state = slot.state if slot is not None else ModelState.NOT_LOADED
    batch = slot.kv if slot is not None else EMPTY
    if batch.members >= view.batch_size:
        return Refused(Failure.capacity(RejectionReason.SLOT_STATE, reason=ErrorReason.QUEUE_FULL))
    share = join_share(info.kv, kv.tokens, kv.nbytes, batch)  # the batch's padding, as reserved
    if share > figures.single_request_limit_bytes:  # the ledger would refuse it: in-flight holds it
        return kv_refusal(view, figures, snapshot, info, kv)
    if state is ModelState.UNLOADING:
        return Refused(Failure.capacity(RejectionReason.SLOT_STATE))

    if state in (ModelState.LOADED, ModelState.LOADING):
        assert slot is not None
        need = max(0, share - slot.claim_kv_bytes)
        if need <= figures.available_bytes(snapshot, view.firm_outstanding_bytes):
            return Admitted(model_id, kv, cold=state is ModelState.LOADING, share=share)
        plan = plan_kv(view, figures, snapshot, target=model_id, kv_bytes=need)
        if plan is not None:
            return Admitted(model_id, kv, cold=state is ModelState.LOADING, evict=plan.victims, share=share)
        return kv_refusal(view, figures, snapshot, info, kv)

    room = plan_room(view, figures, snapshot, target=model_id, weight_bytes_on_disk=info.weight_bytes,
                     extra_kv_bytes=max(0, share - MIN_KV_BYTES), activation_reserve_bytes=info.activation_reserve_bytes)
    if isinstance(room, Refused):
        return room
    claim = padded_weight_bytes(info.weight_bytes) + MIN_KV_BYTES - min(share, MIN_KV_BYTES)
    return Admitted(model_id, kv, cold=True, evict=room.victims, share=share, claim_bytes=claim)


def _decide_vision(view: ManagerView, figures: CapFigures, snapshot: MemorySnapshot, model_id: str,
                   info: ModelInfo, need: VisionNeed) -> Admission:
    """A request to a vision model: its own KV span plus its media, no batch share."""
    refused = vision_limit_refusal(figures, need)
    if refused is not None:
        return refused
    if need.images and view.vision_requests.get(model_id, 0) >= view.max_vision_requests:
        return vision_queue_full()
    slot = view.slots.get(model_id)
    state = slot.state if slot is not None else ModelState.NOT_LOADED
    if state is ModelState.LOADING:
        return Admitted(model_id, need.kv, cold=True, vision=need)
    if state is ModelState.LOADED:
        if need.total_bytes <= figures.available_bytes(snapshot, view.firm_outstanding_bytes):
            return Admitted(model_id, need.kv, cold=False, vision=need)
        plan = plan_kv(view, figures, snapshot, target=model_id, kv_bytes=need.total_bytes)
        if plan is not None:
            return Admitted(model_id, need.kv, cold=False, evict=plan.victims, vision=need)
        return kv_refusal(view, figures, snapshot, info, KvNeed(need.span.tokens, need.span.max_tokens,
                                                                need.total_bytes))
    room = plan_room(view, figures, snapshot, target=model_id, weight_bytes_on_disk=info.weight_bytes,
                     extra_kv_bytes=max(0, need.total_bytes - MIN_KV_BYTES))
    if isinstance(room, Refused):
        return room
    return Admitted(model_id, need.kv, cold=True, evict=room.victims, vision=need)
