"""memory.fit and memory.pressure: verdicts, free_for_load, watermarks."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memory.fit import FitVerdict, fit, free_for_load_bytes
from memory.ledger import Ledger, ReservationKind
from memory.policy import GiB, figures, padded_weight_bytes
from memory.pressure import PressureLevel, level_for, pressure, projected_utilization
from memory.snapshot import MemorySnapshot

FIG64 = figures(64 * GiB, env={})  # eff_cap 57.6 GiB, load headroom 4 GiB
IDLE64 = MemorySnapshot(physical_bytes=64 * GiB, available_bytes=62 * GiB)


def test_verdicts_on_a_64_gib_box() -> None:
    # 20 GiB on disk → 24 GiB padded → 28 GiB required: fits on an idle box.
    r = fit(FIG64, IDLE64, 20 * GiB)
    assert r.verdict is FitVerdict.FITS_NOW and r.fits and r.ever_fits
    assert r.weights_bytes == 24 * GiB and r.required_bytes == 28 * GiB
    assert r.cap_bytes == FIG64.effective_cap_bytes

    # A 30 GiB model is resident: 57.6 − 30 = 27.6 GiB room < 28 → needs eviction if it is idle.
    busy = replace(IDLE64, mlx_active_bytes=30 * GiB, available_bytes=32 * GiB)
    r = fit(FIG64, busy, 20 * GiB, evictable_bytes=[30 * GiB])
    assert r.verdict is FitVerdict.FITS_AFTER_EVICTION
    assert math.isclose(r.room_now_bytes / GiB, 27.6, abs_tol=1e-8)
    # ... and too large right now if the resident model has work in flight (not evictable).
    r = fit(FIG64, busy, 20 * GiB)
    assert r.verdict is FitVerdict.TOO_LARGE and r.ever_fits and not r.fits

    # Never fits under the cap: 50 GiB on disk → 60 padded + 4 > 57.6.
    r = fit(FIG64, IDLE64, 50 * GiB)
    assert r.verdict is FitVerdict.TOO_LARGE and not r.ever_fits


def test_outstanding_reservations_and_os_available_count() -> None:
    assert fit(FIG64, IDLE64, 20 * GiB, outstanding_bytes=30 * GiB).verdict is FitVerdict.TOO_LARGE
    starved = replace(IDLE64, available_bytes=20 * GiB)  # other processes hold the rest
    assert fit(FIG64, starved, 20 * GiB).verdict is FitVerdict.TOO_LARGE


def test_worked_register_numbers_small_boxes() -> None:
    """8 GiB box: eff_cap 4 GiB = exactly the 4 GiB load headroom, so nothing can load."""
    f8 = figures(8 * GiB, env={})
    idle8 = MemorySnapshot(physical_bytes=8 * GiB, available_bytes=7 * GiB)
    assert free_for_load_bytes(f8, idle8) == 0
    assert fit(f8, idle8, 1).verdict is FitVerdict.TOO_LARGE
    # 16 GiB box: eff_cap 12 → 8 GiB of padded weights (6.67 GiB on disk) at most.
    f16 = figures(16 * GiB, env={})
    idle16 = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=15 * GiB)
    assert free_for_load_bytes(f16, idle16) == 8 * GiB
    assert fit(f16, idle16, 8 * GiB * 5 // 6).verdict is FitVerdict.FITS_NOW
    assert fit(f16, idle16, 8 * GiB * 5 // 6 + 1).verdict is FitVerdict.TOO_LARGE


def test_free_for_load_counts_idle_models() -> None:
    busy = replace(IDLE64, mlx_active_bytes=30 * GiB, mlx_cache_bytes=GiB, available_bytes=30 * GiB)
    base = free_for_load_bytes(FIG64, busy)
    assert base == FIG64.effective_cap_bytes - 31 * GiB - 4 * GiB
    assert free_for_load_bytes(FIG64, busy, evictable_bytes=[10 * GiB, 20 * GiB]) == \
        FIG64.effective_cap_bytes - GiB - 4 * GiB


@given(
    on_disk=st.integers(1, 80 * GiB),
    active=st.integers(0, 60 * GiB),
    cache=st.integers(0, 4 * GiB),
    available=st.integers(0, 64 * GiB),
    evictable=st.lists(st.integers(0, 20 * GiB), max_size=3),
    outstanding=st.integers(0, 10 * GiB),
)
def test_fit_agrees_with_free_for_load_and_the_ledger(on_disk, active, cache, available, evictable, outstanding):
    snap = MemorySnapshot(physical_bytes=64 * GiB, available_bytes=available,
                          mlx_active_bytes=active, mlx_cache_bytes=cache)
    r = fit(FIG64, snap, on_disk, evictable_bytes=evictable, outstanding_bytes=outstanding)
    free = free_for_load_bytes(FIG64, snap, evictable_bytes=evictable, outstanding_bytes=outstanding)
    # What heartbeats advertise is exactly what fits.
    assert r.fits == (padded_weight_bytes(on_disk) <= free)
    # "fits now" is exactly what the ledger's atomic claim admits (weights_est + MIN_KV).
    ledger = Ledger(FIG64)
    assert ledger.reserve("other", ReservationKind.MEDIA, outstanding, snapshot=IDLE64).granted
    claim = ledger.claim_pending_load("load", r.weights_bytes + FIG64.min_kv_bytes, snapshot=snap)
    assert claim.granted == (r.verdict is FitVerdict.FITS_NOW)


# -- pressure -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("u", "level"),
    [(0.0, PressureLevel.GREEN), (0.6499, PressureLevel.GREEN), (0.65, PressureLevel.YELLOW),
     (0.7999, PressureLevel.YELLOW), (0.80, PressureLevel.RED), (0.8999, PressureLevel.RED),
     (0.90, PressureLevel.FATAL), (1.7, PressureLevel.FATAL), (math.nan, PressureLevel.FATAL)],
)
def test_watermarks(u: float, level: PressureLevel) -> None:
    assert level_for(u) is level


def test_projected_pressure_counts_the_cache_like_the_cap_math_and_adds_the_load() -> None:
    """One rule for MLX's buffer cache. It counts as used in pressure exactly as in the cap
    math (both read `mlx_used_bytes`), and `after_reclaim()` is what a clear would make of it."""
    snap = MemorySnapshot(physical_bytes=100 * GiB, available_bytes=50 * GiB,
                          mlx_active_bytes=40 * GiB, mlx_cache_bytes=20 * GiB)
    assert projected_utilization(snap) == 0.60 == snap.mlx_used_bytes / snap.physical_bytes
    cleared = snap.after_reclaim()
    assert (cleared.mlx_cache_bytes, cleared.available_bytes, cleared.mlx_active_bytes) == (0, 70 * GiB, 40 * GiB)
    assert snap.reclaimable_bytes == 20 * GiB and cleared.reclaimable_bytes == 0 and cleared.after_reclaim() is cleared
    now = pressure(cleared)
    assert now.level is PressureLevel.GREEN and not now.evict_before_load and now.wire_value == 0.4
    assert pressure(snap).level is PressureLevel.GREEN and pressure(snap).wire_value == 0.6
    load = pressure(cleared, incoming_bytes=30 * GiB, overhead_bytes=3 * GiB)
    assert math.isclose(load.utilization, 0.73) and load.level is PressureLevel.YELLOW and load.evict_before_load
    over = pressure(cleared, incoming_bytes=80 * GiB)
    assert over.level is PressureLevel.FATAL and over.utilization > 1 and over.wire_value == 1.0
    f = figures(100 * GiB, env={})
    # The cap math sees the same 60 GiB and the room a clear would give.
    assert f.load_room_bytes(cleared) - f.load_room_bytes(snap) == 20 * GiB
    assert pressure(MemorySnapshot(physical_bytes=0, available_bytes=0)).level is PressureLevel.FATAL
    assert PressureLevel.RED > PressureLevel.YELLOW > PressureLevel.GREEN
