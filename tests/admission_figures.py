"""Hand-built inputs for provider/slots' pure decisions: no MLX.

The machine: P = 16 GiB, f = 0.9, R_cfg = 4 GiB, A = 3 GiB →
hard_cap = min(14.4, 14) = 14 GiB, eff_cap = min(14, 12) = 12 GiB, load_headroom = A + MIN_KV = 4 GiB,
a single request may claim at most hard_cap / 2 = 7 GiB of KV. MLX active = Σ resident weights.
"""

from __future__ import annotations

from pathlib import Path

from memory import GiB, MemorySnapshot, figures
from provider.models import DType, KvAccuracy, KvLayout, ModelInfo, ModelSource
from provider.slots import ManagerView, ModelState, SlotView

MiB = 2**20
FIG = figures(16 * GiB, env={}, memory_reserve_gb=4.0, activation_reserve_gb=3.0, cap_fraction=0.9)


def model(model_id: str, on_disk: int, *, per_token: int = MiB, context: int | None = 8192) -> ModelInfo:
    layout = KvLayout(dtype_bytes=2, full_layers=1, bytes_per_token=per_token, sliding=(), recurrent_layers=0,
                      accuracy=KvAccuracy.EXACT)
    return ModelInfo(model_id, Path("/models") / model_id, ModelSource.MODEL_DIR, None, (), on_disk, "llama",
                     None, DType.FLOAT16, context, layout)


def slot(model_id: str, state: ModelState = ModelState.LOADED, *, busy: bool = False, last_used: float = 0.0,
         resident: int = 0) -> SlotView:
    return SlotView(model_id, state, busy, last_used, resident)


def view(*slots: SlotView, max_slots: int = 3, draining: bool = False, outstanding: int = 0,
         request_kv: int = 0) -> ManagerView:
    return ManagerView({s.model_id: s for s in slots}, max_slots, draining, outstanding, request_kv)


def snap(*slots: SlotView, extra_active: int = 0) -> MemorySnapshot:
    active = sum(s.resident_bytes for s in slots) + extra_active
    return MemorySnapshot(physical_bytes=16 * GiB, available_bytes=16 * GiB - active, mlx_active_bytes=active)
