"""Fit verdicts: can a model of given on-disk size load here, now or after evicting idle models?

`register`, heartbeats (`free_for_load_gb`) and `doctor` all call these two functions, so what is
advertised can never drift from what the load gate (`Ledger.claim_pending_load`) enforces: a
model fits now iff `weights_est + A + MIN_KV ≤ min(eff_cap − counted, sys_avail) − outstanding`, where A is
`figures.reserve_for(the model's activation reserve)` (memory/activation.py) and counted is MLX's usage
plus the process's unattributed bytes (memory/snapshot.py).

Evicting idle models is modelled as their resident bytes leaving MLX's usage and returning to
the OS: `mlx_used − evictable`, `sys_avail + evictable`. Pass as `evictable_bytes` the resident
size of every model that is loaded and idle (no in-flight or queued request, not loading or
unloading): its measured resident delta, or its padded estimate when that is all there is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum

from memory.policy import CapFigures, padded_weight_bytes, saturate
from memory.snapshot import MemorySnapshot


class FitVerdict(StrEnum):
    FITS_NOW = "fits_now"
    FITS_AFTER_EVICTION = "fits_after_eviction"
    TOO_LARGE = "too_large"  # does not fit even after evicting every idle model


@dataclass(frozen=True, slots=True)
class FitResult:
    verdict: FitVerdict
    weights_bytes: int  # padded estimate: on-disk × 1.2
    required_bytes: int  # weights_bytes + load_headroom
    cap_bytes: int  # the effective cap
    room_now_bytes: int  # what a load may use now
    room_after_eviction_bytes: int  # what a load may use after evicting every idle model
    ever_fits: bool  # required ≤ effective cap: it would fit on an otherwise empty machine

    @property
    def fits(self) -> bool:
        return self.verdict is not FitVerdict.TOO_LARGE


def _total(evictable_bytes: int | Iterable[int]) -> int:
    if isinstance(evictable_bytes, int):
        return saturate(evictable_bytes)
    return saturate(sum(saturate(n) for n in evictable_bytes))


def after_eviction(snapshot: MemorySnapshot, evictable: int) -> MemorySnapshot:
    """The snapshot as it will be once `evictable` resident bytes have left MLX and gone back to the OS."""
    if evictable == 0:
        return snapshot
    active = max(0, snapshot.mlx_active_bytes - evictable)
    leftover = max(0, evictable - snapshot.mlx_active_bytes)  # an estimate larger than active eats cache
    cache = max(0, snapshot.mlx_cache_bytes - leftover)
    freed = snapshot.mlx_used_bytes - active - cache  # RSS loses MLX's bytes only: the unattributed term stays
    return replace(snapshot, mlx_active_bytes=active, mlx_cache_bytes=cache,
                   rss_bytes=max(0, snapshot.rss_bytes - freed),
                   available_bytes=saturate(snapshot.available_bytes + evictable))


def fit(
    figures: CapFigures,
    snapshot: MemorySnapshot,
    weight_bytes_on_disk: int,
    *,
    evictable_bytes: int | Iterable[int] = 0,
    outstanding_bytes: int = 0,
    activation_reserve_bytes: int | None = None,
) -> FitResult:
    """Verdict for a model whose weight files total `weight_bytes_on_disk`.

    `outstanding_bytes`: the ledger's outstanding reservations (`Ledger.outstanding_bytes()`).
    `activation_reserve_bytes`: the model's own reserve (None: the one in force).
    """
    weights = padded_weight_bytes(weight_bytes_on_disk)
    required = figures.required_load_bytes(weights, activation_reserve_bytes)
    room_now = figures.load_room_bytes(snapshot, outstanding_bytes)
    room_after = figures.load_room_bytes(after_eviction(snapshot, _total(evictable_bytes)), outstanding_bytes)
    if required <= room_now:
        verdict = FitVerdict.FITS_NOW
    elif required <= room_after:
        verdict = FitVerdict.FITS_AFTER_EVICTION
    else:
        verdict = FitVerdict.TOO_LARGE
    return FitResult(verdict=verdict, weights_bytes=weights, required_bytes=required,
                     cap_bytes=figures.effective_cap_bytes, room_now_bytes=room_now,
                     room_after_eviction_bytes=room_after,
                     ever_fits=required <= figures.effective_cap_bytes)


def free_for_load_bytes(
    figures: CapFigures,
    snapshot: MemorySnapshot,
    *,
    evictable_bytes: int | Iterable[int] = 0,
    outstanding_bytes: int = 0,
) -> int:
    """The largest padded weight size loadable now, counting idle models as evictable
    (heartbeat `backend_capacity.free_for_load_gb`). A model fits iff its padded size ≤ this."""
    room = figures.load_room_bytes(after_eviction(snapshot, _total(evictable_bytes)), outstanding_bytes)
    return max(0, room - figures.load_headroom_bytes)
