"""memory.policy: worked numbers of the memory policy, env edge cases, derived budgets."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from memory.policy import (
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    MAX_BYTES,
    MIN_KV_BYTES,
    EnvAction,
    GiB,
    PolicySettings,
    RoomCause,
    compute_figures,
    default_max_tokens,
    figures,
    largest_loadable_bytes,
    no_room_causes,
    padded_weight_bytes,
    resolve_settings,
    room_for_weights,
)
from memory.snapshot import MemorySnapshot

FRACTION = "DARKBLOOM_MEM_CAP_FRACTION"
ACTIVATION = "DARKBLOOM_ACTIVATION_RESERVE_GB"
RESERVE = "DARKBLOOM_MEMORY_RESERVE_GB"
LIMIT = "DARKBLOOM_MEMORY_LIMIT_GB"


def close_to(nbytes: int, gib_value: float) -> bool:
    return abs(nbytes - gib_value * GiB) <= 1  # f·P is floored to whole bytes


# -- Cap figures, worked numbers (default f = 0.9, R_cfg = 4 GiB, idle box) ------------------------

@pytest.mark.parametrize(
    ("physical_gib", "hard_cap_gib", "eff_cap_gib", "load_reserve_gib"),
    [
        (128, 115.2, 115.2, 12.8),
        (64, 57.6, 57.6, 6.4),
        (32, 28.8, 28.0, 4.0),  # config-bound: P − R_cfg < f·P
        (16, 14.0, 12.0, 4.0),  # 2 GiB OS floor binds the hard cap
        (8, 6.0, 4.0, 4.0),  # hard cap 6 (floor), eff_cap 4
    ],
)
def test_worked_numbers(physical_gib: int, hard_cap_gib: float, eff_cap_gib: float, load_reserve_gib: float) -> None:
    f = figures(physical_gib * GiB, env={})
    assert f.physical_bytes == physical_gib * GiB
    assert f.cap_fraction == 0.9
    assert close_to(f.hard_cap_bytes, hard_cap_gib)
    assert close_to(f.effective_cap_bytes, eff_cap_gib)
    assert close_to(f.load_reserve_bytes, load_reserve_gib)
    assert f.load_headroom_bytes == 3 * GiB + 1 * GiB  # A + MIN_KV
    assert f.min_kv_bytes == MIN_KV_BYTES == GiB
    assert f.activation_reserve_bytes == DEFAULT_ACTIVATION_RESERVE_BYTES == 3 * GiB
    # The load gate's view and the cap agree: P − load_reserve is the effective cap.
    assert f.physical_bytes - f.load_reserve_bytes == f.effective_cap_bytes


def test_worked_live_headroom_on_idle_box() -> None:
    """Idle 64 GiB box: live headroom = eff_cap − A; available shrinks by outstanding reservations."""
    f = figures(64 * GiB, env={})
    idle = MemorySnapshot(physical_bytes=64 * GiB, available_bytes=62 * GiB)
    assert f.live_headroom_bytes(idle) == f.effective_cap_bytes - 3 * GiB
    assert f.available_bytes(idle, 10 * GiB) == f.effective_cap_bytes - 13 * GiB
    # sys_avail binds when another process holds memory.
    busy = MemorySnapshot(physical_bytes=64 * GiB, available_bytes=20 * GiB, mlx_active_bytes=30 * GiB)
    assert f.live_headroom_bytes(busy) == 17 * GiB
    # Never negative.
    full = MemorySnapshot(physical_bytes=64 * GiB, available_bytes=GiB, mlx_active_bytes=60 * GiB)
    assert f.live_headroom_bytes(full) == 0 and f.available_bytes(full, GiB) == 0


def test_tiny_and_zero_machines() -> None:
    for p in (0, 1, 2 * GiB):
        f = figures(p, env={})
        assert f.hard_cap_bytes == 0 and f.effective_cap_bytes == 0
        assert f.load_reserve_bytes == 4 * GiB


def test_memory_limit_lowers_p_and_binds_eff_cap() -> None:
    f = figures(128 * GiB, env={}, memory_limit_gb=16)
    assert f.physical_bytes == 16 * GiB and f.memory_limit_bytes == 16 * GiB
    assert f.hard_cap_bytes == 14 * GiB and f.effective_cap_bytes == 12 * GiB
    # A limit above physical changes nothing.
    assert figures(8 * GiB, env={}, memory_limit_gb=64).effective_cap_bytes == 4 * GiB


def test_operator_reserve_binds_at_runtime() -> None:
    f = figures(64 * GiB, env={}, memory_reserve_gb=16)
    assert f.effective_cap_bytes == 48 * GiB  # min(57.6, 64 − 16)
    assert f.load_reserve_bytes == 16 * GiB


# -- derived budgets ------------------------------------------------------------------------------

def test_kv_budget() -> None:
    f = figures(64 * GiB, env={})
    assert f.kv_budget_bytes(20 * GiB) == f.hard_cap_bytes - 20 * GiB - 3 * GiB
    assert f.kv_budget_bytes(20 * GiB, ram_prefix_bytes=2 * GiB) == f.hard_cap_bytes - 25 * GiB
    assert f.kv_budget_bytes(60 * GiB) == 0
    assert f.kv_budget_bytes(2**200) == 0  # saturates, no error


def test_request_kv_defaults_clamps_and_half_cap_limit() -> None:
    f = figures(64 * GiB, env={})
    per_token = 128 * 1024  # Llama-3-8B bf16
    # max_tokens unset: min(context, 8192).
    r = f.request_kv(kv_bytes_per_token=per_token, prompt_tokens=1000, context_length=32768)
    assert r.max_tokens == 8192 and r.tokens == 9192 and r.nbytes == 9192 * per_token
    # Small context: the default is the context, and prompt + output is clamped to it.
    r = f.request_kv(kv_bytes_per_token=per_token, prompt_tokens=1000, context_length=4096)
    assert r.tokens == 4096 and r.max_tokens == 3096
    # Explicit max_tokens, within the context.
    r = f.request_kv(kv_bytes_per_token=per_token, prompt_tokens=100, context_length=4096, max_tokens=50)
    assert (r.tokens, r.max_tokens, r.nbytes) == (150, 50, 150 * per_token)
    assert r.within_limit and r.limit_bytes == f.hard_cap_bytes // 2
    # A prompt alone over the window is clamped too (no output budget left).
    r = f.request_kv(kv_bytes_per_token=per_token, prompt_tokens=5000, context_length=4096, max_tokens=10)
    assert (r.tokens, r.max_tokens) == (4096, 0)
    # One request may never claim more than half the hard cap.
    big = f.request_kv(kv_bytes_per_token=2 * 1024 * 1024, prompt_tokens=100_000, context_length=1_000_000)
    assert big.nbytes > f.hard_cap_bytes // 2 and not big.within_limit
    assert default_max_tokens(100_000) == 8192 and default_max_tokens(2048) == 2048


def test_post_load_guard() -> None:
    f = figures(16 * GiB, env={})  # eff_cap 12 GiB, A 3 GiB
    snap = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=14 * GiB, mlx_active_bytes=7 * GiB)
    assert f.live_headroom_bytes(snap) == 2 * GiB
    assert f.load_is_serveable(snap)  # 2 ≥ 1 + 0
    assert f.load_is_serveable(snap, outstanding_bytes=GiB)  # 2 ≥ 1 + 1
    assert not f.load_is_serveable(snap, outstanding_bytes=GiB + 1)


def test_padded_weights() -> None:
    assert padded_weight_bytes(10 * GiB) == 12 * GiB
    assert padded_weight_bytes(5) == 6  # ceil(6.0)
    assert padded_weight_bytes(1) == 2  # ceil(1.2)
    assert padded_weight_bytes(-3) == 0
    assert padded_weight_bytes(2**100) == MAX_BYTES


@given(p=st.integers(min_value=0, max_value=2**70), reserve=st.floats(0, 1e6), fraction=st.floats(0, 1))
def test_figure_invariants(p: int, reserve: float, fraction: float) -> None:
    f = figures(p, env={}, memory_reserve_gb=reserve, cap_fraction=fraction)
    assert 0 <= f.effective_cap_bytes <= f.hard_cap_bytes <= f.physical_bytes <= MAX_BYTES
    assert f.hard_cap_bytes == 0 or f.hard_cap_bytes <= f.physical_bytes - 2 * GiB
    assert f.load_reserve_bytes >= f.memory_reserve_bytes
    assert f.physical_bytes - f.load_reserve_bytes <= f.effective_cap_bytes or f.effective_cap_bytes == 0


# -- env rules ------------------------------------------------------------------------------------

BAD_VALUES = ["abc", "nan", "NaN", "inf", "-inf", "1e999", "0", "-1", "-0.5", "0x10"]


def rejections(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "memory_env_rejected"]


@pytest.mark.parametrize("variable", [FRACTION, ACTIVATION, RESERVE, LIMIT])
@pytest.mark.parametrize("raw", BAD_VALUES)
def test_bad_env_falls_back_with_one_warning(variable: str, raw: str) -> None:
    with capture_logs() as logs:
        f = figures(64 * GiB, env={variable: raw})
    assert f == figures(64 * GiB, env={})  # every figure is the default one
    warned = rejections(logs)
    assert len(warned) == 1, logs
    assert warned[0]["log_level"] == "warning"
    number = float(raw) if raw not in ("abc", "0x10") and math.isfinite(float(raw)) else None
    assert warned[0]["variable"] == variable and warned[0]["given"] == (raw if number is None else number)
    defaults = {FRACTION: 0.9, ACTIVATION: 3.0, RESERVE: 4.0, LIMIT: None}
    assert warned[0]["used"] == defaults[variable]
    (adjusted,) = resolve_settings({variable: raw}).adjustments
    assert (adjusted.variable, adjusted.used, adjusted.action) == (variable, defaults[variable], EnvAction.REJECTED)


def test_each_bad_variable_warns_once_and_independently() -> None:
    env = {FRACTION: "nan", ACTIVATION: "junk", RESERVE: "-4", LIMIT: "inf"}
    with capture_logs() as logs:
        s = resolve_settings(env)
    assert s == PolicySettings()
    assert sorted(e["variable"] for e in rejections(logs)) == sorted(env)


def test_missing_or_blank_env_is_silent() -> None:
    with capture_logs() as logs:
        assert resolve_settings({}) == PolicySettings()
        assert resolve_settings({FRACTION: "", ACTIVATION: "  "}) == PolicySettings()
    assert logs == []


def test_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FRACTION, "0.5")
    monkeypatch.setenv(RESERVE, "1")
    monkeypatch.delenv(ACTIVATION, raising=False)
    monkeypatch.delenv(LIMIT, raising=False)
    f = figures(64 * GiB)
    assert f.cap_fraction == 0.5 and f.hard_cap_bytes == 32 * GiB
    assert f.memory_reserve_bytes == GiB


def test_valid_env_values_apply() -> None:
    f = figures(64 * GiB, env={FRACTION: "0.8", ACTIVATION: "6", RESERVE: "10", LIMIT: "32"})
    assert f.physical_bytes == 32 * GiB
    assert close_to(f.hard_cap_bytes, 25.6)
    assert f.effective_cap_bytes == 22 * GiB  # min(25.6, 32 − 10)
    assert f.activation_reserve_bytes == 6 * GiB and f.load_headroom_bytes == 7 * GiB


def test_fraction_above_one_is_clamped() -> None:
    with capture_logs() as logs:
        f = figures(64 * GiB, env={FRACTION: "1.5"})
    assert f.cap_fraction == 1.0
    assert f.hard_cap_bytes == 62 * GiB  # the 2 GiB OS floor still binds
    assert not rejections(logs)
    assert [(e["variable"], e["given"], e["used"]) for e in logs if e["event"] == "memory_env_clamped"] == [
        (FRACTION, 1.5, 1.0)]
    (adjusted,) = resolve_settings({FRACTION: "1.5"}).adjustments
    assert adjusted.action is EnvAction.CLAMPED and adjusted.rule == "a fraction above 1 is clamped to 1"


def test_a_long_value_that_is_not_a_number_is_kept_truncated() -> None:
    (adjusted,) = resolve_settings({ACTIVATION: "x" * 500}).adjustments
    assert adjusted.given == "x" * 16 + "…"
    assert resolve_settings({}).adjustments == ()


def test_huge_values_saturate() -> None:
    f = figures(64 * GiB, env={ACTIVATION: "1e300", RESERVE: "1e300", LIMIT: "1e300", FRACTION: "1e300"})
    assert f.activation_reserve_bytes == MAX_BYTES
    assert f.load_headroom_bytes == MAX_BYTES
    assert f.memory_reserve_bytes == MAX_BYTES and f.load_reserve_bytes == MAX_BYTES
    assert f.effective_cap_bytes == 0  # the operator asked to hold everything back
    assert f.physical_bytes == 64 * GiB  # a huge limit does not raise P
    snap = MemorySnapshot(physical_bytes=64 * GiB, available_bytes=60 * GiB)
    assert f.live_headroom_bytes(snap) == 0
    huge = figures(2**200, env={})
    assert huge.physical_bytes == MAX_BYTES and 0 < huge.effective_cap_bytes < MAX_BYTES


def test_explicit_values_beat_env_and_are_clamped() -> None:
    env = {FRACTION: "0.5", ACTIVATION: "8", RESERVE: "10", LIMIT: "8"}
    f = figures(64 * GiB, env=env, cap_fraction=0.75, activation_reserve_gb=1, memory_reserve_gb=2,
                memory_limit_gb=32)
    assert f.cap_fraction == 0.75 and f.activation_reserve_bytes == GiB
    assert f.memory_reserve_bytes == 2 * GiB and f.physical_bytes == 32 * GiB
    assert figures(64 * GiB, env={}, cap_fraction=7.0).cap_fraction == 1.0
    assert figures(64 * GiB, env={}, cap_fraction=-1.0).hard_cap_bytes == 0  # honoured: tests may zero it
    assert figures(64 * GiB, env={}, cap_fraction=math.nan).cap_fraction == 0.9
    assert figures(64 * GiB, env={}, activation_reserve_gb=-2).activation_reserve_bytes == 0


def test_compute_figures_reads_no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FRACTION, "0.5")
    assert compute_figures(64 * GiB).cap_fraction == 0.9
    assert compute_figures(64 * GiB, PolicySettings(cap_fraction=0.5)).hard_cap_bytes == 32 * GiB


# -- room for weights (what the docs' table and doctor's no-room check read) ---------------------


@pytest.mark.parametrize("machine_gib, largest_gib", [(16, 6.67), (24, 13.33), (32, 20.0), (64, 44.67),
                                                       (128, 92.67), (192, 140.67)])
def test_largest_loadable_model_with_the_defaults(machine_gib: int, largest_gib: float) -> None:
    f = figures(machine_gib * GiB, env={})
    largest = largest_loadable_bytes(f)
    assert largest / GiB == pytest.approx(largest_gib, abs=0.01)
    assert padded_weight_bytes(largest) + f.load_headroom_bytes <= f.effective_cap_bytes  # it loads
    assert padded_weight_bytes(largest + 1) + f.load_headroom_bytes > f.effective_cap_bytes  # one byte more does not


@given(p=st.integers(min_value=0, max_value=2**42), reserve=st.floats(0, 300), activation=st.floats(0, 300))
def test_largest_loadable_is_exactly_the_fit_boundary(p: int, reserve: float, activation: float) -> None:
    f = figures(p, env={}, memory_reserve_gb=reserve, activation_reserve_gb=activation)
    largest = largest_loadable_bytes(f)
    if room_for_weights(f) == 0:
        assert largest == 0
    else:
        assert f.required_load_bytes(padded_weight_bytes(largest)) <= f.effective_cap_bytes
        assert f.required_load_bytes(padded_weight_bytes(largest + 1)) > f.effective_cap_bytes


def test_an_8_gib_mac_has_room_for_a_model_whose_own_reserve_is_small_but_none_with_a_fixed_3_gib() -> None:
    f = figures(8 * GiB, env={})
    assert f.effective_cap_bytes == 4 * GiB == f.load_headroom_bytes  # 3 GiB activations + 1 GiB KV take it all
    assert room_for_weights(f) == 0
    # Each model's reserve is its own (measured at its load): 3 GiB are left for its weights and it.
    assert room_for_weights(f.for_models(())) == 3 * GiB
    assert no_room_causes(8 * GiB, resolve_settings({})) == ()
    # The operator's fixed 3 GiB for every model leaves none, and both reserves are why.
    fixed = resolve_settings({ACTIVATION: "3"})
    assert no_room_causes(8 * GiB, fixed) == (RoomCause.MEMORY_RESERVE, RoomCause.ACTIVATION_RESERVE)


@pytest.mark.parametrize("env, reserve_gb, causes", [
    ({}, 30.0, (RoomCause.MEMORY_RESERVE,)),  # a 30 GiB reserve on a 24 GiB machine
    ({ACTIVATION: "1000"}, 4.0, (RoomCause.ACTIVATION_RESERVE,)),
    ({ACTIVATION: "1e30"}, 4.0, (RoomCause.ACTIVATION_RESERVE,)),
    ({ACTIVATION: "3", FRACTION: "0.1"}, 4.0, (RoomCause.ACTIVATION_RESERVE, RoomCause.CAP_FRACTION)),  # either
    ({FRACTION: "0.1"}, 4.0, ()),  # 2.4 GiB of cap: room for a small model with its own reserve
    ({}, 4.0, ()),  # the defaults leave room on 24 GiB
])
def test_no_room_names_the_setting_that_takes_it(env: dict, reserve_gb: float, causes: tuple) -> None:
    settings = resolve_settings(env, memory_reserve_gb=reserve_gb)
    assert no_room_causes(24 * GiB, settings) == causes
    assert (room_for_weights(compute_figures(24 * GiB, settings).for_models(())) == 0) == bool(causes)


def test_no_room_on_a_machine_below_the_os_floor_blames_the_machine() -> None:
    assert no_room_causes(2 * GiB, resolve_settings({})) == (RoomCause.SMALL_MACHINE,)
    assert no_room_causes(24 * GiB, resolve_settings({}, memory_limit_gb=2)) == (RoomCause.MEMORY_LIMIT,)
