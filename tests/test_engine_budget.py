"""The load's measurement budget and its predictions (provider/engine/budget.py): pure arithmetic on a
clock the test moves."""

from __future__ import annotations

import pytest

from clock import Clock
from provider.engine.budget import MARGIN, MEASURE_FLOOR_S, WEIGHTS_MULTIPLE, MeasureBudget, PassCosts, Passes


def test_the_budget_is_a_few_seconds_or_a_multiple_of_the_weight_read():
    assert MeasureBudget.after_weights(0.1).seconds == MEASURE_FLOOR_S
    assert MeasureBudget.after_weights(10.0).seconds == WEIGHTS_MULTIPLE * 10.0
    assert MeasureBudget.after_weights(10.0, setting=0.5).seconds == 0.5  # the operator's, whatever the read
    assert MeasureBudget.after_weights(10.0, setting=0.0).seconds == 0.0


def test_a_run_starts_only_when_its_margin_fits_what_is_left():
    clock = Clock(100.0)
    budget = MeasureBudget(4.0, clock=clock)
    assert budget.affords(4.0 / MARGIN) and not budget.affords(4.0 / MARGIN + 0.01)
    clock.advance(seconds=3.0)
    assert budget.left() == pytest.approx(1.0)
    assert budget.affords(0.5) and not budget.affords(0.6)
    clock.advance(seconds=2.0)  # a run went past the budget: nothing more starts, not even a free one
    assert budget.left() == pytest.approx(-1.0) and not budget.affords(0.0)


def test_passes_predict_from_what_was_timed():
    passes = Passes()
    assert passes.predict(32) == 0.0 and passes.costs() is None  # nothing timed: the first pass just runs
    passes.record(1, 0.5)
    passes.record(1, 0.3)  # the fastest counts: a neighbour only adds time
    passes.record(1, 0.4)
    assert passes.best == {1: 0.3}
    assert passes.predict(10) == pytest.approx(3.0)  # one length: its cost per token, an upper bound
    passes.record(2, 0.4)
    passes.record(32, 3.4)
    costs = passes.costs()  # the line through the shortest and the longest
    assert costs == PassCosts(pytest.approx(0.2), pytest.approx(0.1))
    assert passes.predict(256) == pytest.approx(0.2 + 25.6)


def test_a_line_never_predicts_a_negative_cost():
    passes = Passes()
    passes.record(1, 0.5)
    passes.record(32, 0.4)  # a longer pass timed faster (noise): no cost per token, the fixed cost as timed
    assert passes.costs() == PassCosts(pytest.approx(0.5), 0.0)
    assert passes.predict(1000) == pytest.approx(0.5)
