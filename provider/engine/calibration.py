"""What a load measures, on its budget (budget.py): whether and from how many tokens a prompt is
prefilled alone (prefill.py, "Solo prefill"), and the rates register reports (``prefill_tps`` /
``decode_tps``), which the coordinator forecasts a provider's first content from until its requests
give it measured rates (``provider.slots.rates``).

Every timed pass is what serving runs: a prompt prefilled into a fresh cache, its first token's
log-probabilities with it (`SplitHead.last_logprobs` when the model splits, else the model's last
logits), evaluated with the cache; a decode step is a one-token pass on a prompt's cache. Each is
started only when the budget affords its prediction (`Passes.predict`), except the first.

Solo prefill (`Calibrator.solo`), in this order:

1. The split probe: the whole model on `prefill.PROBE`, timed (the load's first pass, which always
   runs), then the backbone and head on the same token if the budget affords a second pass. A
   probe the budget cannot finish leaves solo prefill off for this load (FALLBACK): prompts are
   batched as mlx-lm batches them.
2. The pass costs: a two-token pass, then the longest the budget affords up to `COST_TOKENS`
   (EXTRAPOLATED when shorter), then the longest again if the budget affords it (`COST_RUNS`). The threshold is `prefill.solo_threshold` of the line through them; without
   two lengths timed it is `PREFILL_STEP` (FALLBACK): only prompts of a whole pass go alone, where a
   pass's fixed cost is surely a small part of it.

Rates (`Calibrator.rates`, after the warm-up, so no first use is in them):

* prefill: a `PROMPT_TOKENS`-token pass (MEASURED) when the budget affords it, else `PROMPT_TOKENS`
  over the pass the timed ones predict (EXTRAPOLATED), else, with one length timed, that pass's rate
  per token (FALLBACK: a lower bound);
* decode: the fastest of up to `DECODE_STEPS` one-token passes on the longest prompt's cache
  (MEASURED), else the fastest one-token prefill's rate (EXTRAPOLATED).

Tens of milliseconds on a tiny model on the CPU; a few hundred on a large one on a GPU; a 4-bit model
on a CPU whose passes take seconds stops after the probe.

Each prefill pass is also measured for memory (`Calibrator.meter`, activation.py): MLX's peak over it
gives the model's activation reserve, with no pass of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from provider.engine.activation import PassMeter
from provider.engine.budget import MeasureBudget, Passes
from provider.engine.prefill import (
    PREFILL_STEP,
    PROBE,
    SplitHead,
    head_parts,
    model_logprobs,
    same_logits,
    solo_threshold,
)
from provider.engine.types import Calibrated

PROMPT_TOKENS = 256  # the prefill rate's prompt
DECODE_STEPS = 4
COST_TOKENS = 32  # the pass costs' longest pass
COST_RUNS = 2  # passes of each length, at most (the fastest counts; the probe's two are the one-token runs)
_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids any vocabulary has


def prompt(tokens: int) -> list[int]:
    """A prompt of `tokens` token ids any vocabulary has."""
    return (_TOKENS * (tokens // len(_TOKENS) + 1))[:tokens]


@dataclass(frozen=True, slots=True)
class Solo:
    split: SplitHead | None  # None: solo prefill off
    min_tokens: int
    source: Calibrated


@dataclass(frozen=True, slots=True)
class Calibration:
    prefill_tps: float
    decode_tps: float
    source: Calibrated = Calibrated.MEASURED  # the less certain of the two


def worst(*sources: Calibrated) -> Calibrated:
    order = (Calibrated.MEASURED, Calibrated.EXTRAPOLATED, Calibrated.FALLBACK)
    return max(sources, key=order.index)


class Calibrator:
    """The timed passes of one load, on its budget (engine thread, on the generator's stream)."""

    def __init__(self, model: nn.Module, budget: MeasureBudget) -> None:
        self.model = model
        self.budget = budget
        self.passes = Passes()
        self.meter = PassMeter()  # each prefill pass's activation bytes (activation.py)
        self._split: SplitHead | None = None
        self._longest: tuple[int, list] = (0, [])  # the longest timed prompt and its cache

    def solo(self, setting: int | None) -> Solo:
        """Whether and from how many tokens a prompt is prefilled alone (`setting`: the operator's
        threshold, None to measure it, 0 for never)."""
        if setting == 0:
            return Solo(None, 0, Calibrated.OFF)
        parts = head_parts(self.model)
        if parts is None:
            return Solo(None, 0, Calibrated.OFF)
        full = self._prefill(len(PROBE), lambda cache: model_logprobs(self.model, PROBE, cache))
        if not self.budget.affords(self.passes.predict(len(PROBE))):
            return Solo(None, 0, Calibrated.FALLBACK)
        try:
            split = self._prefill(len(PROBE), lambda cache: parts.last_logprobs(PROBE, cache))
        except Exception:  # an architecture whose parts take other arguments: mlx-lm's path
            return Solo(None, 0, Calibrated.OFF)
        if not same_logits(full, split):
            return Solo(None, 0, Calibrated.OFF)
        self._split = parts
        if setting is not None:
            return Solo(parts, setting, Calibrated.SETTING)
        source = self._costs()
        costs = self.passes.costs()
        if costs is None:
            return Solo(parts, PREFILL_STEP, Calibrated.FALLBACK)
        return Solo(parts, solo_threshold(costs), source)

    def rates(self) -> Calibration:
        """register's rates, from what the budget affords (module docstring)."""
        if not self.passes.best:  # nothing timed yet (solo prefill off): the first pass always runs
            self._prefill(1)
        if self.budget.affords(self.passes.predict(PROMPT_TOKENS)):
            self._prefill(PROMPT_TOKENS)
        if PROMPT_TOKENS in self.passes.best:
            prefill, prefill_from = _rate(PROMPT_TOKENS, self.passes.best[PROMPT_TOKENS]), Calibrated.MEASURED
        elif self.passes.costs() is not None:
            prefill, prefill_from = _rate(PROMPT_TOKENS, self.passes.predict(PROMPT_TOKENS)), Calibrated.EXTRAPOLATED
        else:
            prefill, prefill_from = _rate(1, self.passes.predict(1)), Calibrated.FALLBACK
        steps = self._decode_steps()
        if steps:
            decode, decode_from = _rate(1, min(steps)), Calibrated.MEASURED
        else:
            decode, decode_from = _rate(1, self.passes.predict(1)), Calibrated.EXTRAPOLATED
        return Calibration(prefill, decode, worst(prefill_from, decode_from))

    def close(self) -> None:
        """Drop the kept cache."""
        self._longest = (0, [])

    def _costs(self) -> Calibrated:
        if not self.budget.affords(self.passes.predict(2)):
            return Calibrated.FALLBACK
        self._prefill(2)
        longest = self._longest_affordable(COST_TOKENS)
        runs = 1 if longest == 2 else 0
        while runs < COST_RUNS and self.budget.affords(self.passes.predict(longest)):
            self._prefill(longest)
            runs += 1
        return Calibrated.MEASURED if longest >= COST_TOKENS else Calibrated.EXTRAPOLATED

    def _longest_affordable(self, most: int) -> int:
        """The longest pass up to `most` tokens the budget affords (2 when none is longer)."""
        return next((n for n in range(most, 2, -1) if self.budget.affords(self.passes.predict(n))), 2)

    def _decode_steps(self) -> list[float]:
        tokens, cache = self._longest
        steps: list[float] = []
        while tokens and len(steps) < DECODE_STEPS and self.budget.affords(self.passes.predict(1)):
            started = time.perf_counter()
            out = self.model(mx.array([_TOKENS[:1]]), cache=cache)[:, -1, :]
            mx.eval(mx.argmax(out, axis=-1), [c.state for c in cache])
            steps.append(time.perf_counter() - started)
        return steps

    def _prefill(self, tokens: int, run: Callable[[list], mx.array] | None = None) -> mx.array:
        """One timed prefill pass of `tokens` into a fresh cache (by default the model's, split when
        it splits), recorded; the longest prompt's cache is kept for the decode steps."""
        if run is None:
            ids, split = prompt(tokens), self._split
            run = (lambda c: split.last_logprobs(ids, c)) if split is not None else \
                (lambda c: model_logprobs(self.model, ids, c))
        cache = make_prompt_cache(self.model)
        with self.meter.measure(tokens, cache):
            started = time.perf_counter()
            out = run(cache)
            mx.eval(out, [c.state for c in cache])
            self.passes.record(tokens, time.perf_counter() - started)
        if tokens >= self._longest[0]:
            self._longest = (tokens, cache)
        return out


def _rate(tokens: int, seconds: float) -> float:
    """Tokens a second; 0 (not measured) for a pass too short for the clock."""
    return tokens / seconds if seconds > 0 else 0.0


__all__ = ["COST_TOKENS", "DECODE_STEPS", "PROMPT_TOKENS", "Calibration", "Calibrator", "Solo", "prompt"]
