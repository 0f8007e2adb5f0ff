"""Which memory the agent reports: the heartbeat, doctor and /status say whether the
capacity figures are the machine's RAM (unified: Apple silicon, MLX's CPU device) or a GPU's own
memory (discrete: MLX's CUDA backend), with the host's RAM beside it in the discrete case. The probe's
arithmetic for a discrete GPU is in test_memory_probe."""

from __future__ import annotations

import json

from memory import DeviceMemory, Ledger, MemorySnapshot, pressure
from memory.policy import GiB, figures
from protocol import encode
from provider.config import Settings
from provider.doctor import report_json, run_doctor
from provider.jobs.stats import ServingStats
from provider.session.heartbeat import HeartbeatSource
from provider.slots import CapacityReport


def report(device: DeviceMemory, host: int | None = None) -> CapacityReport:
    snap = MemorySnapshot(physical_bytes=140 * GiB, available_bytes=100 * GiB, mlx_active_bytes=40 * GiB)
    return CapacityReport(slots=(), mlx_active_bytes=40 * GiB, mlx_peak_bytes=41 * GiB, mlx_cache_bytes=0,
                          total_memory_bytes=140 * GiB, free_for_load_bytes=90 * GiB, available_bytes=90 * GiB,
                          pressure=pressure(snap), ledger=Ledger(figures(16 * GiB, env={})).snapshot(),
                          device_memory=device, host_physical_bytes=host,
                          host_available_bytes=None if host is None else host // 2)


def heartbeat_memory(r: CapacityReport) -> dict:
    frame = HeartbeatSource(stats=ServingStats(), capacity=lambda: r, cpu_percent=lambda: 0.0)()
    capacity = json.loads(encode(frame))["backend_capacity"]
    return {"total": capacity["total_memory_gb"], **capacity["telemetry"]["memory"]}


def test_the_heartbeat_says_which_memory_its_figures_are_of():
    assert heartbeat_memory(report(DeviceMemory.DISCRETE, host=126 * GiB)) == {
        "total": 140.0, "device": "discrete", "host_total_gb": 126.0, "host_available_gb": 63.0}
    assert heartbeat_memory(report(DeviceMemory.UNIFIED)) == {"total": 140.0, "device": "unified"}


def test_doctor_says_so_for_this_machine(tmp_path):
    settings = Settings(state_dir=tmp_path / "state", hf_cache_dir=tmp_path / "hub")
    machine = report_json(run_doctor(settings, check_coordinator_url=False))["machine"]
    assert machine["device_memory"] == "unified" and machine["host_physical_bytes"] is None
