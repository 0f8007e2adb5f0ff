"""The engine's side of the prefix cache (`kvcache.ModelKvCache`): what a prompt reuses, what a
finished request leaves behind, and the SSD tier's quiet writes. Engine thread only.

A prompt reuses the longest cached prefix of at least `kvcache.manager.REUSE_MIN_TOKENS` tokens (or
its whole prompt): a private copy of that KV joins the batch with the rest of the prompt. A finished
request's whole sequence (prompt + completion) is kept once the step's tokens are out (`keep`, then
`store_kept` after the step's delivery), and its `Finished` event waits for the store, so whoever
sees a request finish sees its sequence in the prefix cache. mlx-lm's `BatchGenerator` feeds every
token it returns through the model in the same step (and `extract` drops the batch's left padding),
so the returned cache holds exactly prompt + completion, EOS included; `store` keeps it under as
many of those tokens as the cache holds, so KV is only ever kept under the tokens it was made from.

The cache is an optimisation, never a reason to fail a request: every error here is logged and the
request goes on as if nothing was cached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvcache import state
from kvcache.bits import KvBits
from kvcache.manager import MISS, REUSE_MIN_TOKENS, ModelKvCache, Reuse
from provider.engine.active import Active, Keep, PrefixCacheLookup, Slot
from provider.engine.commands import EventSink
from provider.engine.types import Event
from provider.telemetry import get_logger

log = get_logger("provider.engine")

SHARE_MIN_TOKENS = 32  # a queued prompt sharing at least this many more tokens gets the prompt stored


class PrefixReuse:
    """The prefix caches of the engine's models (`lookup`: model id -> its cache, or None)."""

    def __init__(self, lookup: PrefixCacheLookup | None) -> None:
        self._lookup = lookup
        self.kept: list[Keep] = []  # finished sequences to store once the step's tokens are out

    @property
    def enabled(self) -> bool:
        return self._lookup is not None

    def kv(self, model_id: str) -> ModelKvCache | None:
        """The model's prefix cache, or None (no prefix cache, or none for this model)."""
        return self._lookup(model_id) if self._lookup is not None else None

    def cached_tokens(self, model_id: str, ids: list[int]) -> int:
        """How many leading prompt tokens `reuse` would take (no copy)."""
        kv = self.kv(model_id)
        if kv is None:
            return 0
        try:
            matched = kv.longest_match(ids)
        except Exception:  # an edge: see the module docstring
            log.exception("prefix_cache_lookup_failed", model=model_id)
            return 0
        return matched if matched >= min(REUSE_MIN_TOKENS, len(ids) - 1) else 0

    def reuse(self, model_id: str, ids: list[int], kv_bits: KvBits | None = None) -> Reuse:
        """The longest cached prefix of the prompt worth reusing (a private copy), or MISS; only KV
        kept as the model keeps it now (`kv_bits`: quantized in that form, None: its dtype)."""
        kv = self.kv(model_id)
        if kv is None:
            return MISS
        try:
            found = kv.fetch(ids, min_tokens=REUSE_MIN_TOKENS)
        except Exception:  # an edge: see the module docstring
            log.exception("prefix_cache_fetch_failed", model=model_id)
            return MISS
        if found.cache is not None and state.quantization(found.cache) != kv_bits:
            return MISS  # another setting's KV: never mixed into this batch
        return found

    def keep(self, model_id: str, active: Active, cache: list | None) -> None:
        """Keep a finished request's whole sequence (prompt + completion) for the next turn."""
        if self._lookup is not None and cache:
            self.kept.append(Keep(model_id, active, cache))

    def holds_finish_of(self, active: Active) -> Keep | None:
        """The pending store of `active`'s sequence, if its `Finished` is to wait for it."""
        return self.kept[-1] if self.kept and self.kept[-1].active is active else None

    def store_kept(self, emit: Callable[[EventSink, Event], None]) -> None:
        kept, self.kept = self.kept, []
        for keep in kept:
            kv = self.kv(keep.model_id)
            try:
                if kv is not None:
                    kv.store(keep.active.prompt_ids + keep.active.completion_ids, keep.cache,
                             extends=keep.active.reused_key, reused=keep.active.reused)
            except Exception:  # an edge: see the module docstring
                log.exception("prefix_cache_store_failed", model=keep.model_id)
            if keep.finished is not None:
                emit(*keep.finished)

    def share_prompt(self, slot: Slot, active: Active, cache: list) -> None:
        """Store a prompt whose KV a queued request would reuse beyond what the cache holds for it (a
        burst on one cold system prompt: the queued ones then reuse the first one's prefill)."""
        kv = self.kv(slot.info.model_id)
        if kv is None:
            return
        ids = active.prompt_ids
        need = active.reused + SHARE_MIN_TOKENS
        if not any(common_prefix(ids, q.prompt_ids, need) >= need for q in slot.queue):
            return
        try:
            kv.store(ids, cache, extends=active.reused_key, reused=active.reused)
        except Exception:  # an edge: see the module docstring
            log.exception("prefix_cache_store_failed", model=slot.info.model_id)

    def write_quiet(self, slots: Iterable[Slot]) -> float | None:
        """Let each model's prefix cache write its quiet turns to SSD; seconds until the next is due."""
        if self._lookup is None:
            return None
        waits = []
        for slot in slots:
            kv = self.kv(slot.info.model_id)
            if kv is None:
                continue
            in_use = {a.reused_key for a in slot.actives() if a.reused_key is not None}
            try:
                wait = kv.write_quiet(in_use)
            except Exception:  # an edge: see the module docstring
                log.exception("prefix_cache_write_failed", model=slot.info.model_id)
                continue
            if wait is not None:
                waits.append(max(wait, 0.0))
        return min(waits, default=None)


def common_prefix(a: Sequence[int], b: Sequence[int], enough: int) -> int:
    """Length of the common prefix of `a` and `b`, counted no further than `enough`."""
    n = min(len(a), len(b), enough)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


__all__ = ["SHARE_MIN_TOKENS", "PrefixReuse", "common_prefix"]
