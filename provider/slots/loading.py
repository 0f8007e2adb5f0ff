"""Loading a model: `Loader`, the model manager's load task (handed the manager's shared state,
slots/shared.py).

A load starts with its claim already held: admission books it together with the request that
causes it (`ModelManager.book` / `_book_load`), or the warm-up path plans room and books it
(`_plan_and_book_load`). The task then, in this order:

  1. waits until the models the booking counted as leaving have settled, and while the load would
     run at pressure YELLOW or worse (memory/pressure.py) evicts idle models one at a time (RED: the
     RAM prefix tier first);
  2. loads on the engine thread (`mx.clear_cache()` after), every await followed by a re-check; an
     Ollama model not imported yet is imported first, on a worker thread (provider/importing.py);
  3. checks the config's KV bytes per token against the engine's real cache and keeps the larger
     (each request's KV is reserved as its tokens × that figure), topping up what the requests booked
     with it reserved; takes the activation reserve the engine measured over the load's passes as the
     model's own (memory/activation.py: the reserve in force follows at once, and the measurement is
     kept in the state dir once the model is published, for the next start and `doctor`);
  4. post-load guard: measured headroom ≥ the KV floor (MIN_KV less what its own requests reserved)
     + every other reservation, else unload, release, refuse; only then publishes the model as
     LOADED and attaches its prefix cache.

A load that fails for the model's own sake (the engine refused its folder, its import failed, an
error of the load path that the folder explains) is remembered (`BrokenModels`, slots/broken.py)
before its waiters are answered: they and every later request get `Failure.model_load_failed()`, and
it is not loaded again until its folder changes or a backoff passes. A refusal for room, a drain or a
cancellation remembers nothing.

Each step, and each step the engine reports (`Engine.load(on_progress=)`: a part of the weights
read, the solo calibration, each warm-up shape, the rates), is `ModelSlot.load_moved()`: the requests
waiting for the load wait `load_wait_timeout_s` from the last one (manager.py `_wait_load`).

Every failure path (a refusal, an engine error, an injected fault, cancellation) undoes the
engine load if it happened and releases the claim exactly once (`Claim`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
from collections.abc import Awaitable, Callable, Mapping

from memory import (
    padded_weight_bytes,
    pressure,
)
from protocol.errors import Failure, RejectionReason
from provider.engine import EngineError, EngineFailure, LoadedModelInfo
from provider.importing import ImportFailed, import_for_load
from provider.metrics import EvictionCause, LoadResult
from provider.models import ModelInfo
from provider.models.broken import BrokenReason, LoadFault, diagnose, folder_fingerprint
from provider.progress import ProgressFactory
from provider.slots.admission import ManagerView, pressure_victim
from provider.slots.prefix import with_measured_kv
from provider.slots.rates import RateBook
from provider.slots.shared import ManagerState
from provider.slots.state import ModelSlot, ModelState, log
from provider.slots.unloading import Unloader

_PROGRESS_INTERVAL_S = 0.2  # how often a terminal's load progress line is redrawn


class LoadStep(enum.Enum):
    """Points in a load where a test may inject a failure (`fault=`)."""

    CLAIMED = "claimed"  # pending load claimed; the engine not yet asked
    ENGINE_LOADING = "engine_loading"  # the engine is loading; its result not yet awaited
    LOADED = "loaded"  # weights resident; before clear_cache and the guard
    GUARD = "guard"  # guard snapshot taken; before its verdict
    GUARD_UNLOAD = "guard_unload"  # the guard refused; before the unload that undoes the load


FaultHook = Callable[[LoadStep, str], Awaitable[None]]


class Loader:
    """The load task and its steps, over the manager's shared state. `view()` is the manager's
    (what the pure decisions read), `unloader` evicts for pressure, `on_resident_change()` is the
    manager's: a model was published."""

    def __init__(self, state: ManagerState, unloader: Unloader, rates: RateBook, *,
                 view: Callable[[], ManagerView], on_resident_change: Callable[[], None],
                 eos_token_ids: Mapping[str, frozenset[int]], fault: FaultHook | None,
                 progress: ProgressFactory | None) -> None:
        self._s = state
        self._unloader = unloader
        self._rates = rates
        self._view = view
        self._on_resident_change = on_resident_change
        self._eos = dict(eos_token_ids)
        self._fault = fault
        self._progress = progress
        self._topups = 0

    async def load(self, slot: ModelSlot) -> Failure | None:
        """The single-flight load task, started with its claim held (`_book_load`). Returns None
        when published, else the failure to report to the requests that wait for it."""
        model_id = slot.model_id
        claim = slot.claim
        assert claim is not None and claim.held
        load_fut: asyncio.Future[LoadedModelInfo] | None = None
        started = self._s.clock()
        remembered = False
        try:
            async with self._s.room_lock:
                await self._settle_leaving_and_pressure(slot)
            if self._s.draining:
                return Failure.draining()
            await self._step(LoadStep.CLAIMED, slot)
            if slot.info.gguf is not None:  # an Ollama model: imported into its folder first
                loop = asyncio.get_running_loop()
                slot.info = await asyncio.to_thread(  # each tensor written is a step of the load
                    import_for_load, slot.info, lambda *_: loop.call_soon_threadsafe(slot.load_moved))
                slot.load_moved()
            load_fut = asyncio.ensure_future(
                self._s.engine.load(model_id, slot.info.path, eos_token_ids=self._eos.get(model_id),
                                    vision=slot.info.is_vision, kv_bits=slot.info.kv_bits,
                                    on_progress=lambda phase: slot.load_moved()))
            await self._step(LoadStep.ENGINE_LOADING, slot)
            loaded = await self._await_load(model_id, load_fut)
            if loaded.vision and slot.info.vision is not None:  # what the processor adds per image
                slot.info = dataclasses.replace(slot.info, vision=dataclasses.replace(
                    slot.info.vision, image_text_tokens=loaded.image_text_tokens))
            if loaded.activation is not None:  # measured over the load's passes: the guard below counts it
                slot.info = dataclasses.replace(slot.info, activation=loaded.activation)
                self._s.sync_activation_reserve()
            await self._step(LoadStep.LOADED, slot)
            checked = self._s.clock()
            if not await self._check_kv_per_token(slot):
                self._count(LoadResult.REFUSED)
                return Failure.capacity(RejectionReason.MEMORY_CAP)
            await self._s.engine.reclaim()  # mx.clear_cache() on the thread that owns MLX
            snap = self._s.probe.snapshot()
            await self._step(LoadStep.GUARD, slot)
            if self._s.draining:
                return Failure.draining()
            # MIN_KV of room beyond every reservation, less the KV its own requests already reserved.
            floor = max(0, self._s.figures.min_kv_bytes - slot.kv_book.view().reserved_bytes)
            if not self._s.ledger.load_is_serveable(snap, pending_load_id=claim.id, kv_floor_bytes=floor):
                log.warning("post_load_guard_refused", model=model_id, weights_bytes=loaded.weights_bytes,
                            headroom_bytes=self._s.figures.live_headroom_bytes(snap),
                            required_bytes=floor + self._s.ledger.outstanding_bytes(excluding=claim.id))
                self._count(LoadResult.REFUSED)
                await self._step(LoadStep.GUARD_UNLOAD, slot)
                return Failure.capacity(RejectionReason.MEMORY_CAP)
            guarded = self._s.clock()
            weight_hash = await self._s.prefix.attach_hash(model_id)  # cached by the runtime: no re-read
            hashed = self._s.clock()
            if self._s.draining:
                return Failure.draining()
            self._s.prefix.attach(model_id, weight_hash)  # same step as the publish: no await between
            self._s.broken.loaded(model_id)
            claim.release()
            slot.claim = None
            slot.loaded = loaded
            self._rates.loaded(model_id)  # a new engine lifetime: what the last one measured is gone
            self._rates.calibrated(model_id, prefill_tps=loaded.prefill_tps, decode_tps=loaded.decode_tps)
            slot.last_used = self._s.clock()
            slot.state = ModelState.LOADED
            self._count(LoadResult.LOADED)
            self._on_resident_change()
            if loaded.activation is not None and self._s.activation_store is not None:
                await asyncio.to_thread(self._s.activation_store.put, slot.info, loaded.activation)
            log.info("model_loaded", model=model_id, weights_bytes=loaded.weights_bytes,
                     estimate_bytes=padded_weight_bytes(slot.info.weight_bytes),
                     load_s=round(loaded.load_seconds, 3), weights_s=round(loaded.weights_seconds, 3),
                     measure_s=round(loaded.measure_seconds, 3), warm_s=round(loaded.warm_seconds, 3),
                     check_s=round(guarded - checked, 3), hash_s=round(hashed - guarded, 3),
                     total_s=round(self._s.clock() - started, 3),
                     measure_budget_s=round(loaded.measure_budget_seconds, 3), solo_from=loaded.solo_from,
                     rates_from=loaded.rates_from, warm_shapes_count=loaded.warm_shapes,
                     warm_skipped_count=loaded.warm_skipped,
                     solo_min_tokens=loaded.solo_min_tokens, transposed_weights=loaded.transposed_weights,
                     cpu_attention=loaded.cpu_attention, activation_reserve_bytes=slot.info.activation_reserve_bytes,
                     activation_from=slot.info.activation.source if slot.info.activation else "default")
            return None
        except ImportFailed as exc:  # its words name the file's fault, never a request's
            log.warning("model_import_failed", model=model_id, reason=str(exc))
            self._count(LoadResult.FAILED)
            remembered = await self._remember(slot, LoadFault.IMPORT_FAILED)
            return Failure.model_load_failed()
        except EngineError as exc:
            log.warning("model_load_failed", model=model_id, code=exc.code)
            self._count(LoadResult.FAILED)
            if exc.code is EngineFailure.ENGINE_CLOSED:  # the engine stopped under the load: a shutdown
                return Failure.draining()
            if exc.code is not EngineFailure.LOAD_FAILED:  # not the folder's fault
                return Failure.model_unloaded()
            remembered = await self._remember(slot, LoadFault.LOAD_FAILED)
            return Failure.model_load_failed()
        except Exception as exc:  # an edge: a load must always end in a typed failure and a clean slate
            log.error("model_load_failed", model=model_id, exc_type=type(exc).__name__)
            self._count(LoadResult.FAILED)
            # An error of our own load path: remembered only where the folder explains it (a file damaged
            # meanwhile); otherwise the next request may load it (503, as for a load undone).
            remembered = await self._remember(slot, LoadFault.INTERNAL_ERROR)
            return Failure.model_load_failed() if remembered else Failure.model_unloaded()
        finally:
            if slot.state is ModelState.LOADING:  # anything but a publish: undo, release, forget
                await self._undo_engine_load(model_id, load_fut)
                claim.release()
                slot.claim = None
                slot.state = ModelState.NOT_LOADED
                self._s.sync_activation_reserve()
                if remembered:  # no longer advertised: the coordinator hears it now, not at the next tick
                    self._on_resident_change()

    async def _remember(self, slot: ModelSlot, fault: LoadFault) -> bool:
        """A failed load, remembered (slots/broken.py) with its reason read from the folder and the
        folder's fingerprint, before the requests waiting for it are answered: they, and every request
        after them until the folder changes or the backoff passes, get the same non-retryable answer
        and no second load. An error of the provider's own load path (`INTERNAL_ERROR`) is remembered
        only when the folder explains it; False when nothing was remembered."""
        reason, fingerprint = await asyncio.to_thread(_examined, slot.info, fault)
        if reason is LoadFault.INTERNAL_ERROR:
            return False
        self._s.broken.mark(slot.info, reason, fingerprint)
        return True

    async def _settle_leaving_and_pressure(self, slot: ModelSlot) -> None:
        """Before the engine allocates: wait until the models the booking counted as leaving have
        settled, and while the load would run at pressure YELLOW or worse, evict idle models
        one at a time; under RED the RAM prefix tier goes first."""
        estimate = padded_weight_bytes(slot.info.weight_bytes)
        while True:
            leaving = self._s.leaving()
            if leaving:
                await asyncio.gather(*(asyncio.shield(t) for t in leaving), return_exceptions=True)
                continue
            snap = self._s.probe.snapshot()
            if snap.reclaimable_bytes and pressure(snap, incoming_bytes=estimate).evict_before_load:
                await self._s.engine.reclaim()  # MLX's buffer cache goes before the prefix tier or a model
                snap = self._s.probe.snapshot()
            if self._s.prefix.relieve(pressure(snap, incoming_bytes=estimate).level):
                continue
            victim = pressure_victim(self._view(), snap, target=slot.model_id, incoming_bytes=estimate)
            if victim is None or not await self._unloader.evict_if_idle(victim, EvictionCause.PRESSURE):
                return

    async def _check_kv_per_token(self, slot: ModelSlot) -> bool:
        """The engine's real KV growth vs the config's: the larger one stands. The
        requests booked with the load reserved at the estimate: top them up, or fail the load
        (False) when the ledger cannot."""
        try:
            measured = await self._s.engine.kv_bytes_per_token(slot.model_id)
        except EngineError as exc:  # the config estimate stands
            log.warning("kv_bytes_per_token_unmeasured", model=slot.model_id, code=exc.code)
            return True
        before = slot.info
        slot.info = with_measured_kv(slot.info, measured)
        if slot.info is before:
            return True
        self._topups += 1
        return slot.kv_book.top_up(self._s.ledger, slot.info.kv, f"kvtopup:{slot.model_id}:{self._topups}")

    async def _await_load(self, model_id: str, load_fut: asyncio.Future[LoadedModelInfo]) -> LoadedModelInfo:
        """The engine's load, with a progress line on a terminal: MLX active-memory growth against
        the padded on-disk estimate (the worker evaluates the weights as it reads them)."""
        if self._progress is None:
            return await asyncio.shield(load_fut)
        expected = padded_weight_bytes(self._s.slots[model_id].info.weight_bytes)
        before = self._s.probe.snapshot().mlx_active_bytes
        with self._progress(f"loading {model_id}") as bar:
            while True:
                done, _ = await asyncio.wait({load_fut}, timeout=_PROGRESS_INTERVAL_S)
                if done:
                    bar.update(expected, expected)
                    return load_fut.result()
                bar.update(max(0, self._s.probe.snapshot().mlx_active_bytes - before), expected)

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
            await self._s.engine.unload(model_id)
        except EngineError as exc:
            if exc.code is not EngineFailure.MODEL_NOT_LOADED:
                log.error("model_unload_failed", model=model_id, code=exc.code)
        await self._s.engine.reclaim()

    async def _step(self, step: LoadStep, slot: ModelSlot) -> None:
        """A step of the load: its waiters' clock starts again (manager.py), then a test's fault, if any."""
        slot.load_moved()
        if self._fault is not None:
            await self._fault(step, slot.model_id)

    def _count(self, result: LoadResult) -> None:
        if self._s.metrics is not None:
            self._s.metrics.model_load(result)


def _examined(info: ModelInfo, fault: LoadFault) -> tuple[BrokenReason, str]:
    """A failed model's folder, read off the loop: why (provider/models/broken.py) and its fingerprint."""
    return diagnose(info, fault), folder_fingerprint(info)
