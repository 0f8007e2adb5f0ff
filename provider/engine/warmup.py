"""Serving once before the first request does: the shapes serving uses, run at load on its budget.

MLX's CUDA backend builds each kernel on its first use, per shape: on an H200 an 8B model's first
request took 24.9 s after a 10.9 s load (the second 0.2 s) when the warm-up was one padded wave of
two short prompts and decode steps at batch 2 only. The CPU backend compiles its compiled functions
(the samplers, the CPU attention's softmax: attention.py) on first use too: on this project's CPU
the padded wave below took 3.5 s the first time and 0.9 s the second (a 135M model in float32).

A real first request uses other shapes: one row in the batch (no padding, batch 1), a prompt tens
or hundreds of tokens long, its own sampler at temperature 1 (OpenAI's default: mlx-lm's compiled
categorical sampler on one row), its KV in the slot's own cache kind (quantized when the model's KV
is), and, past the solo threshold, a prompt prefilled alone (prefill.py: a KV cache with the causal
mask and scalar offsets, the head on its last token) that then joins the batch. So the warm-up
serves, through the slot's own generator and solo prefill, in the order a first request needs them:

1. `ALONE`: one prompt of `PROMPT_TOKENS` in the batch by itself: a one-row prefill pass, the last
   token's pass and a decode step at batch 1, sampled at temperature 1;
2. `SOLO` (when the model splits): a prompt of its solo threshold (at most one `PREFILL_STEP`
   chunk) prefilled alone, its KV joined to the batch (`prefill.for_batch`) and decoded;
3. `BURST`: two prompts of different lengths in one padded prefill wave (right padding rolled into
   left padding), decode steps at batch 2 with a greedy and a top-p sampler, one row each;
4. `WIDE`: one short prompt per place in the batch: a wave of `batch_size` rows and decode steps at
   the full batch.

Each shape is predicted from the load's timed passes (budget.py, a pass's cost by its tokens times
rows) and served only when the budget affords it; `ALONE` and `SOLO` shorten their prompt to what
it affords, down to `MIN_PROMPT_TOKENS`. A shape left out is built by the first request that needs
it. Every request of the warm-up leaves the batch before the next shape (and before the model is
published). An edge: a failure only means the first requests pay it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from memory.settle import clear_buffer_cache
from provider.engine.active import Slot
from provider.engine.budget import MeasureBudget, Passes
from provider.engine.calibration import prompt
from provider.engine.prefill import PREFILL_STEP, SoloPrefill, for_batch
from provider.engine.sampling import sampler_for
from provider.engine.types import SamplingParams
from provider.mlxlm import holds_sequences, sequence_uids
from provider.telemetry import get_logger

log = get_logger("provider.engine")

PROMPT_TOKENS = 128  # a chat's template and a short question
MIN_PROMPT_TOKENS = 4
TOKENS = 2  # a request's first token (its last prompt token's pass) and one decode step
_BURST = (8, 3)  # the two prompts of the padded wave
_MAX_CALLS = 16  # generator calls a shape may take (each needs 2 to 4)
_DEFAULTS = SamplingParams(max_tokens=TOKENS)  # an OpenAI request's sampling: temperature 1, top_p 1


class Shape(enum.Enum):
    ALONE = "alone"
    SOLO = "solo"
    BURST = "burst"
    WIDE = "wide"


@dataclass(frozen=True, slots=True)
class Warmed:
    served: tuple[Shape, ...]
    skipped: tuple[Shape, ...]


def warm(slot: Slot, budget: MeasureBudget, passes: Passes, *,
         on_shape: Callable[[Shape], None] = lambda shape: None) -> Warmed:
    """Serve the shapes above that apply to the slot and that the budget affords, in order;
    `on_shape` after each one served."""
    served: list[Shape] = []
    shapes = [shape for shape in Shape if _applies(slot, shape)]
    for shape in shapes:
        run = _plan(slot, shape, budget, passes)
        if run is None:
            continue
        try:
            with mx.stream(slot.generator.stream):
                run()
        except Exception:  # an edge: see the module docstring
            log.exception("warm_up_failed", model=slot.info.model_id, phase=shape)
            with contextlib.suppress(Exception):  # the batch as clean as it can be; the failure is logged
                _empty(slot)
            break
        finally:
            clear_buffer_cache()
        served.append(shape)
        on_shape(shape)
    return Warmed(tuple(served), tuple(s for s in shapes if s not in served))


def _applies(slot: Slot, shape: Shape) -> bool:
    match shape:
        case Shape.SOLO:
            return slot.split is not None
        case Shape.WIDE:
            return slot.generator.completion_batch_size > len(_BURST)
    return True


def _plan(slot: Slot, shape: Shape, budget: MeasureBudget, passes: Passes) -> Callable[[], None] | None:
    """The shape's run, or None when the budget does not afford it."""
    decode = TOKENS * passes.predict(1)
    match shape:
        case Shape.ALONE:
            tokens = _longest(budget, passes, PROMPT_TOKENS, lambda n: passes.predict(n - 1) + decode)
            return None if tokens is None else lambda: _batch(slot, [tokens], [sampler_for(_DEFAULTS)])
        case Shape.SOLO:
            most = max(MIN_PROMPT_TOKENS, min(slot.solo_min_tokens, PREFILL_STEP))
            tokens = _longest(budget, passes, most, lambda n: passes.predict(n) + decode)
            return None if tokens is None else lambda: _solo(slot, tokens)
        case Shape.BURST:
            rows = len(_BURST)
            if not budget.affords(passes.predict(rows * (max(_BURST) - 1)) + TOKENS * passes.predict(rows)):
                return None
            samplers = [sampler_for(dataclasses.replace(_DEFAULTS, temperature=0.0)),
                        sampler_for(dataclasses.replace(_DEFAULTS, top_p=0.9))]
            return lambda: _batch(slot, list(_BURST), samplers)
        case Shape.WIDE:
            rows = slot.generator.completion_batch_size
            if not budget.affords((TOKENS + 1) * passes.predict(rows)):
                return None
            return lambda: _batch(slot, [2] * rows, [greedy_sampler] * rows)


def _longest(budget: MeasureBudget, passes: Passes, most: int, cost: Callable[[int], float]) -> int | None:
    """The longest prompt up to `most` tokens whose run the budget affords; None below MIN_PROMPT_TOKENS."""
    return next((n for n in range(most, MIN_PROMPT_TOKENS - 1, -1) if budget.affords(cost(n))), None)


def _batch(slot: Slot, lengths: list[int], samplers: list) -> None:
    """Prompts of `lengths` inserted together into the batch, as the worker inserts a request
    (its own cache, its sampler), served to their end."""
    generator = slot.generator
    generator.insert([prompt(n) for n in lengths], max_tokens=[TOKENS] * len(lengths),
                     caches=[slot.new_cache() for _ in lengths], samplers=samplers)
    _run(slot)


def _solo(slot: Slot, tokens: int) -> None:
    """A prompt prefilled alone, then joined to the batch with its first token, as the worker does
    (worker.py: `_start`, `_step_solo`, `_join_ready`)."""
    ids = prompt(tokens)
    solo = SoloPrefill(slot.model, slot.split, slot.new_cache(), ids, chunk=PREFILL_STEP)
    logprobs = None
    while logprobs is None:
        _, logprobs = solo.step()
    first = int(greedy_sampler(logprobs).item())
    slot.generator.insert([[first]], max_tokens=[TOKENS - 1], caches=[for_batch(solo.cache)], all_tokens=[ids],
                          samplers=[greedy_sampler])
    _run(slot)


def _run(slot: Slot) -> None:
    generator = slot.generator
    for _ in range(_MAX_CALLS):
        generator.next()
        if not _busy(slot):
            return
    _empty(slot)


def _busy(slot: Slot) -> bool:
    return holds_sequences(slot.generator)


def _empty(slot: Slot) -> None:
    """Take every warm-up request out of the batch (a shape that did not finish, or failed)."""
    uids = sequence_uids(slot.generator)
    if uids:
        slot.generator.remove(uids)


__all__ = ["MIN_PROMPT_TOKENS", "PROMPT_TOKENS", "Shape", "Warmed", "warm"]
