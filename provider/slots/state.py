"""Per-model lifecycle state: NOT_LOADED → LOADING → LOADED → UNLOADING → NOT_LOADED.

`ModelSlot` is the manager's mutable record of one model (with its load's `Claim` while it
loads); `SlotView` is a frozen copy of what the pure decisions (`admission.py`) read. Assigning
`ModelSlot.state` logs the transition (the websockets `State` setter pattern), and an illegal step
raises `InvalidTransition` naming both states, so the lifecycle can be read as the table
`_ALLOWED` below.

Threads: everything here runs on the event loop, except a request's departure from `kv_book`,
which the engine thread makes through the request's release hook; the book has its own lock.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from memory import Ledger, MemorySnapshot, Rejection
from provider.engine import LoadedModelInfo, ModelStats
from provider.models import ModelInfo
from provider.slots.batchkv import EMPTY, BatchKv, KvBook, KvHold
from provider.telemetry import get_logger

log = get_logger("provider.slots")


class GoneReason(enum.StrEnum):
    """Why a discovered model was dropped from the inventory while the agent ran (`ModelManager.forget`)."""

    FOLDER_MISSING = "folder_missing"  # its folder or a weight file was deleted since discovery
    # its chat template passed its time or memory bound on a request (provider/models/template.py)
    CHAT_TEMPLATE_TIMEOUT = "chat_template_timeout"
    CHAT_TEMPLATE_MEMORY = "chat_template_memory"


class ModelState(enum.IntEnum):
    NOT_LOADED = 0
    LOADING = 1  # a single-flight load task owns the model; later requests wait for it
    LOADED = 2  # published: idle or serving (see SlotView.busy)
    UNLOADING = 3  # the engine is dropping it; memory is settling


_ALLOWED: dict[ModelState, frozenset[ModelState]] = {
    ModelState.NOT_LOADED: frozenset({ModelState.LOADING}),
    ModelState.LOADING: frozenset({ModelState.LOADED, ModelState.NOT_LOADED}),
    ModelState.LOADED: frozenset({ModelState.UNLOADING}),
    ModelState.UNLOADING: frozenset({ModelState.NOT_LOADED}),
}


class InvalidTransition(AssertionError):
    """A lifecycle step the table does not allow: a bug in the manager, never an input error."""


@dataclass(frozen=True, slots=True)
class SlotView:
    """What the pure decisions need to know about one model, copied at one instant."""

    model_id: str
    state: ModelState
    busy: bool  # a request is waiting for it, reserved on it, or in its batch
    last_used: float  # clock() of the last request to leave it (LRU order)
    resident_bytes: int  # measured weights (0 unless LOADED / UNLOADING)
    kv: BatchKv = EMPTY  # its in-flight KV as reserved (batchkv.join_share reads it)
    claim_kv_bytes: int = 0  # loading: the part of its load claim still kept for KV (MIN_KV less bookings)

    @property
    def idle(self) -> bool:
        """Evictable: loaded, and nothing in flight or queued."""
        return self.state is ModelState.LOADED and not self.busy


class Claim:
    """A load's pending-load reservation: the padded weights plus the part of MIN_KV its first
    requests do not already reserve (`kv_bytes`, given to later requests as they book). Booked
    together with the request that causes the load; released exactly once, on publish or on any
    failure path, whoever gets there first."""

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


class ModelSlot:
    """The manager's record of one inventory model."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self._state = ModelState.NOT_LOADED
        self.loaded: LoadedModelInfo | None = None
        self.pins = 0  # serve() contexts inside (waiting for the load, or serving)
        self.last_used = 0.0
        self.load_task: asyncio.Task | None = None
        self.unload_task: asyncio.Task | None = None
        self.kv_book = KvBook()  # the in-flight requests' KV reservations (batchkv)
        self.vision_requests = 0  # requests with images inside serve() (capped per model)
        self.vision_holds: dict[str, KvHold] = {}  # a vision model's requests: each its own cache
        self.claim: Claim | None = None  # while LOADING: the load's claim, booked with its first request
        self.load_moved_at = 0.0  # while LOADING: the loop's time of the load's last step (its waiters' clock)

    @property
    def model_id(self) -> str:
        return self.info.id

    @property
    def state(self) -> ModelState:
        return self._state

    @state.setter
    def state(self, new: ModelState) -> None:
        old = self._state
        if new not in _ALLOWED[old]:
            raise InvalidTransition(f"model state {old.name} -> {new.name} is not allowed")
        self._state = new
        log.debug("model_state", model=self.model_id, from_state=old.name.lower(), to_state=new.name.lower())

    @property
    def resident_bytes(self) -> int:
        return self.loaded.weights_bytes if self.loaded is not None else 0

    def load_moved(self) -> None:
        """Its load took a step (on the loop): whoever waits for it waits `load_wait_timeout_s` from now."""
        self.load_moved_at = asyncio.get_running_loop().time()

    # -- KV holds (the book: joins on the loop, departures on the engine thread) ------------

    def reservations(self) -> list[KvHold]:
        return self.kv_book.holds() + list(self.vision_holds.values())

    # -- views ------------------------------------------------------------------------------

    def busy(self, stats: ModelStats | None) -> bool:
        in_batch = stats is not None and (stats.num_running + stats.num_waiting) > 0
        return self.pins > 0 or bool(self.kv_book) or in_batch

    def view(self, stats: ModelStats | None) -> SlotView:
        return SlotView(self.model_id, self._state, self.busy(stats), self.last_used, self.resident_bytes,
                        self.kv_book.view(), self.claim.kv_bytes if self.claim is not None else 0)
