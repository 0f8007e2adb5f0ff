"""What the heartbeat reports about the models: per-slot state and token budgets, MLX counters,
`free_for_load`. Plain values in bytes and
tokens; the session converts to the wire's `*_gb` floats. Built by `ModelManager.capacity()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from memory import DeviceMemory, LedgerSnapshot, Pressure, default_max_tokens
from protocol.vocab import SlotState


@dataclass(frozen=True, slots=True)
class SlotCapacity:
    """One `backend_capacity.slots[]` entry."""

    model: str
    state: SlotState  # RUNNING when loaded, RELOADING while its load is in progress
    num_running: int
    num_waiting: int
    active_tokens: int  # prompt + generated tokens in the batch now
    max_tokens_potential: int  # output tokens the in-flight requests may still ask for (reserved)
    max_concurrency: int  # requests of the default size the token budget holds (≥ 1 when loaded)
    kv_bytes_per_token: int
    active_token_budget_used: int  # tokens reserved by in-flight requests
    active_token_budget_max: int  # used + what fits in the ledger's available bytes now
    model_load_time_ms: int | None


@dataclass(frozen=True, slots=True)
class CapacityReport:
    slots: tuple[SlotCapacity, ...]
    mlx_active_bytes: int
    mlx_peak_bytes: int
    mlx_cache_bytes: int
    total_memory_bytes: int  # P: physical after cgroup and operator limits
    free_for_load_bytes: int  # largest padded weight size loadable now, idle models counted as evictable
    available_bytes: int  # what a new reservation may take now (ledger)
    pressure: Pressure
    ledger: LedgerSnapshot
    device_memory: DeviceMemory = DeviceMemory.UNIFIED  # what total_memory_bytes is: the machine's RAM or a GPU's
    host_physical_bytes: int | None = None  # a discrete GPU's host RAM (None: unified, it is total_memory_bytes)
    host_available_bytes: int | None = None

    @property
    def warm_models(self) -> tuple[str, ...]:
        return tuple(s.model for s in self.slots if s.state is SlotState.RUNNING)


def max_concurrency(budget_max_tokens: int, context_length: int | None) -> int:
    """How many default-sized requests (`min(context, 8192)` tokens) the budget holds, at least 1."""
    per_request = max(1, default_max_tokens(context_length if context_length is not None else 2**62))
    return max(1, budget_max_tokens // per_request)
