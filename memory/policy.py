"""The cap arithmetic: every figure of the unified-memory cap, derived in one place.

    Σ(resident weights) + KV + activations + other reserved bytes  ≤  effective cap

Use it in two steps. `resolve_settings()` reads the `DARKBLOOM_*` environment once (and logs one
warning per rejected variable); `compute_figures(P, settings)` turns a physical size into a frozen
`CapFigures`, whose methods answer every question the rest of the provider asks (live headroom,
KV budget, per-request KV bytes, post-load guard). `figures()` does both at once. Nothing here
touches MLX, psutil or the clock; snapshots come in as arguments.

Precedence for every input: explicit argument → env → default. `cap_fraction` /
`activation_reserve_gb` are explicit when not None; `memory_reserve_gb` (default 4.0) and
`memory_limit_gb` (default None) are explicit when they differ from their defaults, so values that
provider/config resolved from TOML, env or flags win, and a bare `figures(P)` reads
`DARKBLOOM_MEMORY_RESERVE_GB` / `DARKBLOOM_MEMORY_LIMIT_GB`. Pass `env={}` to ignore the
environment. Env values that are missing, blank, not numbers, NaN, ±inf or ≤ 0 count as unset
(one warning each, naming the variable, the value given and the value used). A fraction above 1 is
clamped to 1. Every such adjustment is also kept in `PolicySettings.adjustments`, so `doctor` can
list them. Explicit values are clamped but honoured. Byte figures saturate at `MAX_BYTES` instead
of overflowing.

`room_for_weights(figures)` is what is left for weights on an idle machine once every reserve is
held back; `no_room_causes()` names the inputs that leave none for a model of any size (an absurd
reserve, a machine below the OS floor).

The activation reserve `A` is each model's own (memory/activation.py: the prefill window measured at
its load, or its config's estimate before one) unless the operator set one
(`DARKBLOOM_ACTIVATION_RESERVE_GB`, or an explicit value: `activation_reserve_set`), which then holds
for every model. `CapFigures.activation_reserve_bytes` is the reserve in force: `for_models(reserves)`
gives the figures while those models are loaded (one engine thread runs one pass at a time, so the
largest of their reserves; 0 with none), and a load needs `weights + reserve_for(its reserve) + MIN_KV`.
The live figures count the process's bytes outside MLX too (`MemorySnapshot.counted_bytes`: MLX's
usage plus the unattributed term, memory/snapshot.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

import structlog

from memory.snapshot import MemorySnapshot

GiB = 2**30
MAX_BYTES = 2**63 - 1  # saturation ceiling: the largest int64, what JSON peers and counters can carry

DEFAULT_CAP_FRACTION = 0.90
DEFAULT_ACTIVATION_RESERVE_BYTES = 3 * GiB
DEFAULT_MEMORY_RESERVE_GB = 4.0
MIN_OS_BYTES = 2 * GiB  # absolute OS floor under the hard cap
MIN_KV_BYTES = 1 * GiB  # a freshly loaded model must be able to serve at least this much KV
DEFAULT_MAX_TOKENS_CEILING = 8192  # max_tokens default: min(context_length, 8192)

ENV_CAP_FRACTION = "DARKBLOOM_MEM_CAP_FRACTION"
ENV_ACTIVATION_RESERVE_GB = "DARKBLOOM_ACTIVATION_RESERVE_GB"
ENV_MEMORY_RESERVE_GB = "DARKBLOOM_MEMORY_RESERVE_GB"
ENV_MEMORY_LIMIT_GB = "DARKBLOOM_MEMORY_LIMIT_GB"


def saturate(nbytes: int | float) -> int:
    """Clamp a byte count into [0, MAX_BYTES] (NaN → 0); never raises on huge or infinite input."""
    if isinstance(nbytes, float):
        if math.isnan(nbytes) or nbytes <= 0:
            return 0
        if nbytes >= MAX_BYTES:
            return MAX_BYTES
        return int(nbytes)
    return 0 if nbytes <= 0 else min(int(nbytes), MAX_BYTES)


def gib_to_bytes(gb: float) -> int:
    """GiB (float) → bytes, floored, saturating at MAX_BYTES; negative or NaN → 0."""
    if math.isnan(gb) or gb <= 0:
        return 0
    if gb >= MAX_BYTES / GiB:
        return MAX_BYTES
    return saturate(gb * GiB)


def gib(nbytes: int) -> float:
    """Bytes → GiB as a float, for display and the wire's `*_gb` fields."""
    return nbytes / GiB


def padded_weight_bytes(on_disk_weight_bytes: int) -> int:
    """Weights estimate before load: on-disk bytes × 1.2, rounded up, saturating."""
    n = saturate(on_disk_weight_bytes)
    return saturate(-(-n * 6 // 5))  # exact ceil(n × 1.2) in integers


def default_max_tokens(context_length: int) -> int:
    """The output budget of a request that does not set `max_tokens`: min(context, 8192)."""
    return max(0, min(context_length, DEFAULT_MAX_TOKENS_CEILING))


# --------------------------------------------------------------------------------------------
# Settings: explicit → env → default, resolved once


class EnvAction(StrEnum):
    REJECTED = "rejected"  # not a finite number > 0: the default was used
    CLAMPED = "clamped"  # a fraction above 1: 1 was used


GIVEN_MAX_CHARS = 16  # a value that is not a number is shown at most this long


@dataclass(frozen=True, slots=True)
class EnvAdjustment:
    """One environment value the policy did not use as given. Names and numbers only: `given` is
    the number as parsed when it is a finite number, else the text cut to GIVEN_MAX_CHARS."""

    variable: str
    given: float | str
    used: float | None  # in the variable's own unit (a fraction, GiB); None = no limit
    action: EnvAction

    @property
    def rule(self) -> str:
        """What the variable allows, in words (fixed text)."""
        if self.action is EnvAction.CLAMPED:
            return "a fraction above 1 is clamped to 1"
        return "must be a finite number > 0"


def _given(raw: str) -> float | str:
    text = raw.strip()
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if math.isfinite(number):
        return number
    return text if len(text) <= GIVEN_MAX_CHARS else text[:GIVEN_MAX_CHARS] + "…"


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """The resolved inputs of the cap math (everything except `P`)."""

    cap_fraction: float = DEFAULT_CAP_FRACTION
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES
    memory_reserve_bytes: int = int(DEFAULT_MEMORY_RESERVE_GB * GiB)
    memory_limit_bytes: int | None = None
    activation_reserve_set: bool = False  # the operator's reserve (explicit or env): every model's, unmeasured
    # What resolving had to reject or clamp (reported by doctor); not part of the inputs' identity.
    adjustments: tuple[EnvAdjustment, ...] = field(default=(), compare=False)


def _warn(event: str, **fields: object) -> None:
    # A fresh logger per (rare) warning: it honours the structlog config current at the time, even
    # when loggers are cached on first use elsewhere, so capture_logs() in tests always sees it.
    structlog.get_logger(__name__).warning(event, **fields)


def _adjust(adjustments: list[EnvAdjustment], variable: str, raw: str, used: float | None,
            action: EnvAction) -> None:
    adjustment = EnvAdjustment(variable, _given(raw), used, action)
    adjustments.append(adjustment)
    _warn(f"memory_env_{action.value}", variable=variable, given=adjustment.given, used=used)


def _env_positive(env: Mapping[str, str], name: str, default: float | None,
                  adjustments: list[EnvAdjustment]) -> float | None:
    """A finite, > 0 number from env, or None (missing/blank: silently; anything else: recorded
    as REJECTED with `default` as the value used, and one warning)."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and value > 0:
        return value
    _adjust(adjustments, name, raw, default, EnvAction.REJECTED)
    return None


def _explicit_fraction(value: float) -> float:
    # Programmatic values are honoured but clamped; only NaN is meaningless.
    return DEFAULT_CAP_FRACTION if math.isnan(value) else min(1.0, max(0.0, value))


def resolve_settings(
    env: Mapping[str, str] | None = None,
    *,
    memory_reserve_gb: float = DEFAULT_MEMORY_RESERVE_GB,
    memory_limit_gb: float | None = None,
    cap_fraction: float | None = None,
    activation_reserve_gb: float | None = None,
) -> PolicySettings:
    """Resolve the policy inputs from explicit values, env (`None` = `os.environ`) and defaults.

    Logs exactly one `memory_env_rejected` warning (`variable`, `given`, `used`) per env variable
    that is set but unusable, and one `memory_env_clamped` warning for a fraction above 1; both
    are also returned in `.adjustments`.
    """
    env = os.environ if env is None else env
    adjustments: list[EnvAdjustment] = []

    if cap_fraction is not None:
        fraction = _explicit_fraction(cap_fraction)
    else:
        fraction = _env_positive(env, ENV_CAP_FRACTION, DEFAULT_CAP_FRACTION, adjustments) or DEFAULT_CAP_FRACTION
        if fraction > 1.0:
            _adjust(adjustments, ENV_CAP_FRACTION, env[ENV_CAP_FRACTION], 1.0, EnvAction.CLAMPED)
            fraction = 1.0

    if activation_reserve_gb is not None:
        activation_set = not math.isnan(activation_reserve_gb)
        activation = gib_to_bytes(activation_reserve_gb) if activation_set else DEFAULT_ACTIVATION_RESERVE_BYTES
    else:
        env_activation = _env_positive(env, ENV_ACTIVATION_RESERVE_GB, DEFAULT_ACTIVATION_RESERVE_BYTES / GiB,
                                       adjustments)
        activation_set = env_activation is not None
        activation = DEFAULT_ACTIVATION_RESERVE_BYTES if env_activation is None else gib_to_bytes(env_activation)

    # The reserve and the limit arrive from config; a value at its default counts as "not set".
    reserve_gb = DEFAULT_MEMORY_RESERVE_GB if math.isnan(memory_reserve_gb) else memory_reserve_gb
    if reserve_gb == DEFAULT_MEMORY_RESERVE_GB:
        reserve_gb = (_env_positive(env, ENV_MEMORY_RESERVE_GB, DEFAULT_MEMORY_RESERVE_GB, adjustments)
                      or DEFAULT_MEMORY_RESERVE_GB)
    reserve = gib_to_bytes(reserve_gb)

    limit_gb = memory_limit_gb
    if limit_gb is None:
        limit_gb = _env_positive(env, ENV_MEMORY_LIMIT_GB, None, adjustments)
    limit = memory_limit_bytes_from_gb(limit_gb)

    return PolicySettings(cap_fraction=fraction, activation_reserve_bytes=activation,
                          memory_reserve_bytes=reserve, memory_limit_bytes=limit,
                          activation_reserve_set=activation_set, adjustments=tuple(adjustments))


def memory_limit_bytes_from_gb(memory_limit_gb: float | None) -> int | None:
    """Operator memory limit in bytes; None, NaN, ±inf and ≤ 0 mean "no limit"."""
    if memory_limit_gb is None or not math.isfinite(memory_limit_gb) or memory_limit_gb <= 0:
        return None
    return max(1, gib_to_bytes(memory_limit_gb))


# --------------------------------------------------------------------------------------------
# Figures


@dataclass(frozen=True, slots=True)
class RequestKv:
    """KV bytes one request reserves: `kv_bytes_per_token × tokens`, tokens clamped to the context."""

    tokens: int  # prompt + output tokens, clamped to the context window
    max_tokens: int  # output tokens budgeted after the clamp
    nbytes: int
    limit_bytes: int  # a single request may never claim more than half the hard cap

    @property
    def within_limit(self) -> bool:
        return self.nbytes <= self.limit_bytes


@dataclass(frozen=True, slots=True)
class CapFigures:
    """Every derived figure for one physical size `P` (all ints, bytes). Build with `figures()`."""

    physical_bytes: int  # P, after the operator memory limit
    cap_fraction: float  # f
    activation_reserve_bytes: int  # A in force (`for_models`); the operator's when `activation_reserve_set`
    memory_reserve_bytes: int  # R_cfg
    memory_limit_bytes: int | None
    hard_cap_bytes: int  # min(f·P, P − MIN_OS), 0 when P ≤ MIN_OS
    effective_cap_bytes: int  # min(hard_cap, P − R_cfg): the live ceiling
    load_reserve_bytes: int  # max(R_cfg, P − hard_cap): what the load gate holds back
    load_headroom_bytes: int  # A + MIN_KV: needed above the weights for a load to be worth it
    min_kv_bytes: int = MIN_KV_BYTES
    min_os_bytes: int = MIN_OS_BYTES
    activation_reserve_set: bool = False  # the operator's A: every model's, whatever was measured

    @property
    def single_request_limit_bytes(self) -> int:
        """The most KV one request may ever reserve: half the hard cap."""
        return self.hard_cap_bytes // 2

    def for_models(self, reserves: Iterable[int]) -> CapFigures:
        """The figures while models of these activation reserves are loaded (or loading): A is the
        largest of them, 0 with none (one engine thread: one pass at a time). Unchanged when the operator
        set A."""
        if self.activation_reserve_set:
            return self
        activation = max((saturate(r) for r in reserves), default=0)
        if activation == self.activation_reserve_bytes:
            return self
        return replace(self, activation_reserve_bytes=activation,
                       load_headroom_bytes=saturate(activation + self.min_kv_bytes))

    def reserve_for(self, model_reserve_bytes: int | None) -> int:
        """A once a model of this reserve is loaded too (None: the one in force); the operator's A when set."""
        if self.activation_reserve_set or model_reserve_bytes is None:
            return self.activation_reserve_bytes
        return max(self.activation_reserve_bytes, saturate(model_reserve_bytes))

    def kv_budget_bytes(self, resident_weight_bytes: int, ram_prefix_bytes: int = 0,
                        activation_reserve_bytes: int | None = None) -> int:
        """Static planning budget: max(0, hard_cap − W − A − ram_prefix), A `reserve_for` the model's."""
        claimed = (saturate(resident_weight_bytes) + self.reserve_for(activation_reserve_bytes)
                   + saturate(ram_prefix_bytes))
        return max(0, self.hard_cap_bytes - claimed)

    def load_room_bytes(self, snapshot: MemorySnapshot, outstanding_bytes: int = 0) -> int:
        """Room under the live ceiling before the activation reserve, net of reservations:
        max(0, min(eff_cap − counted, sys_avail) − outstanding), counted = mlx_used + the process's
        unattributed bytes (memory/snapshot.py). A load fits iff `required_load_bytes ≤` this (the same test
        `Ledger.claim_pending_load` makes)."""
        under_cap = self.effective_cap_bytes - snapshot.counted_bytes
        return max(0, min(under_cap, snapshot.available_bytes) - saturate(outstanding_bytes))

    def live_headroom_bytes(self, snapshot: MemorySnapshot) -> int:
        """live_headroom = max(0, min(eff_cap − counted, sys_avail) − A)."""
        return max(0, self.load_room_bytes(snapshot) - self.activation_reserve_bytes)

    def available_bytes(self, snapshot: MemorySnapshot, outstanding_bytes: int = 0) -> int:
        """available = max(0, live_headroom − Σ outstanding reservations)."""
        return max(0, self.live_headroom_bytes(snapshot) - saturate(outstanding_bytes))

    def required_load_bytes(self, weights_estimate_bytes: int, activation_reserve_bytes: int | None = None) -> int:
        """What a load needs free: weights_est + `reserve_for(the model's reserve)` + MIN_KV (saturating);
        without a reserve, weights_est + load_headroom."""
        return saturate(saturate(weights_estimate_bytes) + self.reserve_for(activation_reserve_bytes)
                        + self.min_kv_bytes)

    def load_is_serveable(self, snapshot: MemorySnapshot, outstanding_bytes: int = 0, *,
                          kv_floor_bytes: int | None = None) -> bool:
        """Post-load guard, checked once a load has finished: measured live headroom ≥ MIN_KV + outstanding
        reservations. `kv_floor_bytes` replaces MIN_KV when requests booked with the load already reserve part of
        it (they are in `outstanding_bytes`): the floor is then what is left of MIN_KV."""
        floor = self.min_kv_bytes if kv_floor_bytes is None else max(0, min(self.min_kv_bytes, kv_floor_bytes))
        return self.live_headroom_bytes(snapshot) >= floor + saturate(outstanding_bytes)

    def request_kv(self, *, kv_bytes_per_token: int, prompt_tokens: int, context_length: int,
                   max_tokens: int | None = None) -> RequestKv:
        """Per-request KV bytes: `kv_bytes_per_token × min(prompt + max_tokens, context)`.

        `max_tokens=None` means the request did not set it: `min(context_length, 8192)`.
        Check `.within_limit` (≤ half the hard cap) before reserving; the ledger refuses the rest.
        """
        context = max(0, context_length)
        prompt = max(0, prompt_tokens)
        output = default_max_tokens(context) if max_tokens is None else max(0, max_tokens)
        tokens = min(prompt + output, context)
        return RequestKv(tokens=tokens, max_tokens=max(0, tokens - prompt),
                         nbytes=saturate(max(0, kv_bytes_per_token) * tokens),
                         limit_bytes=self.single_request_limit_bytes)


def compute_figures(physical_bytes: int, settings: PolicySettings | None = None) -> CapFigures:
    """The cap figures (hard cap, effective cap, load reserve and headroom) for physical size
    `physical_bytes` under resolved `settings` (no env read)."""
    s = settings or PolicySettings()
    p = saturate(physical_bytes)
    if s.memory_limit_bytes is not None:
        p = min(p, s.memory_limit_bytes)
    by_fraction = saturate(p * s.cap_fraction)  # float product: exact enough, floored
    hard_cap = 0 if p <= MIN_OS_BYTES else min(by_fraction, p - MIN_OS_BYTES)
    effective = max(0, min(hard_cap, p - s.memory_reserve_bytes))
    return CapFigures(
        physical_bytes=p,
        cap_fraction=s.cap_fraction,
        activation_reserve_bytes=s.activation_reserve_bytes,
        memory_reserve_bytes=s.memory_reserve_bytes,
        memory_limit_bytes=s.memory_limit_bytes,
        hard_cap_bytes=hard_cap,
        effective_cap_bytes=effective,
        load_reserve_bytes=max(s.memory_reserve_bytes, p - hard_cap),
        load_headroom_bytes=saturate(s.activation_reserve_bytes + MIN_KV_BYTES),
        activation_reserve_set=s.activation_reserve_set,
    )


def figures(
    physical_bytes: int,
    *,
    env: Mapping[str, str] | None = None,
    memory_reserve_gb: float = DEFAULT_MEMORY_RESERVE_GB,
    memory_limit_gb: float | None = None,
    cap_fraction: float | None = None,
    activation_reserve_gb: float | None = None,
) -> CapFigures:
    """Resolve settings (env `None` = `os.environ`) and compute the figures for `physical_bytes`.

    Resolving logs env warnings, so long-lived callers resolve once with `resolve_settings()` and
    call `compute_figures()` afterwards.
    """
    settings = resolve_settings(env, memory_reserve_gb=memory_reserve_gb, memory_limit_gb=memory_limit_gb,
                                cap_fraction=cap_fraction, activation_reserve_gb=activation_reserve_gb)
    return compute_figures(physical_bytes, settings)


# --------------------------------------------------------------------------------------------
# Room for weights


def room_for_weights(figures: CapFigures) -> int:
    """The largest padded weight size that can load on an otherwise idle machine:
    max(0, eff_cap − load_headroom). 0 means no model of any size can ever load."""
    return max(0, figures.effective_cap_bytes - figures.load_headroom_bytes)


def largest_loadable_bytes(figures: CapFigures) -> int:
    """The largest on-disk weight size that loads on an idle machine (room ÷ 1.2, floored), the
    inverse of `padded_weight_bytes`."""
    room = room_for_weights(figures)
    n = room * 5 // 6
    while n > 0 and padded_weight_bytes(n) > room:  # ceil(n × 1.2) may overshoot by one byte
        n -= 1
    return n


class RoomCause(StrEnum):
    """An input of the cap math that leaves no room for any model (see `no_room_causes`)."""

    MEMORY_RESERVE = "memory_reserve"  # R_cfg: the operator OS reserve (memory_reserve_gb)
    ACTIVATION_RESERVE = "activation_reserve"  # A (DARKBLOOM_ACTIVATION_RESERVE_GB)
    MEMORY_LIMIT = "memory_limit"  # memory_limit_gb lowers P
    CAP_FRACTION = "cap_fraction"  # f (DARKBLOOM_MEM_CAP_FRACTION)
    SMALL_MACHINE = "small_machine"  # P itself: nothing else would make room


# What the operator calls each input of the cap math (a config key, or this module's own variable).
ROOM_CAUSE_SETTING: dict[RoomCause, str] = {
    RoomCause.MEMORY_RESERVE: "memory_reserve_gb",
    RoomCause.ACTIVATION_RESERVE: ENV_ACTIVATION_RESERVE_GB,
    RoomCause.MEMORY_LIMIT: "memory_limit_gb",
    RoomCause.CAP_FRACTION: ENV_CAP_FRACTION,
    RoomCause.SMALL_MACHINE: "physical memory",
}


def no_room_causes(physical_bytes: int, settings: PolicySettings) -> tuple[RoomCause, ...]:
    """Why no model of any size can load on this machine with these settings; () when one can.

    A model's activation reserve is its own (a small model's is small) unless the operator set one,
    so the room is `room_for_weights` of the idle figures (`for_models(())`). Each input is named when
    moving it alone to its most generous value (reserve 0, the operator's activation reserve unset, no
    limit, fraction 1) would make room. When no single input would, every input that is not at that
    value is named; SMALL_MACHINE when not even all of them together would."""
    def room(s: PolicySettings) -> int:
        return room_for_weights(compute_figures(physical_bytes, s).for_models(()))

    if room(settings) > 0:
        return ()
    generous = {
        RoomCause.MEMORY_RESERVE: replace(settings, memory_reserve_bytes=0),
        RoomCause.ACTIVATION_RESERVE: replace(settings, activation_reserve_bytes=0, activation_reserve_set=False),
        RoomCause.MEMORY_LIMIT: replace(settings, memory_limit_bytes=None),
        RoomCause.CAP_FRACTION: replace(settings, cap_fraction=1.0),
    }
    if not settings.activation_reserve_set:
        del generous[RoomCause.ACTIVATION_RESERVE]  # every model's own already: nothing to lower
    alone = tuple(cause for cause, s in generous.items() if s != settings and room(s) > 0)
    if alone:
        return alone
    most_generous = PolicySettings(cap_fraction=1.0, activation_reserve_bytes=0, memory_reserve_bytes=0)
    if room(most_generous) == 0:
        return (RoomCause.SMALL_MACHINE,)  # P ≤ MIN_OS: no setting can help
    return tuple(cause for cause, s in generous.items() if s != settings)
