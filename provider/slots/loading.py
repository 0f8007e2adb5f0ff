"""Loading a model (memory-policy.md §5), `ModelManager`'s load task (a mixin of slots/manager.py).

A load starts with its claim already held: admission books it together with the request that
causes it (`ModelManager.book` / `_book_load`), or the warm-up path plans room and books it
(`_plan_and_book_load`). The task then, in this order:

  1. waits until the models the booking counted as leaving have settled, and while the load would
     run at pressure YELLOW or worse (§8) evicts idle models one at a time (RED: the RAM prefix
     tier first);
  2. loads on the engine thread (`mx.clear_cache()` after), every await followed by a re-check;
  3. checks the config's KV bytes per token against the engine's real cache and keeps the larger
     (§4), topping up what the requests booked with it reserved;
  4. post-load guard: measured headroom ≥ the KV floor (MIN_KV less what its own requests reserved)
     + every other reservation, else unload, release, refuse; only then publishes the model as
     LOADED and attaches its prefix cache.

Every failure path (a refusal, an engine error, an injected fault, cancellation) undoes the
engine load if it happened and releases the claim exactly once (`Claim`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
from collections.abc import Awaitable, Callable

from memory import (
    padded_weight_bytes,
    pressure,
)
from protocol.errors import Failure, RejectionReason
from provider.engine import EngineError, EngineFailure, LoadedModelInfo
from provider.metrics import EvictionCause, LoadResult
from provider.slots.admission import pressure_victim
from provider.slots.prefix import with_measured_kv
from provider.slots.state import ModelSlot, ModelState, log

_PROGRESS_INTERVAL_S = 0.2  # how often a terminal's load progress line is redrawn


class LoadStep(enum.Enum):
    """Points in a load where a test may inject a failure (`fault=`)."""

    CLAIMED = "claimed"  # pending load claimed; the engine not yet asked
    ENGINE_LOADING = "engine_loading"  # the engine is loading; its result not yet awaited
    LOADED = "loaded"  # weights resident; before clear_cache and the guard
    GUARD = "guard"  # guard snapshot taken; before its verdict
    GUARD_UNLOAD = "guard_unload"  # the guard refused; before the unload that undoes the load


FaultHook = Callable[[LoadStep, str], Awaitable[None]]


class Loading:
    """The load task and its steps (used by `ModelManager`; state lives there)."""


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
            checked = self._clock()
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
            guarded = self._clock()
            weight_hash = await self._prefix.attach_hash(model_id)  # cached by the runtime: no re-read
            hashed = self._clock()
            if self._draining:
                return Failure.draining()
            self._prefix.attach(model_id, weight_hash)  # same step as the publish: no await between
            claim.release()
            slot.claim = None
            slot.loaded = loaded
            self.rates.loaded(model_id)  # a new engine lifetime: what the last one measured is gone
            self.rates.calibrated(model_id, prefill_tps=loaded.prefill_tps, decode_tps=loaded.decode_tps)
            slot.last_used = self._clock()
            slot.state = ModelState.LOADED
            self._count_load(LoadResult.LOADED)
            self._resident_set_changed()
            log.info("model_loaded", model=model_id, weights_bytes=loaded.weights_bytes,
                     estimate_bytes=padded_weight_bytes(slot.info.weight_bytes),
                     load_s=round(loaded.load_seconds, 3), weights_s=round(loaded.weights_seconds, 3),
                     measure_s=round(loaded.measure_seconds, 3), warm_s=round(loaded.warm_seconds, 3),
                     check_s=round(guarded - checked, 3), hash_s=round(hashed - guarded, 3),
                     total_s=round(self._clock() - started, 3),
                     solo_min_tokens=loaded.solo_min_tokens, transposed_weights=loaded.transposed_weights,
                     cpu_attention=loaded.cpu_attention)
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
