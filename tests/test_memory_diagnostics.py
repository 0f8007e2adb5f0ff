"""memory.diagnostics: the restart recommendation over recorded histories (pure, no MLX)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from memory import GiB, compute_figures, padded_weight_bytes
from memory.diagnostics import (
    BaselineSample,
    Drift,
    Recommendation,
    RestartReason,
    RestartThresholds,
    restart_advice,
)

MiB = 2**20
FIG = compute_figures(64 * GiB)  # effective cap 57.6 GiB: 5 % = 2.88 GiB, so the 1 GiB floor binds
LARGEST = FIG.required_load_bytes(padded_weight_bytes(40 * GiB))  # a 40 GiB model: 52 GiB to load


def history(*actives: int) -> list[BaselineSample]:
    return [BaselineSample(float(i), a, 500 * MiB + a) for i, a in enumerate(actives)]


def advice(actives, settles=(), **kw):
    return restart_advice(FIG, history(*actives), list(settles), largest_model_required_bytes=LARGEST, **kw)


def test_clean_switches_recommend_nothing():
    # 50 switches, the no-model baseline moving by a few MiB either way (what the soak measures)
    a = advice([0] + [(i % 3) * MiB for i in range(50)], settles=[True] * 50)
    assert a.recommendation is Recommendation.NONE and a.reason is None
    assert a.drift.mlx_active_bytes == (49 % 3) * MiB


def test_slow_drift_is_advised_once_past_the_threshold():
    steps = [i * 30 * MiB for i in range(40)]  # 30 MiB a switch: 1.14 GiB after 39
    assert advice(steps[:30]).recommendation is Recommendation.NONE  # 870 MiB
    a = advice(steps)
    assert a.recommendation is Recommendation.ADVISED and a.reason is RestartReason.BASELINE_DRIFT
    assert a.drift.mlx_active_bytes == 39 * 30 * MiB
    assert abs(a.drift.fraction_of_cap - a.drift.mlx_active_bytes / FIG.effective_cap_bytes) < 1e-12


def test_large_drift_that_costs_a_model_is_needed():
    # 57.6 − 6 GiB = 51.6 GiB < the 52 GiB the largest advertised model needs
    a = advice([0, 2 * GiB, 6 * GiB])
    assert a.recommendation is Recommendation.NEEDED and a.reason is RestartReason.NO_MODEL_HEADROOM
    assert a.needed


def test_two_failed_settles_in_a_row_are_advised():
    assert advice([0, 0], settles=[True, False, True]).recommendation is Recommendation.NONE
    a = advice([0, 0], settles=[True, False, False])
    assert a.recommendation is Recommendation.ADVISED and a.reason is RestartReason.SETTLE_FAILURES
    # thresholds are settings
    assert advice([0, 0], settles=[False, False], thresholds=RestartThresholds(failed_settles=3)).recommendation \
        is Recommendation.NONE


def test_a_small_machine_uses_five_percent_of_its_cap():
    small = compute_figures(16 * GiB)  # effective cap 12 GiB: 5 % = 614 MiB < 1 GiB
    assert RestartThresholds().drift_limit_bytes(small) == int(0.05 * small.effective_cap_bytes)
    a = restart_advice(small, history(0, 700 * MiB), [])
    assert a.recommendation is Recommendation.ADVISED


def test_memory_that_came_back_is_no_drift():
    a = advice([2 * GiB, 0])
    assert a.recommendation is Recommendation.NONE and a.drift.mlx_active_bytes == -2 * GiB


@given(actives=st.lists(st.integers(0, 80 * GiB), min_size=1, max_size=30),
       settles=st.lists(st.booleans(), max_size=10))
def test_the_verdict_only_ever_rises_with_drift(actives, settles):
    """More drift never lowers the recommendation; `needed` implies the drift is what costs the model."""
    order = [Recommendation.NONE, Recommendation.ADVISED, Recommendation.NEEDED]
    base = advice(actives, settles)
    worse = advice(actives[:-1] + [actives[-1] + GiB], settles)
    assert order.index(worse.recommendation) >= order.index(base.recommendation)
    if base.needed:
        assert FIG.effective_cap_bytes - base.drift.mlx_active_bytes < LARGEST
    assert Drift.of(history(*actives), FIG).mlx_active_bytes == actives[-1] - actives[0]
