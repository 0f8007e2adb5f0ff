"""The time a load may spend on what it measures and warms, and the cost of a pass predicted from the
passes already timed.

A load reads the weights, then runs passes of the model: the solo-prefill calibration, the warm-up
(loading.py) and the rates register reports (calibration.py). Their cost is a property of the
machine and the model: tens of milliseconds for a small model on a GPU, seconds a pass for a 4-bit
model on a CPU without quantized kernels worth the name. So they run on a budget: `MeasureBudget`
is `max(MEASURE_FLOOR_S, WEIGHTS_MULTIPLE x the seconds the weights took)` from the end of the
weight read, and a pass is started only when `MARGIN` times its predicted cost fits what is left
(`affords`): predictions come from short passes, attention grows faster than the tokens, a batch's
rows each pass through the head, and a neighbour on the machine can double a pass (all measured on
this project's 2-core CPU). The first pass always runs (nothing predicts it); a run longer than its
margin is the only way past the budget, by at most that run.

`Passes` keeps the fastest time of each pass length (a noisy neighbour only adds time) and predicts a
pass from them: with two lengths timed, the line through them (a fixed cost, the weights read once,
plus a cost per token); with one, that length's cost per token, an upper bound (a pass of n tokens
never costs more than n one-token passes); with none, nothing (0).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

MEASURE_FLOOR_S = 3.0  # a few seconds, whatever the weights took
WEIGHTS_MULTIPLE = 2.0  # ... or this many times the weight read, when that is more
MARGIN = 2.0  # a run starts when this many times its prediction fits what is left


class MeasureBudget:
    """Seconds left for a load's passes, from the end of its weight read (`clock` is injectable)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = max(0.0, seconds)
        self._clock = clock
        self._started = clock()

    @classmethod
    def after_weights(cls, weights_s: float, setting: float | None = None) -> MeasureBudget:
        """The operator's `setting` when given, else the larger of the floor and the multiple."""
        return cls(setting if setting is not None else max(MEASURE_FLOOR_S, WEIGHTS_MULTIPLE * weights_s))

    def left(self) -> float:
        return self.seconds - (self._clock() - self._started)

    def affords(self, predicted_s: float) -> bool:
        """Whether a run predicted to take `predicted_s` may start (with its `MARGIN`)."""
        return MARGIN * predicted_s <= self.left()


@dataclass(frozen=True, slots=True)
class PassCosts:
    """A prefill pass's cost: `fixed_s` whatever its length (the weights read once), plus `per_token_s`
    for each token of each row."""

    fixed_s: float
    per_token_s: float

    def pass_s(self, tokens: int) -> float:
        return self.fixed_s + tokens * self.per_token_s


class Passes:
    """The passes a load has timed: the fastest of each length (tokens x rows)."""

    def __init__(self) -> None:
        self.best: dict[int, float] = {}

    def record(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self.best[tokens] = min(seconds, self.best.get(tokens, seconds))

    def costs(self) -> PassCosts | None:
        """The line through the shortest and the longest pass timed; None before two lengths are."""
        if len(self.best) < 2:
            return None
        short, long = min(self.best), max(self.best)
        per_token = max(0.0, (self.best[long] - self.best[short]) / (long - short))
        return PassCosts(max(0.0, self.best[short] - short * per_token), per_token)

    def predict(self, tokens: int) -> float:
        """A pass of `tokens` (see the module docstring); 0 before any pass is timed."""
        costs = self.costs()
        if costs is not None:
            return costs.pass_s(tokens)
        if not self.best:
            return 0.0
        short = min(self.best)
        return tokens * self.best[short] / short


__all__ = ["MARGIN", "MEASURE_FLOOR_S", "WEIGHTS_MULTIPLE", "MeasureBudget", "PassCosts", "Passes"]
