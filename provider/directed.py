"""Models the coordinator asks for: ``load_model``, ``prefetch_model`` and ``desired_models`` (``DesiredBuilds``).

A ``load_model`` goes through exactly the path a warm-up takes (``ModelManager.ensure_loaded``): the same
room plan and load gate, the same pending-load claim in the ledger, the same post-load guard. Its answer
is ``load_model_status`` ``started``, then ``succeeded`` or ``failed``, as the coordinator's protocol
says; the heartbeat that follows a load goes out at once (``on_capacity_change``) and shows the slot
``running``. The ``error`` of a failure is a word of our closed vocabularies (the failure's reason), never
an exception's text; a refusal because we are draining says ``provider draining for update``, the string
the coordinator matches as transient (coordinator/protocol/heartbeat.go ``ProviderDrainingForUpdate``).

A ``prefetch_model`` downloads and verifies only (provider/models/download.py), never loads:
``started``; the weight hash the coordinator expects, from its catalog (``GET /v1/models/catalog``, the
entry's ``weight_hash``); the plan and the disk budget before the first byte; ``downloading`` with
``bytes_done`` / ``bytes_total`` at most every ``PROGRESS_INTERVAL_S``; the weight hash of what arrived
(provider/models/hashing.py) against the expected one; then ``verified`` and a ``models_update`` that
advertises the model (``Runtime.adopt``), or ``failed`` with a closed word and nothing advertised (a
repository folder this prefetch created is removed, so no later start finds the bad files). Without an
expected hash there is nothing to verify against: ``failed`` (``no_expected_hash``). One prefetch of a
model at a time; a second one while it runs is answered ``failed`` (``in_progress``).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from protocol import DesiredModels, LoadModel, LoadModelStatus, ModelsUpdate, PrefetchModel, PrefetchModelStatus, encode
from protocol.errors import ErrorReason, Failure
from provider.models import ModelInfo, inspect_model
from provider.models.discovery import ModelSource
from provider.models.download import (
    DownloadFailed,
    check_disk,
    download,
    plan_download,
    repo_folder,
    valid_repo_id,
)
from provider.models.hashing import weight_hash_sync
from provider.session.gates import catalog_url
from provider.session.register import advertised_models
from provider.slots import ModelManager, SlotRefused
from provider.telemetry import get_logger

log = get_logger("provider.directed")

DRAINING_FOR_UPDATE = "provider draining for update"
MAX_MODEL_ID_CHARS = 256  # the coordinator's id, echoed back: bounded like a request id

Send = Callable[[str], None]
MAX_CATALOG_BYTES = 8 << 20
CATALOG_TIMEOUT_S = 10.0
_HEX64 = re.compile(r"[0-9a-f]{64}")

if TYPE_CHECKING:
    from provider.runtime import Runtime


def expected_weight_hash(coordinator_url: str, model_id: str, timeout_s: float = CATALOG_TIMEOUT_S) -> str | None:
    """The ``weight_hash`` the coordinator's catalog lists for ``model_id`` (blocking); None when it
    lists none (or the catalog cannot be read)."""
    try:
        with urllib.request.urlopen(catalog_url(coordinator_url), timeout=timeout_s) as response:
            body = response.read(MAX_CATALOG_BYTES + 1)
        document = json.loads(body) if len(body) <= MAX_CATALOG_BYTES else None
    except (urllib.error.URLError, OSError, ValueError, RecursionError):
        return None
    entries = document.get("models", document.get("data")) if isinstance(document, dict) else document
    for entry in entries if isinstance(entries, list) else ():
        if isinstance(entry, dict) and entry.get("id") == model_id:
            value = entry.get("weight_hash")
            return value.lower() if isinstance(value, str) and _HEX64.fullmatch(value.lower()) else None
    return None


def failure_word(failure: Failure) -> str:
    """The closed-vocabulary word a failed load reports: its reason, else its rejection, else its code."""
    if failure.reason is ErrorReason.DRAINING:
        return DRAINING_FOR_UPDATE
    for word in (failure.reason, failure.rejection, failure.code):
        if word is not None:
            return word.value
    return "model_load"


class DesiredBuilds:
    """``desired_models``: which build each public model name should run ([N] sends the whole map right
    after ``register`` and again whenever it changes; each frame replaces the last). A request naming a
    public name runs its desired build when we have it, else its previous build (the one it is
    migrating from), else the name as it came (a 404 when it is none of ours)."""

    MAX_ENTRIES = 4096

    def __init__(self, known: Callable[[str], bool]) -> None:
        self._known = known
        self._builds: dict[str, tuple[str, str]] = {}

    def update(self, message: DesiredModels) -> None:
        self._builds = {m.model_name: (m.desired_build, m.previous_build)
                        for m in message.models[: self.MAX_ENTRIES] if m.model_name and m.desired_build}
        log.info("desired_models", count=len(self._builds))

    def resolve(self, name: str) -> str:
        builds = self._builds.get(name)
        if builds is None:
            return name
        return next((b for b in builds if b and self._known(b)), name)

    def as_json(self) -> dict[str, dict[str, str]]:
        return {name: {"desired_build": d, "previous_build": p} for name, (d, p) in sorted(self._builds.items())}


class ModelDirectives:
    """The agent's handler for coordinator-directed model frames (``Session(run_directive=...)``)."""

    def __init__(self, manager: ModelManager, *, runtime: Runtime | None = None, coordinator_url: str = "",
                 hf_cache_dir: Path | None = None, desired: DesiredBuilds | None = None) -> None:
        self._manager = manager
        self.desired = desired if desired is not None else DesiredBuilds(lambda m: manager.info(m) is not None)
        self._runtime = runtime
        self._coordinator_url = coordinator_url
        self._hf_cache_dir = hf_cache_dir
        self._prefetching: set[str] = set()

    async def __call__(self, message: LoadModel | PrefetchModel | DesiredModels, send: Send) -> None:
        match message:
            case LoadModel():
                await self.load(message, send)
            case PrefetchModel():
                await self.prefetch(message, send)
            case DesiredModels():
                self.desired.update(message)
            case _:
                log.debug("frame_ignored", kind=message.type, reason="not_handled")

    async def load(self, message: LoadModel, send: Send) -> None:
        model_id = message.model_id
        if not model_id or len(model_id) > MAX_MODEL_ID_CHARS:
            log.warning("load_model_ignored", reason="bad_model_id")
            return
        send(encode(LoadModelStatus(model_id=model_id, status="started")))
        log.info("load_model_started", model=model_id)
        if self._manager.draining:
            failure: Failure | None = Failure.draining()
        else:
            try:
                await self._manager.ensure_loaded(model_id)
                failure = None
            except SlotRefused as refused:
                failure = refused.failure
        if failure is None:
            send(encode(LoadModelStatus(model_id=model_id, status="succeeded")))
            log.info("load_model_succeeded", model=model_id)
            return
        word = failure_word(failure)
        send(encode(LoadModelStatus(model_id=model_id, status="failed", error=word)))
        log.warning("load_model_failed", model=model_id, reason=word)


    async def prefetch(self, message: PrefetchModel, send: Send) -> None:
        model_id = message.model_id
        if not model_id or len(model_id) > MAX_MODEL_ID_CHARS:
            log.warning("prefetch_model_ignored", reason="bad_model_id")
            return

        def status(state: str, **fields: object) -> None:
            send(encode(PrefetchModelStatus(model_id=model_id, status=state, **fields)))

        status("started")
        if model_id in self._prefetching:
            status("failed", error="in_progress")
            return
        self._prefetching.add(model_id)
        try:
            word = await self._prefetch(model_id, status, send)
        finally:
            self._prefetching.discard(model_id)
        if word is not None:
            status("failed", error=word)
            log.warning("prefetch_model_failed", model=model_id, reason=word)

    async def _prefetch(self, model_id: str, status: Callable[..., None], send: Send) -> str | None:
        """Download, verify, adopt and advertise; the failure's word, or None once verified."""
        if self._runtime is None or self._hf_cache_dir is None:
            return "not_supported"
        if self._manager.draining:
            return DRAINING_FOR_UPDATE
        if not valid_repo_id(model_id):
            return "bad_model_id"
        if self._manager.info(model_id) is not None:  # already here: nothing to fetch
            return "already_present"
        expected = await asyncio.to_thread(expected_weight_hash, self._coordinator_url, model_id)
        if expected is None:
            return "no_expected_hash"
        cache = self._hf_cache_dir
        folder_existed = repo_folder(cache, model_id).exists()
        loop = asyncio.get_running_loop()

        def progress(done: int, total: int) -> None:  # the download's thread, a few times a second
            loop.call_soon_threadsafe(lambda: status("downloading", bytes_done=done, bytes_total=total))

        try:
            plan = await asyncio.to_thread(plan_download, model_id, cache)
            check_disk(plan, cache)
            log.info("prefetch_model_downloading", model=model_id, size_bytes=plan.total_bytes,
                     missing_bytes=plan.missing_bytes)
            snapshot = await asyncio.to_thread(download, plan, cache, progress)
        except DownloadFailed as failed:
            return failed.reason
        digest = await asyncio.to_thread(weight_hash_sync, snapshot)
        info = inspect_model(snapshot, model_id, ModelSource.HF_CACHE) if digest == expected else None
        if not isinstance(info, ModelInfo) or not self._runtime.adopt(info, digest):
            if not folder_existed:  # what this prefetch brought: never found by a later start
                await asyncio.to_thread(shutil.rmtree, repo_folder(cache, model_id), True)
            return "weight_hash_mismatch" if digest != expected else "unservable"
        status("verified")
        log.info("prefetch_model_verified", model=model_id)
        send(encode(ModelsUpdate(models=advertised_models(self._manager.advertised_verdicts(),
                                                          self._runtime.weight_hashes.known()))))
        return None


__all__ = ["DRAINING_FOR_UPDATE", "DesiredBuilds", "ModelDirectives", "expected_weight_hash", "failure_word"]
