"""One coherent reading of the machine's memory, as a plain value.

`memory.probe` produces these; everything else in `memory/` only reads them, so the policy, the
ledger, fit verdicts and pressure levels are pure functions of a snapshot and tests build snapshots
by hand instead of faking MLX or the OS.

The one rule for MLX's buffer cache (freed buffers MLX keeps for reuse, `mx.get_cache_memory()`):

* it is counted as used, everywhere: `mlx_used_bytes` (active + cache) is what the cap math, the
  ledger, fit verdicts, `free_for_load_gb` *and* the pressure watermark read, because the memory is
  resident until cleared and the OS's available figure already counts it as taken;
* it is reclaimable (`reclaimable_bytes`): one `mx.clear_cache()` on the engine thread frees it, and
  `after_reclaim()` is the snapshot as it will be then. So nothing refuses a request or evicts a model
  while the cache holds bytes: the model manager clears it first and decides again, and a decision
  that only predicts (fast admission) is taken on `after_reclaim()` when the real snapshot refuses;
* it is bounded: the engine caps it (`memory.mlx_limits`), so it cannot grow to tens of GiB between
  two decisions.

The rule for the process's other memory (`unattributed_bytes`): every byte the process holds is under
the cap, not only MLX's. With unified memory, RSS beyond MLX's active + cache bytes is the interpreter,
libraries, Python objects, the allocator's free-but-kept slack and buffers no figure foresaw. Part of
it the ledger already books (a body being parsed, a grammar, decoded images, the SSD tier's index:
`host_booked_bytes`, set from the ledger's host-side reservations); the rest is *unattributed* and is
counted as used beside MLX's bytes (`counted_bytes`) by the cap math and the pressure level, so growth
nobody foresaw narrows admission instead of crossing the cap. A booking not yet in RSS does not make the
term negative: it is counted in full by the ledger, and the process's bytes once. On a discrete GPU the
cap is of the GPU's memory and RSS is host RAM: nothing of it is counted against that cap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class DeviceMemory(StrEnum):
    """Where MLX allocates from, which is the memory the cap is taken of."""

    UNIFIED = "unified"  # the machine's RAM (Apple silicon's GPU, MLX's CPU device)
    DISCRETE = "discrete"  # a GPU's own memory (MLX's CUDA backend); host RAM is counted apart


@dataclass(frozen=True, slots=True)
class MlxCounters:
    """MLX allocator counters, in bytes (`mx.get_active_memory()` / `get_cache_memory()` / `get_peak_memory()`)."""

    active_bytes: int = 0
    cache_bytes: int = 0
    peak_bytes: int = 0


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """Memory figures sampled together at one instant (bytes, monotonic seconds).

    `physical_bytes` is the policy's `P`: the memory MLX allocates from, lowered to the operator's
    `memory_limit_gb` when that is smaller. With unified memory that is the machine's RAM, lowered to
    the cgroup limit too; `available_bytes` (the policy's `sys_avail`) is then OS-available memory,
    lowered to what the cgroup still allows when one binds. On a discrete GPU (`device_memory`) it is
    the GPU's memory, and `available_bytes` what MLX has not taken of it; host RAM, which a cgroup
    bounds there, is `host_physical_bytes` / `host_available_bytes` (None with unified memory).
    """

    physical_bytes: int
    available_bytes: int
    mlx_active_bytes: int = 0
    mlx_cache_bytes: int = 0
    mlx_peak_bytes: int = 0
    rss_bytes: int = 0
    machine_bytes: int | None = None  # psutil total before any limit (None: same as physical_bytes)
    cgroup_limit_bytes: int | None = None  # effective cgroup memory limit, None when unlimited / no cgroup
    memory_limit_bytes: int | None = None  # operator memory_limit_gb in bytes, None when unset
    taken_at: float = 0.0  # time.monotonic() when sampled
    device_memory: DeviceMemory = DeviceMemory.UNIFIED
    host_physical_bytes: int | None = None  # discrete GPU only: host RAM (cgroup-lowered)
    host_available_bytes: int | None = None  # discrete GPU only: host RAM available
    host_booked_bytes: int = 0  # the ledger's host-side reservations when sampled (see `booked`)

    def __post_init__(self) -> None:
        for name in ("physical_bytes", "available_bytes", "mlx_active_bytes", "mlx_cache_bytes",
                     "mlx_peak_bytes", "rss_bytes", "host_booked_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def mlx_used_bytes(self) -> int:
        """`mlx_used` = MLX active + cache: every resident model's weights and KV, plus freed-but-kept buffers."""
        return self.mlx_active_bytes + self.mlx_cache_bytes

    @property
    def outside_mlx_bytes(self) -> int:
        """What the process holds beyond MLX's buffers (RSS − active − cache), with unified memory; 0 on
        a discrete GPU, whose cap RSS (host RAM) is not part of."""
        if self.device_memory is DeviceMemory.DISCRETE:
            return 0
        return max(0, self.rss_bytes - self.mlx_used_bytes)

    @property
    def unattributed_bytes(self) -> int:
        """The process's bytes outside MLX that the ledger does not book either (module docstring)."""
        return max(0, self.outside_mlx_bytes - self.host_booked_bytes)

    @property
    def counted_bytes(self) -> int:
        """What the cap math and the pressure level count as the process's now: MLX's usage + unattributed."""
        return self.mlx_used_bytes + self.unattributed_bytes

    def booked(self, host_bytes: int) -> MemorySnapshot:
        """This reading with the ledger's host-side reservations (`Ledger.host_booked_bytes()`) taken off the
        unattributed term: they are counted by the ledger already."""
        host = max(0, host_bytes)
        return self if host == self.host_booked_bytes else replace(self, host_booked_bytes=host)

    @property
    def unlimited_physical_bytes(self) -> int:
        """`P` before the operator's memory_limit_gb: the machine, lowered to a cgroup limit only."""
        physical = self.machine_bytes or self.physical_bytes
        return min(physical, self.cgroup_limit_bytes) if self.cgroup_limit_bytes else physical

    @property
    def reclaimable_bytes(self) -> int:
        """What `mx.clear_cache()` gives back now: MLX's buffer cache."""
        return self.mlx_cache_bytes

    def after_reclaim(self) -> MemorySnapshot:
        """This snapshot as it will be once the cache is cleared: the cache is gone and the OS has it
        (RSS with it: the process's other bytes stay what they are)."""
        if not self.mlx_cache_bytes:
            return self
        return replace(self, mlx_cache_bytes=0, available_bytes=self.available_bytes + self.mlx_cache_bytes,
                       rss_bytes=max(0, self.rss_bytes - self.mlx_cache_bytes))
