"""What the local server serves from: models on the engine, admitted through the memory ledger.

`EngineBackend.open(request_id, body)` is an async context manager that either raises `Refused`
(a typed `protocol.errors.Failure`, nothing else) or yields the request's event stream with its
KV bytes reserved in the ledger. Admission uses `memory/` exactly as the agent does:

* a model load takes a PENDING_LOAD claim of `required_load_bytes(padded weights)` and, once
  loaded, must pass the post-load guard (`Ledger.load_is_serveable`), else it is unloaded again;
* a request reserves `CapFigures.request_kv(...)` as REQUEST_KV, released by the engine's
  `on_released` hook when its KV has left the batch (every path, cancellation included).

Models load on first use, at most `max_model_slots` at once; this front does not evict (a full
set of slots refuses with SLOT_STATE).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import memory
from memory import CapFigures, Ledger, Lease, Probe, ReservationKind
from protocol.errors import Failure, RejectionReason
from provider.config import Settings
from provider.engine import ChatRequest, Engine, EngineError, LoadedModelInfo, RequestStream
from provider.local.body import ChatBody
from provider.metrics import LoadResult, Metrics
from provider.models import Inventory, ModelInfo
from provider.telemetry import get_logger

log = get_logger(__name__)
RETRY_AFTER_S = 2  # a capacity refusal is transient: memory frees as requests finish


class Refused(Exception):
    """The request is not admitted; `failure` says why in the protocol's closed vocabulary."""

    def __init__(self, failure: Failure, retry_after_s: int | None = None) -> None:
        super().__init__(failure.code.value)
        self.failure = failure
        self.retry_after_s = retry_after_s


def _capacity(rejection: RejectionReason) -> Refused:
    return Refused(Failure.capacity(rejection), RETRY_AFTER_S)


@dataclass(slots=True)
class _Loaded:
    info: LoadedModelInfo
    model: ModelInfo
    in_flight: int = 0


class EngineBackend:
    """Models on one `Engine`, admission through one `Ledger`. Create on the serving event loop."""

    def __init__(self, settings: Settings, inventory: Inventory, *, probe: Probe, figures: CapFigures,
                 metrics: Metrics, engine: Engine | None = None) -> None:
        self.settings = settings
        self.inventory = inventory
        self.probe = probe
        self.figures = figures
        self.metrics = metrics
        self.ledger = Ledger(figures, sample=probe.snapshot)
        self.engine = engine or Engine()
        self._loaded: dict[str, _Loaded] = {}
        self._load_lock = asyncio.Lock()
        self._requests = 0

    def model_ids(self) -> list[str]:
        return [m.id for m in self.inventory.models]

    @asynccontextmanager
    async def open(self, request_id: str, body: ChatBody) -> AsyncIterator[RequestStream]:
        model = self.inventory.get(body.model)
        if model is None:
            raise Refused(Failure.model_unavailable())
        loaded = await self._ensure_loaded(model)
        try:
            prompt_tokens = await self.engine.count_prompt_tokens(model.id, body.messages)
        except EngineError:
            raise Refused(Failure.template_render()) from None
        context = loaded.info.context_length or prompt_tokens + (body.max_tokens or 8192)
        if prompt_tokens >= context:
            raise Refused(Failure.request_exceeds_context())
        kv = self.figures.request_kv(kv_bytes_per_token=model.kv_bytes_per_token, prompt_tokens=prompt_tokens,
                                     context_length=context, max_tokens=body.max_tokens)
        if not kv.within_limit:
            raise Refused(Failure.exceeds_node(RejectionReason.KV_HEADROOM))
        lease = self.ledger.reserve(request_id, ReservationKind.REQUEST_KV, kv.nbytes)
        if not isinstance(lease, Lease):
            raise _capacity(RejectionReason.KV_HEADROOM)
        request = ChatRequest(request_id, body.messages, body.sampling(kv.max_tokens))
        try:
            stream = self.engine.submit(model.id, request, on_released=self.ledger.release)
        except EngineError:
            self.ledger.release(request_id)
            raise
        loaded.in_flight += 1
        self.metrics.add_tokens(prompt=prompt_tokens)
        try:
            with self.metrics.in_flight():
                yield stream
        finally:
            loaded.in_flight -= 1
            await stream.aclose()  # no-op after a terminal event; a cancel otherwise

    async def _ensure_loaded(self, model: ModelInfo) -> _Loaded:
        async with self._load_lock:
            if model.id in self._loaded:
                return self._loaded[model.id]
            if len(self._loaded) >= self.settings.max_model_slots:
                raise _capacity(RejectionReason.SLOT_STATE)
            claim_id = f"load:{model.id}"
            required = self.figures.required_load_bytes(memory.padded_weight_bytes(model.weight_bytes))
            claim = self.ledger.claim_pending_load(claim_id, required)
            if not isinstance(claim, Lease):
                self.metrics.model_load(LoadResult.REFUSED)
                log.info("model_load_refused", model=model.id, reason=claim.reason, required_bytes=required)
                raise _capacity(RejectionReason.MEMORY_CAP)
            try:
                log.info("model_loading", model=model.id, weight_bytes=model.weight_bytes)
                info = await self.engine.load(model.id, model.path)
            except EngineError:
                self.metrics.model_load(LoadResult.FAILED)
                raise Refused(Failure.model_load_failed(), RETRY_AFTER_S) from None
            finally:
                serveable = self.ledger.load_is_serveable(pending_load_id=claim_id)
                self.ledger.release(claim_id)
            if not serveable:
                await self.engine.unload(model.id)
                self.metrics.model_load(LoadResult.REFUSED)
                raise _capacity(RejectionReason.MEMORY_CAP)
            self.metrics.model_load(LoadResult.LOADED)
            log.info("model_loaded", model=model.id, resident_bytes=info.weights_bytes, load_s=info.load_seconds)
            self._loaded[model.id] = loaded = _Loaded(info, model)
            self.metrics.set_loaded_models(len(self._loaded))
            return loaded

    def status(self) -> dict[str, Any]:
        """Loaded models, in-flight requests, ledger by kind, pressure: the /status body's core."""
        snap = self.probe.snapshot()
        level = memory.pressure(snap)
        ledger = self.ledger.snapshot()
        self.metrics.set_ledger_bytes(dict(ledger.bytes_by_kind))
        models = []
        for m in self.inventory.models:
            loaded = self._loaded.get(m.id)
            stats = self.engine.stats(m.id) if loaded else None
            models.append({
                "id": m.id,
                "state": "loaded" if loaded else "available",
                "resident_bytes": loaded.info.weights_bytes if loaded else None,
                "weight_bytes": m.weight_bytes,
                "context_length": m.context_length,
                "active_requests": loaded.in_flight if loaded else 0,
                "running": stats.num_running if stats else 0,
                "waiting": stats.num_waiting if stats else 0,
            })
        return {
            "models": models,
            "in_flight": sum(x.in_flight for x in self._loaded.values()),
            "ledger": {"bytes_by_kind": {k.value: v for k, v in ledger.bytes_by_kind.items()},
                       "count_by_kind": {k.value: v for k, v in ledger.count_by_kind.items()},
                       "available_bytes": self.figures.available_bytes(snap, ledger.total_bytes)},
            "pressure": {"level": level.level.name.lower(), "utilization": level.utilization},
            "memory": {"physical_bytes": snap.physical_bytes, "available_bytes": snap.available_bytes,
                       "mlx_active_bytes": snap.mlx_active_bytes, "mlx_cache_bytes": snap.mlx_cache_bytes},
        }

    async def aclose(self) -> None:
        await self.engine.aclose()
        self._loaded.clear()
