"""The process's memory outside MLX and outside the ledger (`unattributed`), counted by the cap.

RSS that is neither an MLX buffer nor something the ledger books for the host (a body being parsed, a
grammar, decoded images, the SSD tier's index) is the Python heap, the allocator's slack, libraries:
memory the process holds that no figure foresaw. The cap math counts it beside MLX's usage, so its
growth narrows admission and raises the pressure level instead of crossing the cap.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from memory import Ledger, MemorySnapshot, Probe, ReservationKind, fit, pressure
from memory.fit import after_eviction
from memory.policy import GiB, compute_figures, figures
from memory.probe import read_mlx_counters
from memory.snapshot import DeviceMemory

MiB = 2**20
FIG = figures(16 * GiB, env={})  # eff_cap 12 GiB, A 3 GiB
HOST_KINDS = (ReservationKind.PROMPT, ReservationKind.GRAMMAR, ReservationKind.MEDIA)
DEVICE_KINDS = (ReservationKind.REQUEST_KV, ReservationKind.PENDING_LOAD, ReservationKind.PREFIX_CACHE)

sizes = st.integers(0, 20 * GiB)


@st.composite
def snapshots(draw) -> MemorySnapshot:
    physical = draw(st.integers(2 * GiB, 64 * GiB))
    active, cache = draw(sizes), draw(st.integers(0, 2 * GiB))
    outside = draw(st.integers(0, 8 * GiB))
    return MemorySnapshot(physical_bytes=physical, available_bytes=draw(st.integers(0, physical)),
                          mlx_active_bytes=active, mlx_cache_bytes=cache,
                          rss_bytes=active + cache + outside)


def test_rss_outside_mlx_is_unattributed_less_host_bookings() -> None:
    snap = MemorySnapshot(16 * GiB, 15 * GiB, mlx_active_bytes=2 * GiB, mlx_cache_bytes=GiB,
                          rss_bytes=3 * GiB + 700 * MiB)
    assert snap.outside_mlx_bytes == 700 * MiB
    assert snap.unattributed_bytes == 700 * MiB
    assert snap.counted_bytes == 3 * GiB + 700 * MiB
    booked = snap.booked(200 * MiB)  # what the ledger books for the host is counted there, not twice
    assert booked.unattributed_bytes == 500 * MiB
    assert snap.booked(GiB).unattributed_bytes == 0  # bookings not yet in RSS: no negative term


def test_a_discrete_gpu_counts_nothing_outside_mlx_against_its_cap() -> None:
    """There RSS is host RAM and the cap is of the GPU's memory: host bytes are not under it."""
    snap = MemorySnapshot(80 * GiB, 70 * GiB, mlx_active_bytes=2 * GiB, rss_bytes=5 * GiB,
                          device_memory=DeviceMemory.DISCRETE, host_physical_bytes=64 * GiB,
                          host_available_bytes=60 * GiB)
    assert snap.unattributed_bytes == 0 and snap.counted_bytes == 2 * GiB


def test_unattributed_narrows_admission_and_fit_by_its_bytes() -> None:
    quiet = MemorySnapshot(16 * GiB, 15 * GiB, mlx_active_bytes=4 * GiB, rss_bytes=4 * GiB)
    grown = replace(quiet, rss_bytes=4 * GiB + 900 * MiB)
    assert FIG.available_bytes(quiet) - FIG.available_bytes(grown) == 900 * MiB
    assert FIG.load_room_bytes(quiet) - FIG.load_room_bytes(grown) == 900 * MiB
    assert fit(FIG, quiet, GiB).room_now_bytes - fit(FIG, grown, GiB).room_now_bytes == 900 * MiB


def test_the_ledger_counts_unattributed_bytes_and_its_host_bookings_once() -> None:
    ledger = Ledger(FIG)
    snap = MemorySnapshot(16 * GiB, 15 * GiB, rss_bytes=GiB)  # 1 GiB outside MLX: 9 − 1 = 8 GiB
    assert ledger.available_bytes(snap) == 8 * GiB
    # A body being parsed: booked for the host and already in RSS: the unattributed term gives way.
    assert ledger.reserve("p", ReservationKind.PROMPT, 256 * MiB, snapshot=snap).granted
    assert ledger.host_booked_bytes() == 256 * MiB
    assert ledger.available_bytes(snap) == 8 * GiB
    # Request KV is MLX's (not yet allocated): it takes its bytes on top.
    assert ledger.reserve("k", ReservationKind.REQUEST_KV, GiB, snapshot=snap).granted
    assert ledger.available_bytes(snap) == 7 * GiB
    ledger.release("p")
    assert ledger.host_booked_bytes() == 0 and ledger.available_bytes(snap) == 7 * GiB


@given(snap=snapshots(), host=st.lists(st.tuples(st.sampled_from(HOST_KINDS), st.integers(0, 4 * GiB)), max_size=4),
       device=st.lists(st.tuples(st.sampled_from(DEVICE_KINDS), st.integers(0, 4 * GiB)), max_size=4),
       ask=st.integers(1, 16 * GiB), fraction=st.floats(0.5, 1.0), activation=st.integers(0, 4 * GiB))
def test_admission_never_admits_past_the_cap_whatever_the_unattributed_term(
        snap, host, device, ask, fraction, activation) -> None:
    cap = figures(snap.physical_bytes, env={}, cap_fraction=fraction, activation_reserve_gb=activation / GiB)
    ledger = Ledger(cap)
    for i, (kind, nbytes) in enumerate([*host, *device]):
        ledger.reserve(f"r{i}", kind, nbytes, snapshot=snap)
    # (a reservation of 0 bytes promises nothing, so it is granted even on a machine already past its cap)
    granted = ledger.reserve("ask", ReservationKind.REQUEST_KV, ask, snapshot=snap).granted
    if not granted:
        return
    by_kind = ledger.snapshot().bytes_by_kind
    host_booked = sum(by_kind[k] for k in ReservationKind if k.host_side)
    device_booked = ledger.outstanding_bytes() - host_booked
    # Every byte the process holds (RSS ≥ MLX's own), the host bookings it does not hold yet, what MLX was
    # promised and the activation reserve: under the effective cap and what the OS has.
    held = max(snap.rss_bytes, snap.mlx_used_bytes) + max(0, host_booked - snap.outside_mlx_bytes)
    assert held + device_booked + cap.activation_reserve_bytes <= cap.effective_cap_bytes
    assert snap.booked(host_booked).counted_bytes <= held


@given(snap=snapshots(), more=st.integers(0, 8 * GiB), incoming=st.integers(0, 8 * GiB))
def test_pressure_is_monotone_in_the_unattributed_term(snap, more, incoming) -> None:
    grown = replace(snap, rss_bytes=snap.rss_bytes + more)
    assert grown.unattributed_bytes == snap.unattributed_bytes + more
    low, high = pressure(snap, incoming_bytes=incoming), pressure(grown, incoming_bytes=incoming)
    assert high.utilization >= low.utilization and high.level >= low.level
    assert FIG.available_bytes(grown) <= FIG.available_bytes(snap)


@given(snap=snapshots(), evicted=st.integers(0, 20 * GiB))
def test_predictions_keep_the_unattributed_term(snap, evicted) -> None:
    """Clearing MLX's cache or evicting a model frees MLX's bytes, not the process's other bytes."""
    assert snap.after_reclaim().unattributed_bytes == snap.unattributed_bytes
    assert after_eviction(snap, evicted).unattributed_bytes == snap.unattributed_bytes


def test_the_probe_measures_this_process_outside_mlx_and_counts_the_ledgers_host_bookings() -> None:
    """From the OS and MLX, never faked: this test process holds an interpreter and libraries outside MLX."""
    probe = Probe(mlx_counters=read_mlx_counters)
    snap = probe.snapshot()
    assert snap.rss_bytes > snap.mlx_used_bytes and snap.unattributed_bytes > 0
    ledger = Ledger(compute_figures(snap.physical_bytes), sample=probe.recent)
    probe.host_booked = ledger.host_booked_bytes
    assert ledger.reserve("body", ReservationKind.PROMPT, 8 * MiB).granted
    assert probe.snapshot().host_booked_bytes == 8 * MiB
