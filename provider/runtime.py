"""The serving core both front doors share: `serve` (the coordinator agent) and `serve --local`.

    runtime = await Runtime.start(settings)       # blocking steps run off the event loop
    ... runtime.manager.admit(...) / async with runtime.manager.serve(...) ...
    await runtime.aclose()                        # drain, unload (and purge) every model, stop

What it builds, in order: model inventory → memory probe and the one ledger → the tokenizers of
every model that can ever load (`PromptCounter` counts prompts exactly before a load) and the check
of their chat templates (provider/models/template_check.py: a template that passes its time or
memory bound makes the model unservable; it leaves the inventory with its reason, logged as
``model_skipped``, and the rest is served) → the prefix KV cache
(`kvcache`: startup sweep of `state_dir/kvcache` before anything writes there, the SSD tier when
`kv_ssd_budget_gb > 0`, a one-thread executor for its encryption and disk writes) → the engine
(its prefix-cache lookup is the cache's `get`) → the model manager (same admission and memory
policy everywhere; it attaches the prefix cache after each load and purges it on every unload)
→ the weight hashes of every model that can ever load → the `preload_models`, loaded one by one through the manager's own load
gate and kept warm (the idle reaper skips them). A preload is refused, logged with its reason and
skipped, when the id is unknown (`unknown_model`), it can never load under the cap (`too_large`),
the slot cap is full (`slot_cap`), it would only fit by evicting an earlier preload
(`needs_eviction`), or the load gate says no (its failure reason, e.g. `memory_cap`); the start
goes on either way. Preloading happens before the agent connects, so the first heartbeat already
reports those slots `running`.

The agent passes its `guest` monitor (provider/guest: serving windows, the owner's activity,
battery, heat): admission then asks it at every request (`ModelManager.pause_source`), a start
inside a pause defers the preloads until the agent may serve, `release_models` gives the memory
back after a pause's grace period and `restore_preloads` loads the preloads again when it ends.

`status()` is the body of the local `/status` endpoint (loaded models and their states, in-flight
requests, ledger by kind, pressure, prefix-cache stats, the coordinator `session` when the agent
attached its `SessionStatus`, and its `availability` when it has a guest monitor);
`refresh_metrics()` updates the gauges that are sampled rather than counted (ledger bytes, prefix
cache), called on each /metrics scrape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import memory
from kvcache.disk import KVCACHE_DIR, DiskBudget, check_writable_dir, os_error_name, startup_sweep
from kvcache.manager import KvCacheManager
from kvcache.ssd import SsdStore
from memory import ROOM_CAUSE_SETTING, FitVerdict, Ledger, Probe
from provider.config import Settings, policy_settings
from provider.engine import Engine, EngineOptions
from provider.engine.activation import window_for
from provider.guest.availability import Paused
from provider.guest.monitor import GuestMonitor
from provider.jobs import ServingStats
from provider.metrics import EvictionCause, Metrics
from provider.models import DigestCache, Inventory, ModelInfo, SkipReason, discover_models, weight_hash
from provider.models.activation import ActivationStore, reserve_json, with_activation
from provider.models.discovery import with_kv_quantization
from provider.models.hashing import CACHE_FILE, weight_fingerprint_sync
from provider.models.template import Lane, TemplateBound, renderer
from provider.models.template_check import without_unservable
from provider.progress import ProgressFactory, default_progress, terminal_progress
from provider.request import PromptCounter
from provider.request.intake import Intake
from provider.session.status import SessionStatus, failure_reason
from provider.slots import GoneReason, ModelManager, ModelState, SlotRefused
from provider.telemetry import get_logger

log = get_logger("provider.runtime")

WEIGHT_HASH_CACHE = CACHE_FILE  # in the state dir: per-file digests by (path, size, mtime), across restarts


class WeightHashes:
    """Weight hash per model id, computed once off the event loop and cached (register advertises
    them; the prefix cache binds its entries to them). Per-file digests come from `cache`, which the
    runtime keeps in the state dir, so a restart only reads weight files that changed."""

    def __init__(self, paths: Mapping[str, Path], *, progress: ProgressFactory | None = None,
                 cache: DigestCache | None = None, fingerprints: bool = False) -> None:
        """`fingerprints`: the prefix cache's binding only (`weight_fingerprint_sync`), for a runtime
        that advertises nothing (`serve --local`): no weight byte is read."""
        self._paths = dict(paths)
        self._fingerprints = fingerprints
        self._progress = progress
        self._cache = cache
        self._done: dict[str, str] = {}
        self._pending: dict[str, asyncio.Future[str]] = {}

    async def get(self, model_id: str) -> str:
        if model_id in self._done:
            return self._done[model_id]
        task = self._pending.get(model_id)
        if task is None:  # its own task: one caller being cancelled must not cancel the others
            task = self._pending[model_id] = asyncio.ensure_future(self._hash(model_id))
        try:
            value = await asyncio.shield(task)
        finally:
            if task.done():
                self._pending.pop(model_id, None)
        self._done[model_id] = value
        return value

    async def _hash(self, model_id: str) -> str:
        if self._fingerprints:
            return await asyncio.to_thread(weight_fingerprint_sync, self._paths[model_id])
        if self._progress is None:
            return await weight_hash(self._paths[model_id], cache=self._cache)
        with self._progress(f"hashing {model_id}") as bar:
            return await weight_hash(self._paths[model_id], cache=self._cache, progress=bar.update)

    async def warm(self, model_ids: Iterable[str]) -> dict[str, str]:
        return {model_id: await self.get(model_id) for model_id in model_ids}

    def add(self, model_id: str, path: Path, digest: str) -> None:
        """A model that arrived while running, with the weight hash already checked (a prefetch)."""
        self._paths[model_id] = Path(path)
        if not self._fingerprints:
            self._done[model_id] = digest

    def known(self) -> Mapping[str, str]:
        """The weight hashes computed so far (none with `fingerprints`: those are no weight hashes)."""
        return {} if self._fingerprints else dict(self._done)


UNSERVABLE_RETRY_S = 1.0  # how often a resident model whose template passed a bound is tried for unloading

# A conversation's latest turn goes to the SSD tier once it has been quiet this long (see kvcache.manager):
# rewriting the whole conversation after every turn would take the CPU the next turn's prefill needs.
SSD_QUIET_S = 5.0


def build_prefix_cache(settings: Settings, ledger: Ledger, probe: Probe,
                       write_executor: ThreadPoolExecutor) -> KvCacheManager:
    """The sweep first (a previous process's files are unreadable by design), then the tiers. A state
    directory we cannot write (read-only, someone else's, a file in the way) costs only the SSD tier:
    one warning says why, and the RAM tier serves on (a service manager must not restart us forever)."""
    root = settings.state_dir / KVCACHE_DIR
    ssd = None
    try:
        removed = startup_sweep(root)  # also creates root as 0700
        if settings.kv_ssd_budget_bytes > 0:
            check_writable_dir(root)
            budget = DiskBudget(root, settings.kv_ssd_budget_bytes)  # min(configured, half the free disk)
            ssd = SsdStore(root, budget=budget)
            log.info("prefix_cache_ready", path=str(root), count=removed, limit_bytes=budget.limit_bytes())
        else:
            log.info("prefix_cache_ready", path=str(root), count=removed, limit_bytes=0)
    except OSError as exc:
        ssd = None
        log.warning("ssd_tier_unavailable", path=str(root), reason=os_error_name(exc))
    return KvCacheManager(ledger, ssd=ssd, sample_snapshot=probe.recent, write_executor=write_executor,
                          write_delay_s=SSD_QUIET_S)


def engine_options(settings: Settings, figures: memory.CapFigures) -> EngineOptions:
    """The engine's options from the settings and the cap's figures."""
    return EngineOptions(
        batch_size=settings.max_batch_size,
        limits=memory.mlx_limits(figures),
        # Half the activation reserve: a next-turn preparation runs only while no step does (next_turn.py).
        next_turn_scratch_bytes=figures.activation_reserve_bytes // 2 if settings.prepare_next_turn else 0,
        solo_min_tokens=None if settings.solo_prefill else 0,
        stream_interval_s=settings.stream_interval_ms / 1000,
        measure_budget_s=settings.load_measure_budget_s,
    )


_startup_heap_frozen = False


def freeze_startup_heap() -> None:
    """Once per process, when start-up is done: collect, then move every surviving object (imports,
    tokenizers, settings: they live for the whole run) into the collector's permanent generation.
    Without it every later full collection (after an unload, in the settle barrier) walks them again:
    ~0.13 s with the GIL held in the agent, measured, which stalls the event loop and every fast 503.
    Frozen objects are still freed by reference counting."""
    global _startup_heap_frozen
    if not _startup_heap_frozen:
        _startup_heap_frozen = True
        gc.collect()
        gc.freeze()


_ALWAYS_WARN = frozenset({SkipReason.CHAT_TEMPLATE_TIMEOUT, SkipReason.CHAT_TEMPLATE_MEMORY})


def gguf_aware_loader(models_dir: Path) -> Callable[[Path], Any]:
    """The prompt counter's tokenizer loader: mlx-lm's, from a model folder or, for a GGUF not imported yet,
    from the tokenizer folder made from it (blocking: the counter runs it on a worker thread)."""
    from provider.importing import tokenizer_folder
    from provider.request.tokens import load_tokenizer

    def load(path: Path) -> Any:
        return load_tokenizer(tokenizer_folder(path, models_dir) if path.is_file() else path)

    return load


def _log_unservable(settings: Settings, inventory: Inventory) -> None:
    """Say once at start which models found on disk cannot be served, and why: a warning for the
    ones the operator named (an alias, `enabled_models`, `preload_models`) and for a chat template
    past its bounds, a note for the others (a hub-cache folder that is not an MLX model is normal);
    and a warning naming every place searched when there is no model at all."""
    named = {*settings.model_aliases, *settings.enabled_models, *settings.preload_models}
    for s in inventory.skipped:
        emit = log.warning if s.id in named or s.reason in _ALWAYS_WARN else log.info
        emit("model_skipped", model=s.id, path=str(s.path), reason=s.reason.value, detail=s.message)
    for model_id in inventory.missing:
        log.warning("enabled_model_missing", model=model_id)
    if not inventory.models:  # every request would be a 404: say where we looked
        log.warning("no_models_found", path=[p.words for p in inventory.searched], models=list(inventory.disabled))


@dataclasses.dataclass(slots=True)
class Runtime:
    settings: Settings
    inventory: Inventory
    probe: Probe
    ledger: Ledger
    prefix_cache: KvCacheManager
    engine: Engine
    owns_engine: bool
    manager: ModelManager
    weight_hashes: WeightHashes
    counter: PromptCounter
    intake: Intake
    stats: ServingStats
    metrics: Metrics
    servable: tuple[str, ...]  # models that can ever load here (the ones advertised)
    _writer: ThreadPoolExecutor
    session: SessionStatus | None = None  # the agent's coordinator link (None for `serve --local`)
    preload_refused: dict[str, str] = dataclasses.field(default_factory=dict)  # model id -> reason
    guest: GuestMonitor | None = None  # the owner's rules (the agent only; `serve --local` serves its owner)
    _dropping: dict[str, asyncio.Task[None]] = dataclasses.field(default_factory=dict)  # resident, unservable

    @classmethod
    async def start(cls, settings: Settings, *, engine: Engine | None = None, metrics: Metrics | None = None,
                    eos_token_ids: Mapping[str, frozenset[int]] | None = None,
                    progress: ProgressFactory | None = None, guest: GuestMonitor | None = None,
                    hash_weights: bool = True) -> Runtime:
        """Build everything. A given `engine` stays the caller's (not closed here); prefix reuse
        then happens only if it was built with `prefix_cache=runtime.prefix_cache.get`.
        `hash_weights`: the agent advertises each model's weight hash in `register`, so it hashes them
        before it connects; `serve --local` advertises nothing and passes False: it binds its prefix
        cache to a file fingerprint instead and listens without reading a weight byte.
        `progress` reports weight hashing and model loads (default: a line on stderr when it is a
        terminal; elsewhere hashing, which can take minutes at every cold start, logs events)."""
        hash_progress = progress if progress is not None else default_progress()
        progress = progress if progress is not None else terminal_progress()
        inventory = await asyncio.to_thread(discover_models, settings)
        for lane in Lane:  # the template renderers' imports overlap everything up to the tokenizers' check
            await asyncio.to_thread(renderer(lane).start)
        probe = Probe(settings.memory_limit_gb)
        snapshot, policy = probe.snapshot(), policy_settings(settings)
        base = memory.compute_figures(snapshot.physical_bytes, policy)
        # Reservations that bring no reading of their own (a large body's, a grammar's, a prefix entry's)
        # take the reading shared by the requests of the last few ms: the ledger's own total is always
        # live (memory/probe.py says why that keeps the cap). The activation reserve in force is the loaded
        # models' (none yet), each measured at its load or estimated before (the model manager keeps it).
        ledger = Ledger(base.for_models(()), sample=probe.recent)
        probe.host_booked = ledger.host_booked_bytes  # the process's bytes the ledger books outside MLX
        options = engine_options(settings, base)
        activation_store = ActivationStore(settings.state_dir)
        inventory = await asyncio.to_thread(with_activation, inventory, window_tokens=window_for(options.prefill_tokens),
                                            batch_rows=options.batch_size, store=activation_store)
        if hash_weights:  # the coordinator is told each model's weight hash: an Ollama model has one once imported
            inventory = dataclasses.replace(inventory, models=tuple(m for m in inventory.models if m.gguf is None))
        # An Ollama model not imported yet: its tokenizer is read from its GGUF (importing.tokenizer_folder).
        counter = PromptCounter({m.id: m.gguf or m.path for m in inventory.models},
                                vision={m.id for m in inventory.models if m.is_vision},
                                loader=gguf_aware_loader(settings.imported_models_dir),
                                template_timeout_s=settings.template_timeout_s)
        unservable = await counter.warm(m.id for m in inventory.models
                                        if memory.fit(ledger.figures, snapshot, m.weight_bytes,
                                                      activation_reserve_bytes=m.activation_reserve_bytes).ever_fits)
        inventory = without_unservable(inventory, unservable, timeout_s=settings.template_timeout_s)
        _log_unservable(settings, inventory)
        if causes := memory.no_room_causes(snapshot.unlimited_physical_bytes, policy):
            # Otherwise every model would just be "too large": say once which settings take the room.
            log.warning("memory_reserves_leave_no_room", variable=[ROOM_CAUSE_SETTING[c] for c in causes],
                        effective_cap_bytes=ledger.figures.effective_cap_bytes,
                        load_headroom_bytes=ledger.figures.load_headroom_bytes)
        metrics = metrics or Metrics()
        writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-ssd-write")
        prefix = await asyncio.to_thread(build_prefix_cache, settings, ledger, probe, writer)
        owns_engine = engine is None
        engine = engine or Engine(options, prefix_cache=prefix.get)
        digests = await asyncio.to_thread(DigestCache.open, settings.state_dir / WEIGHT_HASH_CACHE)
        hashes = WeightHashes({m.id: m.path for m in inventory.models}, progress=hash_progress, cache=digests,
                              fingerprints=not hash_weights)
        manager = ModelManager.from_settings(settings, engine, inventory, ledger, probe, metrics=metrics,
                                             eos_token_ids=eos_token_ids, prefix_cache=prefix,
                                             weight_hash=hashes.get, progress=progress,
                                             activation_store=activation_store)
        servable = tuple(m.id for m, verdict in manager.verdicts() if verdict.ever_fits)
        if hash_weights:
            await hashes.warm(servable)
        intake = Intake(counter, ledger, manager)
        runtime = cls(settings, inventory, probe, ledger, prefix, engine, owns_engine, manager, hashes, counter,
                      intake, ServingStats(), metrics, servable, writer, guest=guest)
        counter.on_unservable = runtime._drop_unservable
        manager.diagnostics.sample(probe.snapshot())  # the no-model baseline at start
        freeze_startup_heap()
        if guest is not None:
            manager.pause_source = guest.paused
            guest.bind(release=runtime.release_models, restore=runtime.restore_preloads)
            state = await guest.step()  # the first readings, before anything is loaded
            if isinstance(state, Paused) and state.reason.releases_memory and settings.preload_models:
                guest.defer_restore()  # loaded when the agent may serve
                log.info("preload_deferred", reason=state.reason, models=list(settings.preload_models))
                return runtime
        await runtime.preload(settings.preload_models)
        return runtime

    def adopt(self, info: ModelInfo, digest: str) -> bool:
        """Serve a model that arrived while running (a verified `prefetch_model`): its tokenizer, weight
        hash and slot, advertised from now on if it can ever load here. False (nothing changed) for a
        model already known or a vision model (its processor is checked at start only)."""
        if self.counter.knows(info.id) or self.manager.info(info.id) is not None or info.is_vision:
            return False
        info = with_kv_quantization(info, self.settings.kv_quantization_for(info.id))
        self.counter.add(info.id, info.path)
        self.weight_hashes.add(info.id, info.path, digest)
        self.manager.adopt(info)
        self.inventory = dataclasses.replace(self.inventory, models=(*self.inventory.models, info))
        if any(m.id == info.id and verdict.ever_fits for m, verdict in self.manager.verdicts()):
            self.servable = (*self.servable, info.id)
        return True

    def servable_now(self) -> tuple[str, ...]:
        """`servable` less the models dropped since start (their folder went away, their template
        passed a bound on a request) and those whose failed load is remembered."""
        unservable = self.counter.unservable()
        broken = self.manager.broken_models()  # a failed load remembered: offered again once it may load
        return tuple(m for m in self.servable if m not in self.manager.gone and m not in unservable and m not in broken)

    def _drop_unservable(self, model_id: str, bound: TemplateBound) -> None:
        """A request found the model's template past a bound: the counter refuses the model's requests
        from now on (404, and `servable_now` leaves it out), and it leaves the inventory (the next
        register; /status `models_gone`) — a resident one once its requests in flight are done."""
        if self.manager.state(model_id) is ModelState.NOT_LOADED:
            self.manager.forget(model_id, GoneReason(bound.value))
        elif model_id not in self._dropping:
            self._dropping[model_id] = asyncio.create_task(self._unload_and_forget(model_id, GoneReason(bound.value)),
                                                           name=f"drop-{model_id}")

    async def _unload_and_forget(self, model_id: str, reason: GoneReason) -> None:
        # It takes no new request: unload it as soon as the ones in flight are done (a real wait, not a
        # handshake: the manager has no "idle now" signal), then forget it.
        while self.manager.state(model_id) is not ModelState.NOT_LOADED and not await self.manager.unload(model_id):
            await asyncio.sleep(UNSERVABLE_RETRY_S)
        self.manager.forget(model_id, reason)

    async def release_models(self) -> bool:
        """Unload every idle model (kept-warm ones too) so the owner gets the memory back; True once
        nothing is resident or loading. A busy model is left to finish its requests (retry later)."""
        for model_id in self.manager.warm_models():
            await self.manager.unload(model_id, cause=EvictionCause.PAUSED)
        return all(self.manager.state(m.id) is ModelState.NOT_LOADED for m in self.inventory.models)

    async def restore_preloads(self) -> None:
        """Load `preload_models` again (after a pause released them); refusals are reported afresh."""
        self.preload_refused.clear()
        await self.preload(self.settings.preload_models)

    async def preload(self, model_ids: Iterable[str]) -> dict[str, str]:
        """Load each model through the load gate and keep it warm; returns the refused ones with
        their reasons (also kept in `preload_refused` and logged)."""
        for model_id in dict.fromkeys(model_ids):
            reason = self._preload_refusal(model_id)
            if reason is None:
                try:
                    await self.manager.ensure_loaded(model_id)
                except SlotRefused as exc:
                    reason = failure_reason(exc.failure)
            if reason is not None:
                self.preload_refused[model_id] = reason
                log.warning("preload_refused", model=model_id, reason=reason)
                continue
            self.manager.keep_warm(model_id)
            log.info("model_preloaded", model=model_id)
        return dict(self.preload_refused)

    def _preload_refusal(self, model_id: str) -> str | None:
        verdict = next((v for m, v in self.manager.verdicts() if m.id == model_id), None)
        if verdict is None:
            return "unknown_model"
        if self.manager.state(model_id) is ModelState.LOADED:
            return None
        if not verdict.ever_fits:
            return "too_large"
        if len(self.manager.warm_models()) >= self.settings.max_model_slots:
            return "slot_cap"
        if verdict.verdict is FitVerdict.FITS_AFTER_EVICTION:
            return "needs_eviction"  # loading it would unload a model preloaded before it
        return None

    async def aclose(self) -> None:
        """Refuse new work, unload every model (each unload purges its prefix cache), stop the engine
        if it is ours, then let queued SSD writes finish (a purged model's writes delete themselves)."""
        self.manager.start_draining()
        for task in self._dropping.values():
            task.cancel()
        await self.manager.unload_all()
        if self.owns_engine:
            await self.engine.aclose()
        self.counter.lane.close()
        await asyncio.to_thread(self._writer.shutdown, wait=True)

    # -- reporting ----------------------------------------------------------------------------

    def diagnostics(self) -> dict[str, Any]:
        """The memory diagnostics of /status: last unloads, pressure and its figures, the
        no-model baseline and its drift, and the restart recommendation with its reason."""
        snap = self.probe.snapshot()
        level = memory.pressure(snap)
        advice = self.manager.restart_advice()
        self.metrics.set_restart(advice.recommendation.value, advice.drift.mlx_active_bytes)
        return {**self.manager.diagnostics.as_json(advice),
                "pressure": {"level": level.level.name.lower(), "utilization": round(level.utilization, 4),
                             "mlx_active_bytes": snap.mlx_active_bytes, "mlx_cache_bytes": snap.mlx_cache_bytes,
                             "unattributed_bytes": snap.unattributed_bytes,
                             "physical_bytes": snap.physical_bytes,
                             "thresholds": {"yellow": memory.pressure_thresholds()[0],
                                            "red": memory.pressure_thresholds()[1],
                                            "fatal": memory.pressure_thresholds()[2]}}}

    def refresh_metrics(self) -> None:
        self.metrics.set_ledger_bytes(dict(self.ledger.snapshot().bytes_by_kind))
        self.metrics.set_prefix_cache(self.prefix_cache.stats())

    def status(self) -> dict[str, Any]:
        """The local /status body (without mode and cap figures, which the app adds)."""
        snap = self.probe.snapshot()
        level = memory.pressure(snap)
        capacity = self.manager.capacity()
        ledger = capacity.ledger
        by_slot = {s.model: s for s in capacity.slots}
        in_flight_by_model: dict[str, int] = {}
        for model_id in self.stats.in_flight.values():
            in_flight_by_model[model_id] = in_flight_by_model.get(model_id, 0) + 1
        models = []
        for m in self.inventory.models:
            if m.id in self.manager.gone:
                continue
            state = self.manager.state(m.id)
            slot = by_slot.get(m.id)
            info = self.manager.info(m.id) or m
            models.append({
                "id": m.id,
                "state": state.name.lower(),
                "resident_bytes": self.manager.resident_bytes(m.id) if state is ModelState.LOADED else None,
                "idle_s": None if (idle := self.manager.idle_seconds(m.id)) is None else round(idle, 1),
                "weight_bytes": m.weight_bytes,
                "context_length": m.context_length,
                "vision": m.is_vision,
                "kv_bytes_per_token": info.kv.max_bytes_per_token,
                # the form its KV is kept quantized in (kv_quantization: keys' and values' bits, group size); null: its dtype
                "kv_bits": None if info.kv_bits is None else info.kv_bits.as_json(),
                # prompts with this many tokens left to prefill go solo (engine/prefill.py); null: none do
                "solo_prefill_min_tokens": loaded.solo_min_tokens if (loaded := self.manager.loaded(m.id)) else None,
                # what its passes hold at most (its prefill window at its context) and where the figure came from
                "activation_reserve": reserve_json(info, self.ledger.figures),
                "preloaded": m.id in self.manager.kept_warm,
                "active_requests": in_flight_by_model.get(m.id, 0),
                "running": slot.num_running if slot else 0,
                "waiting": slot.num_waiting if slot else 0,
            })
        kv = self.prefix_cache.stats()
        self.refresh_metrics()
        session = {} if self.session is None else {"session": self.session.view().as_json()}
        guest = {} if self.guest is None else {"availability": self.guest.as_json()}
        return {
            **session,
            "diagnostics": self.diagnostics(),
            **guest,
            "preload": {"requested": list(self.settings.preload_models), "refused": dict(self.preload_refused)},
            "models": models,
            # dropped since start; a model refused for its template counts from the refusal on
            "models_gone": {**{m: b.value for m, b in self.counter.unservable().items()},
                            **{m: reason.value for m, reason in self.manager.gone.items()}},
            # failed loads remembered: not offered, not loaded again until the folder changes or retry_in_s passes
            "models_broken": self.manager.broken_models(),
            "in_flight": len(self.stats.in_flight),
            "ledger": {"bytes_by_kind": {k.value: v for k, v in ledger.bytes_by_kind.items()},
                       "count_by_kind": {k.value: v for k, v in ledger.count_by_kind.items()},
                       "available_bytes": capacity.available_bytes, "peak_bytes": self.ledger.peak_bytes},
            "pressure": {"level": level.level.name.lower(), "utilization": level.utilization},
            "memory": {"physical_bytes": snap.physical_bytes, "available_bytes": snap.available_bytes,
                       "mlx_active_bytes": snap.mlx_active_bytes, "mlx_cache_bytes": snap.mlx_cache_bytes,
                       "mlx_peak_bytes": snap.mlx_peak_bytes, "rss_bytes": snap.rss_bytes,
                       # the process's bytes outside MLX, what the ledger books of them for the host, the rest
                       # (unattributed: counted as used by admission and the pressure level), and the sum the
                       # cap counts; what the ledger would admit now, from this same reading
                       "outside_mlx_bytes": snap.outside_mlx_bytes, "host_booked_bytes": snap.host_booked_bytes,
                       "unattributed_bytes": snap.unattributed_bytes, "counted_bytes": snap.counted_bytes,
                       "admits_bytes": self.ledger.available_bytes(snap),
                       "activation_reserve_bytes": self.ledger.figures.activation_reserve_bytes,
                       "free_for_load_bytes": capacity.free_for_load_bytes,
                       # which memory the figures above are of; a discrete GPU's host RAM beside it
                       "device_memory": snap.device_memory.value, "host_physical_bytes": snap.host_physical_bytes,
                       "host_available_bytes": snap.host_available_bytes},
            "prefix_cache": {"hits": kv.hits, "partial_hits": kv.partial_hits, "misses": kv.misses,
                             "ssd_hits": kv.ssd_hits, "reused_tokens": kv.reused_tokens, "entries": kv.entries,
                             "ram_bytes": kv.ram_bytes, "disk_bytes": kv.disk_bytes},
        }


__all__ = ["KVCACHE_DIR", "WEIGHT_HASH_CACHE", "Runtime", "WeightHashes", "build_prefix_cache"]
