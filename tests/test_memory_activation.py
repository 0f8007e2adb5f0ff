"""memory.activation: the activation reserve per model, from the passes measured at load or the config.

Pure arithmetic (the engine measures, provider/models stores); the reserve is the model's full prefill
window at its whole context, with a margin, and never below any pass the profile describes.
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from memory import fit
from memory.activation import (
    MARGIN,
    ActivationProfile,
    ModelShape,
    PassSample,
    ReserveSource,
    estimated_profile,
    measured_profile,
)
from memory.policy import DEFAULT_ACTIVATION_RESERVE_BYTES, MIN_KV_BYTES, GiB, figures
from memory.snapshot import MemorySnapshot

MiB = 2**20
KiB = 2**10
TINY = ModelShape(hidden=256, intermediate=256, heads=4, kv_heads=2, head_dim=64, vocab=2048)
EIGHT_B = ModelShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256,
                     dtype_bytes=2)
HUGE = ModelShape(hidden=16384, intermediate=53248, heads=128, kv_heads=8, head_dim=128, vocab=128256,
                  dtype_bytes=2)


def blocked(per_token: float, fixed: int = 0, heads: int = 4, window: int = 2048, rows: int = 32) -> ActivationProfile:
    return ActivationProfile(fixed_bytes=fixed, per_token_bytes=per_token, pair_bytes=24.0 * heads,
                             blocked_bytes=24 * MiB, window_tokens=window, batch_rows=rows,
                             source=ReserveSource.MEASURED)


def test_a_pass_grows_with_its_tokens_and_its_attention_up_to_the_blocks() -> None:
    p = blocked(10 * KiB, fixed=MiB)
    assert p.pass_bytes(tokens=1, rows=1, keys=1) == MiB + 10 * KiB + 96
    # the scores of 256 queries over 256 keys (6 MiB) fit a block set: all of them count
    assert p.pass_bytes(256, 1, 256) == MiB + 256 * 10 * KiB + 96 * 256 * 256
    # 2,048 over 4,096 would be 768 MiB of scores: the attention holds its blocks only
    assert p.pass_bytes(2048, 1, 4096) == MiB + 2048 * 10 * KiB + 24 * MiB


def test_the_reserve_is_the_full_window_at_the_whole_context_with_the_margin() -> None:
    p = blocked(10 * KiB, fixed=MiB)
    window = p.pass_bytes(2048, 1, 4096)
    assert p.reserve_bytes(4096) == math.ceil(MARGIN * window)
    assert p.reserve_bytes(None) == p.reserve_bytes(2048)  # no context in the config: the window's own


def test_a_decode_step_of_the_whole_batch_counts_where_it_holds_more() -> None:
    """One query row per sequence over a long context: the blocks hold every row's scores at once."""
    p = blocked(10 * KiB, heads=32)
    long_context = 1 << 20
    decode = p.pass_bytes(32, 32, long_context)
    assert decode > p.pass_bytes(2048, 1, long_context)
    assert p.reserve_bytes(long_context) == math.ceil(MARGIN * decode)


@given(per_token=st.floats(0, 1 << 20), fixed=st.integers(0, 1 << 30), pair=st.floats(0, 1 << 10),
       block=st.one_of(st.none(), st.integers(0, 1 << 30)), window=st.integers(1, 1 << 14),
       rows=st.integers(1, 64), context=st.integers(1, 1 << 18),
       tokens=st.integers(1, 1 << 14), keys=st.integers(1, 1 << 18), batch=st.integers(1, 64))
def test_the_reserve_never_understates_a_pass_within_its_window_and_context(
        per_token, fixed, pair, block, window, rows, context, tokens, keys, batch) -> None:
    p = ActivationProfile(fixed, per_token, pair, block, window, rows, ReserveSource.MEASURED)
    # a pass takes at most the window and the context, and attends over at most the context
    tokens, keys, batch = min(tokens, window, context), min(keys, context), min(batch, rows)
    assert p.reserve_bytes(context) >= p.pass_bytes(tokens, 1, keys)
    assert p.reserve_bytes(context) >= p.pass_bytes(batch, batch, keys)
    assert p.reserve_bytes(context + 1) >= p.reserve_bytes(context)  # monotone in the context


def test_measured_passes_give_a_line_on_or_above_every_sample() -> None:
    """Samples of one-row passes into fresh caches (keys = tokens): the attention's part as modelled is
    taken out, a line through the two longest, raised to lie on or above every sample."""
    truth = blocked(12 * KiB, fixed=64 * KiB)
    samples = [PassSample(n, truth.pass_bytes(n, 1, n)) for n in (1, 2, 32, 256)]
    p = measured_profile(samples, pair_bytes=truth.pair_bytes, blocked_bytes=truth.blocked_bytes,
                         window_tokens=2048, batch_rows=32)
    assert p is not None and p.source is ReserveSource.MEASURED
    assert abs(p.per_token_bytes - 12 * KiB) < 1 and abs(p.fixed_bytes - 64 * KiB) <= 1
    assert all(p.pass_bytes(s.tokens, 1, s.tokens) >= s.nbytes for s in samples)
    noisy = [*samples, PassSample(32, truth.pass_bytes(32, 1, 32) + 3 * MiB)]
    q = measured_profile(noisy, pair_bytes=truth.pair_bytes, blocked_bytes=truth.blocked_bytes,
                         window_tokens=2048, batch_rows=32)
    assert q is not None and all(q.pass_bytes(s.tokens, 1, s.tokens) >= s.nbytes for s in noisy)


def test_one_length_measured_is_an_upper_bound_per_token_and_none_is_nothing() -> None:
    one = measured_profile([PassSample(4, 40 * KiB)], pair_bytes=0.0, blocked_bytes=None,
                           window_tokens=2048, batch_rows=32)
    assert one is not None and one.per_token_bytes == 10 * KiB and one.fixed_bytes == 0
    assert measured_profile([], pair_bytes=0.0, blocked_bytes=None, window_tokens=2048, batch_rows=32) is None


def test_the_config_estimate_counts_what_the_config_proves_and_asks_no_more_than_the_default_for_attention() -> None:
    tiny = estimated_profile(TINY, window_tokens=2048, batch_rows=32)
    assert tiny.source is ReserveSource.ESTIMATED
    assert tiny.reserve_bytes(2048) < DEFAULT_ACTIVATION_RESERVE_BYTES
    # every score of a window over the whole context, as an attention that holds them would
    assert tiny.reserve_bytes(2048) >= tiny.pass_bytes(2048, 1, 2048) >= 2048 * 2048 * 4 * TINY.heads
    # An 8B at 128k of context: whether its attention holds every score (128 GiB of them) is what a load
    # measures; until then no more than the fixed reserve is asked ...
    big = estimated_profile(EIGHT_B, window_tokens=8192, batch_rows=32)
    assert DEFAULT_ACTIVATION_RESERVE_BYTES - 8 <= big.reserve_bytes(131072) <= DEFAULT_ACTIVATION_RESERVE_BYTES
    # ... unless what grows with the tokens alone asks more.
    huge = estimated_profile(HUGE, window_tokens=8192, batch_rows=32)
    linear = huge.fixed_bytes + huge.per_token_bytes * 8192
    assert linear * MARGIN > DEFAULT_ACTIVATION_RESERVE_BYTES
    assert huge.reserve_bytes(131072) == math.ceil(MARGIN * linear)


def test_a_profile_round_trips_through_json() -> None:
    p = blocked(12.5 * KiB, fixed=7)
    again = ActivationProfile.from_json(p.as_json(), source=ReserveSource.STORED)
    assert again is not None and again.source is ReserveSource.STORED
    assert again.reserve_bytes(4096) == p.reserve_bytes(4096)
    assert ActivationProfile.from_json({"fixed_bytes": "x"}, source=ReserveSource.STORED) is None


# --- the cap figures with a reserve per model


def test_figures_take_the_reserve_of_the_models_in_force_unless_the_operator_set_one() -> None:
    default = figures(16 * GiB, env={})
    assert not default.activation_reserve_set
    idle = default.for_models(())
    assert idle.activation_reserve_bytes == 0 and idle.load_headroom_bytes == MIN_KV_BYTES
    two = default.for_models([200 * MiB, 50 * MiB])
    assert two.activation_reserve_bytes == 200 * MiB  # one engine thread: one pass at a time
    assert two.reserve_for(300 * MiB) == 300 * MiB and two.reserve_for(10 * MiB) == 200 * MiB
    assert two.required_load_bytes(GiB, 300 * MiB) == GiB + 300 * MiB + MIN_KV_BYTES
    fixed = figures(16 * GiB, env={}, activation_reserve_gb=2.0)
    assert fixed.activation_reserve_set and fixed.for_models([200 * MiB]) == fixed
    assert fixed.reserve_for(300 * MiB) == 2 * GiB
    env = figures(16 * GiB, env={"DARKBLOOM_ACTIVATION_RESERVE_GB": "1.5"})
    assert env.activation_reserve_set and env.for_models(()).activation_reserve_bytes == int(1.5 * GiB)


def test_a_models_fit_verdict_uses_its_own_reserve() -> None:
    idle = figures(8 * GiB, env={}, memory_reserve_gb=2.0).for_models(())  # eff_cap 6 GiB
    snap = MemorySnapshot(8 * GiB, 7 * GiB)
    weights = 4 * GiB  # padded 4.8 GiB: with the fixed 3 GiB reserve it never fits here
    assert not fit(idle, snap, weights, activation_reserve_bytes=DEFAULT_ACTIVATION_RESERVE_BYTES).ever_fits
    measured = fit(idle, snap, weights, activation_reserve_bytes=100 * MiB)
    assert measured.ever_fits and measured.required_bytes == math.ceil(weights * 1.2) + 100 * MiB + MIN_KV_BYTES
