"""The unified-memory policy. Pure arithmetic plus one ledger.

    Σ(resident weights) + KV + activations + reservations  ≤  effective cap

Modules:

* `policy`   cap math and env resolution: `figures()` → `CapFigures` and its methods; what env
             values were rejected or clamped (`PolicySettings.adjustments`); the room left for
             weights (`room_for_weights`, `largest_loadable_bytes`) and what leaves none
             (`no_room_causes`)
* `snapshot` `MemorySnapshot`, the one value everything else reads, the one rule for MLX's
             buffer cache (counted as used everywhere, reclaimed before any refusal or eviction) and
             the one for the process's other bytes (unattributed: counted as used beside MLX's)
* `probe`    the only module that reads the machine (psutil, MLX counters, cgroup v1/v2 files):
             `memory.probe.snapshot()` or a long-lived `Probe`
* `ledger`   the one process-wide reservation ledger (atomic check-and-insert, typed leases)
* `fit`      fit verdicts and `free_for_load_bytes` for register, heartbeat and doctor
* `media`    vision requests: projected decode bytes, the KV span, the request ceilings
* `grammar`  a constrained request's grammar and mask rows: one bounded figure (`grammar_bytes`)
* `activation` the activation reserve per model: a pass's memory as measured at load or estimated
             from the config, scaled to a full prefill window at the model's context
* `pressure` GREEN / YELLOW / RED / FATAL watermarks of projected utilization
* `mlx_limits` MLX's memory, buffer-cache and wired limits from the cap figures
* `settle`   the settle barrier after an unload

No other package does cap arithmetic; it calls these.
"""

from memory.activation import ActivationProfile, ModelShape, ReserveSource
from memory.fit import FitResult, FitVerdict, after_eviction, fit, free_for_load_bytes
from memory.ledger import Lease, Ledger, LedgerSnapshot, Rejection, RejectionReason, ReservationKind
from memory.media import (
    DEFAULT_SOFT_TOKENS_PER_IMAGE,
    MediaLimits,
    VisionReservation,
    VisionSpan,
    projected_decode_bytes,
    vision_reservation,
    vision_span,
)
from memory.mlx_limits import MlxLimits, mlx_limits
from memory.policy import (
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    MAX_BYTES,
    MIN_KV_BYTES,
    MIN_OS_BYTES,
    ROOM_CAUSE_SETTING,
    CapFigures,
    EnvAction,
    EnvAdjustment,
    GiB,
    PolicySettings,
    RequestKv,
    RoomCause,
    compute_figures,
    default_max_tokens,
    figures,
    gib,
    largest_loadable_bytes,
    no_room_causes,
    padded_weight_bytes,
    resolve_settings,
    room_for_weights,
)
from memory.pressure import Pressure, PressureLevel, pressure, pressure_thresholds
from memory.probe import Probe
from memory.settle import SettleResult, settle
from memory.snapshot import DeviceMemory, MemorySnapshot, MlxCounters

__all__ = [
    "ActivationProfile",
    "DeviceMemory",
    "ModelShape",
    "ReserveSource",
    "MAX_BYTES",
    "MIN_KV_BYTES",
    "MIN_OS_BYTES",
    "DEFAULT_ACTIVATION_RESERVE_BYTES",
    "DEFAULT_SOFT_TOKENS_PER_IMAGE",
    "CapFigures",
    "EnvAction",
    "EnvAdjustment",
    "FitResult",
    "FitVerdict",
    "GiB",
    "Lease",
    "Ledger",
    "LedgerSnapshot",
    "MediaLimits",
    "MemorySnapshot",
    "MlxCounters",
    "MlxLimits",
    "PolicySettings",
    "Pressure",
    "PressureLevel",
    "Probe",
    "Rejection",
    "RejectionReason",
    "RequestKv",
    "ROOM_CAUSE_SETTING",
    "RoomCause",
    "ReservationKind",
    "SettleResult",
    "VisionReservation",
    "VisionSpan",
    "after_eviction",
    "compute_figures",
    "default_max_tokens",
    "figures",
    "fit",
    "free_for_load_bytes",
    "gib",
    "largest_loadable_bytes",
    "mlx_limits",
    "no_room_causes",
    "padded_weight_bytes",
    "pressure",
    "pressure_thresholds",
    "projected_decode_bytes",
    "resolve_settings",
    "room_for_weights",
    "settle",
    "vision_reservation",
    "vision_span",
]
