"""The one place that reads the machine: psutil, MLX's counters and cgroup files → `MemorySnapshot`.

Cheap enough for every admission decision (see `benchmarks/memory_bench.py`): the static parts
(machine RAM, which cgroup files bind us) are found once when a `Probe` is built; each
`snapshot()` then costs one `psutil.virtual_memory()`, one RSS read, three MLX counter calls and,
only when a cgroup limit binds, a few small cgroup files. Call `Probe.refresh()` after the
container's limits change.

`snapshot()` at module level keeps one cached `Probe` per argument set, so callers that don't hold a
`Probe` still pay only the per-sample cost.

One reading shared by the requests that arrive together (`Probe.recent()`): admission asks for the
machine's memory several times per request, and a burst asks dozens of times within a few
milliseconds. `recent()` hands out the latest reading while it is younger than `max_age_s` (a few
milliseconds) and samples afresh otherwise; `snapshot()` always samples afresh, and its reading
becomes the shared one; `invalidate()` drops the shared reading, so the next `recent()` samples
(the model manager calls it when a model's weights come or go). Why a reading that old keeps the cap:

* the ledger is never cached: every decision reads its outstanding total live, under its lock, so a
  promise made since the reading (a request's KV, a load's claim, a prefix entry) is counted;
* what MLX allocates for us between the reading and the decision is covered by such a promise (a
  request's KV, a load's weights, a stored prefix) or by the activation reserve, so it is counted
  even though the reading does not show it yet; what it frees meanwhile only makes the reading
  pessimistic;
* a promise is dropped because its bytes became visible in the counters in one place only: a load's
  claim, released when the model is published, after the load's post-load guard sampled afresh
  (`snapshot()`, which replaces the shared reading) and before `invalidate()`; a reading taken
  before that sample is never handed out again;
* KV a request allocated and gave back inside the window sits in MLX's buffer cache, which the next
  reading counts as used, and MLX itself frees cached buffers before it allocates past the
  effective cap (memory/mlx_limits.py);
* other processes: any reading is already as old as its use; a few milliseconds more is what the
  operator reserve and the OS floor exist for.

Thread safety: a reading is published only if no `invalidate()` ran while it was taken, and never
replaces a later one.

The process's bytes outside MLX: each reading carries RSS beside MLX's counters and, through
`Probe.host_booked` (the ledger's `host_booked_bytes`, set once the ledger exists), what the ledger books
for host memory when it was taken; the snapshot derives the unattributed term from them
(memory/snapshot.py). The ledger takes the term again with its live host total for its own decisions.

MLX's peak: `reset_peak_memory()` starts MLX's peak afresh for a measurement (a load measures each
pass's peak: engine/calibration.py) while the readings keep reporting the process's peak since start.

The device (`read_device_memory`): on Apple silicon, and on MLX's CPU device, MLX allocates from the
machine's RAM, so the cap is taken of it (unified memory). On MLX's CUDA backend it allocates from
the GPU's own memory (`mx.device_info()["total_memory"]`): the cap is taken of that, what MLX holds
is set against it, and host RAM (which a cgroup bounds) is read and reported apart. Counting GPU
allocations against host RAM both under-uses a large GPU and misjudges a small one.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from memory import cgroup
from memory.policy import memory_limit_bytes_from_gb
from memory.snapshot import DeviceMemory, MemorySnapshot, MlxCounters

MlxCountersFn = Callable[[], MlxCounters]
SHARED_MAX_AGE_S = 0.005  # how long `Probe.recent()` hands out one reading
DeviceMemoryFn = Callable[[], int | None]  # a discrete GPU's memory in bytes; None: unified memory


_peak_before_reset = 0  # the process's MLX peak up to the last `reset_peak_memory()`
_peak_lock = threading.Lock()


def read_mlx_counters() -> MlxCounters:
    """MLX active / cache bytes, and the process's peak since start (imports `mlx.core` on first use)."""
    import mlx.core as mx  # deferred: the policy, ledger and tests of them never need MLX

    with _peak_lock:  # not between a reset's two steps
        peak = max(_peak_before_reset, mx.get_peak_memory())
    return MlxCounters(mx.get_active_memory(), mx.get_cache_memory(), peak)


def reset_peak_memory() -> None:
    """Start MLX's own peak afresh (`mx.get_peak_memory()` then reads the peak since now) for a measurement;
    `read_mlx_counters` goes on reporting the process's peak since start."""
    import mlx.core as mx

    global _peak_before_reset
    with _peak_lock:
        _peak_before_reset = max(_peak_before_reset, mx.get_peak_memory())
        mx.reset_peak_memory()


def no_mlx_counters() -> MlxCounters:
    """For a process that has not imported MLX (e.g. `doctor` before any load): all zeros."""
    return MlxCounters()


def read_device_memory() -> int | None:
    """The GPU's own memory when MLX's default device is a discrete GPU (the CUDA backend), else None
    (Apple silicon's GPU shares the machine's RAM; MLX's CPU device is the machine's RAM)."""
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.gpu or mx.metal.is_available():
        return None
    total = mx.device_info().get("total_memory")
    return int(total) if isinstance(total, int) and total > 0 else None


def unified_memory() -> int | None:
    """For a process that must not import MLX, or a test of unified memory: no discrete GPU."""
    return None


class Probe:
    """Samples coherent `MemorySnapshot`s. Build once, call `snapshot()` as often as needed.

    `rss`: how the process's resident bytes are read (default: psutil's reading of this process); a test
    rig emulating a machine whose memory is MLX's alone passes its own."""

    def __init__(
        self,
        memory_limit_gb: float | None = None,
        *,
        cgroup_root: Path = cgroup.DEFAULT_ROOT,
        proc_cgroup: Path = cgroup.PROC_SELF_CGROUP,
        mlx_counters: MlxCountersFn = read_mlx_counters,
        virtual_memory: Callable[[], Any] = psutil.virtual_memory,
        clock: Callable[[], float] = time.monotonic,
        device_memory: DeviceMemoryFn = read_device_memory,
        max_age_s: float = SHARED_MAX_AGE_S,
        rss: Callable[[], int] | None = None,
    ) -> None:
        self._max_age_s = max_age_s
        self._shared: tuple[float, MemorySnapshot] | None = None  # (when its sampling began, the reading)
        self._generation = 0  # bumped by `invalidate()`: a reading begun before it is not shared
        self._shared_lock = threading.Lock()
        self._memory_limit_bytes = memory_limit_bytes_from_gb(memory_limit_gb)
        self._device_memory = device_memory
        self._cgroup_root = Path(cgroup_root)
        self._proc_cgroup = Path(proc_cgroup)
        self._mlx_counters = mlx_counters
        self._virtual_memory = virtual_memory
        self._clock = clock
        self._process = psutil.Process()
        self._rss = rss if rss is not None else self._own_rss
        # What the ledger books for host memory now (`Ledger.host_booked_bytes`); set once the ledger exists.
        self.host_booked: Callable[[], int] = _nothing_booked
        self.refresh()

    def refresh(self) -> None:
        """Re-read the static parts: machine RAM, a discrete GPU's memory, the cgroup levels that carry
        a limit."""
        self._host_bytes = int(self._virtual_memory().total)
        self._gpu_bytes = self._device_memory()
        self._cgroup_levels = cgroup.locate(self._cgroup_root, self._proc_cgroup)
        self.invalidate()  # a reading of the old limits is not shared any more

    @property
    def device(self) -> DeviceMemory:
        return DeviceMemory.UNIFIED if self._gpu_bytes is None else DeviceMemory.DISCRETE

    @property
    def machine_bytes(self) -> int:
        """What MLX allocates from, before any limit: the machine's RAM, or a discrete GPU's memory."""
        return self._host_bytes if self._gpu_bytes is None else self._gpu_bytes

    @property
    def cgroup_levels(self) -> tuple[cgroup.CgroupLevel, ...]:
        return self._cgroup_levels

    def recent(self) -> MemorySnapshot:
        """The shared reading while it is younger than `max_age_s`, else a fresh `snapshot()`. For
        decisions that also read the ledger live (see the module docstring for why that is safe)."""
        shared = self._shared
        if shared is not None and self._clock() - shared[0] <= self._max_age_s:
            return shared[1]
        return self.snapshot()

    def invalidate(self) -> None:
        """Something the counters will show changed (a model's weights came or went): the next
        `recent()` samples afresh, and a reading under way now is not shared."""
        with self._shared_lock:
            self._generation += 1
            self._shared = None

    def snapshot(self) -> MemorySnapshot:
        """Physical (after cgroup and operator limits), OS-available, MLX counters and RSS, now.
        The reading becomes the one `recent()` shares."""
        generation, began = self._generation, self._clock()
        snap = self._sample()
        with self._shared_lock:
            if generation == self._generation and (self._shared is None or self._shared[0] <= began):
                self._shared = (began, snap)
        return snap

    def _own_rss(self) -> int:
        return int(self._process.memory_info().rss)

    def _sample(self) -> MemorySnapshot:
        counters = self._mlx_counters()
        vm = self._virtual_memory()
        rss = self._rss()
        reading = cgroup.read(self._cgroup_levels) if self._cgroup_levels else cgroup.CgroupReading(None, None)

        host = self._host_bytes
        host_available = int(vm.available)
        if reading.limit_bytes is not None:
            host = min(host, reading.limit_bytes)
        if reading.available_bytes is not None:
            host_available = min(host_available, reading.available_bytes)
        if self._gpu_bytes is None:  # unified: the machine's RAM is what MLX allocates from
            physical, available = host, host_available
        else:  # discrete: the GPU's memory, less what MLX holds of it (other processes' use is not seen)
            physical = self._gpu_bytes
            available = self._gpu_bytes - counters.active_bytes - counters.cache_bytes
        if self._memory_limit_bytes is not None:
            physical = min(physical, self._memory_limit_bytes)
        discrete = self._gpu_bytes is not None
        return MemorySnapshot(
            physical_bytes=physical,
            available_bytes=max(0, available),
            mlx_active_bytes=counters.active_bytes,
            mlx_cache_bytes=counters.cache_bytes,
            mlx_peak_bytes=counters.peak_bytes,
            rss_bytes=rss,
            machine_bytes=self.machine_bytes,
            cgroup_limit_bytes=None if discrete else reading.limit_bytes,  # a cgroup bounds host RAM only
            memory_limit_bytes=self._memory_limit_bytes,
            taken_at=self._clock(),
            device_memory=self.device,
            host_physical_bytes=host if discrete else None,
            host_available_bytes=max(0, host_available) if discrete else None,
            host_booked_bytes=max(0, self.host_booked()),
        )


def _nothing_booked() -> int:
    return 0


@functools.lru_cache(maxsize=16)
def _probe_for(memory_limit_gb: float | None, cgroup_root: Path, mlx_counters: MlxCountersFn) -> Probe:
    return Probe(memory_limit_gb, cgroup_root=cgroup_root, mlx_counters=mlx_counters)


def snapshot(
    memory_limit_gb: float | None = None,
    *,
    cgroup_root: Path = cgroup.DEFAULT_ROOT,
    mlx_counters: MlxCountersFn = read_mlx_counters,
) -> MemorySnapshot:
    """One snapshot from a cached `Probe` for these arguments (static parts found on first call)."""
    return _probe_for(memory_limit_gb, Path(cgroup_root), mlx_counters).snapshot()
