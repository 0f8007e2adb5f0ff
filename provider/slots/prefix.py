"""The model manager's side of the prefix KV cache (kvcache/), and the post-load KV check.

`PrefixRoom` wraps the process's `kvcache.manager.KvCacheManager` (or nothing, when prefix reuse
is off) with what the manager needs:

* `evictable_bytes()`: the RAM tier's ledger bytes. Fast admission counts them as available
  (read-only): a full prefix cache must not make admission refuse what `serve` could admit,
  because `serve` evicts entries before it refuses (entries give way to live requests
  and loads, least recently used first);
* `evict_for(nbytes)` when the ledger refused a request's KV or a load claim (then one retry);
* `relieve(level)`: under RED pressure or worse the whole RAM tier goes;
* `attach(model_id)` after a load is published (with its weight hash, computed off-loop by
  the `WeightHashes` callable the runtime passes), `purge(model_id)` on every unload.

Eviction and relief only drop references and return leases, so they run on the loop; the purge
deletes the model's SSD files and runs in a worker thread.

`with_measured_kv(info, measured)` is the check "after load, verify against the
engine's real cache and keep the larger".
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from kvcache.manager import KvCacheManager, PrefixCacheStats
from memory import PressureLevel
from provider.models import KvAccuracy, ModelInfo
from provider.slots.state import log

WeightHashes = Callable[[str], Awaitable[str]]  # model id -> its weight hash (cached, off-loop)


class PrefixRoom:
    """The prefix cache as the model manager sees it; every method is a no-op without one."""

    def __init__(self, cache: KvCacheManager | None, weight_hash: WeightHashes | None) -> None:
        if cache is not None and weight_hash is None:
            raise ValueError("a prefix cache needs weight hashes (entries are bound to the weights)")
        self.cache = cache
        self._weight_hash = weight_hash

    @property
    def enabled(self) -> bool:
        return self.cache is not None

    def evictable_bytes(self, ledger_prefix_bytes: int) -> int:
        return ledger_prefix_bytes if self.cache is not None else 0

    def evict_for(self, nbytes: int, *, reason: str) -> int:
        if self.cache is None or nbytes <= 0:
            return 0
        freed = self.cache.evict_for(nbytes)
        if freed:
            log.info("prefix_cache_evicted", reason=reason, needed_bytes=nbytes, freed_bytes=freed)
        return freed

    def relieve(self, level: PressureLevel) -> int:
        if self.cache is None:
            return 0
        freed = self.cache.relieve(level)
        if freed:
            log.info("prefix_cache_relieved", pressure=level.name.lower(), freed_bytes=freed)
        return freed

    async def attach_hash(self, model_id: str) -> str | None:
        """The weight hash to attach under, or None (the model then serves without prefix reuse)."""
        if self.cache is None or self._weight_hash is None:
            return None
        try:
            return await self._weight_hash(model_id)
        except OSError as exc:
            log.warning("prefix_cache_unavailable", model=model_id, exc_type=type(exc).__name__)
            return None

    def attach(self, model_id: str, weight_hash: str | None) -> None:
        """Synchronous, so it happens in the same step as the publish."""
        if self.cache is None or weight_hash is None:
            return
        try:
            self.cache.attach(model_id, weight_hash)
        except (RuntimeError, OSError) as exc:  # a leftover attach or an unwritable SSD root
            log.warning("prefix_cache_unavailable", model=model_id, exc_type=type(exc).__name__)

    async def purge(self, model_id: str) -> None:
        if self.cache is not None:
            result = await asyncio.to_thread(self.cache.purge, model_id)
            log.debug("prefix_cache_purged", model=model_id, ram_bytes=result.ram_bytes,
                      disk_bytes=result.disk_bytes)

    def stats(self) -> PrefixCacheStats:
        return self.cache.stats() if self.cache is not None else PrefixCacheStats()


def with_measured_kv(info: ModelInfo, measured_bytes_per_token: int) -> ModelInfo:
    """`info` with its KV growth raised to the measured figure when that is larger (the difference
    is counted as full-attention growth: an upper bound), else `info` unchanged."""
    estimate = info.kv.max_bytes_per_token
    if measured_bytes_per_token <= estimate:
        if measured_bytes_per_token < estimate:
            log.info("kv_bytes_per_token_checked", model=info.id, estimate_bytes=estimate,
                     measured_bytes=measured_bytes_per_token, result="estimate")
        return info
    log.warning("kv_bytes_per_token_checked", model=info.id, estimate_bytes=estimate,
                measured_bytes=measured_bytes_per_token, result="measured")
    note = "; ".join(filter(None, (info.kv.note, "raised to the KV growth measured after load")))
    kv = dataclasses.replace(info.kv, bytes_per_token=info.kv.bytes_per_token + measured_bytes_per_token - estimate,
                             accuracy=KvAccuracy.APPROXIMATE, note=note)
    return dataclasses.replace(info, kv=kv)
