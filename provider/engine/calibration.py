"""The rates a model runs at, from one short timed pass at load (register's ``prefill_tps`` /
``decode_tps``).

The coordinator forecasts a provider's first content from these until its requests give it
measured rates (``provider.slots.rates``). The pass is what serving does, at a small size: a
``CALIBRATION_PROMPT_TOKENS``-token prompt prefilled in one pass (the first token's logits only, as
solo prefill takes them when the model splits), then ``DECODE_STEPS`` one-token passes with their
logits, each evaluated. A warm-up pass first, so the numbers are not the first-call compile; the
best of the timed decode steps, as a noisy neighbour only adds time. Tens of milliseconds on a
tiny model on the CPU; a few hundred on a large one on a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from provider.engine.prefill import SplitHead

CALIBRATION_PROMPT_TOKENS = 256
DECODE_STEPS = 4
_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids any vocabulary has


@dataclass(frozen=True, slots=True)
class Calibration:
    prefill_tps: float
    decode_tps: float


def _prefill(model: nn.Module, split: SplitHead | None, tokens: list[int], cache: list) -> mx.array:
    if split is not None:
        return split.last_logprobs(tokens, cache)
    return model(mx.array([tokens]), cache=cache)[:, -1, :]


def calibrate(model: nn.Module, split: SplitHead | None = None,
              prompt_tokens: int = CALIBRATION_PROMPT_TOKENS) -> Calibration:
    """One timed prefill and a few timed decode steps (tokens/s each)."""
    tokens = (_TOKENS * (prompt_tokens // len(_TOKENS) + 1))[:prompt_tokens]
    warm = make_prompt_cache(model)
    mx.eval(_prefill(model, split, tokens[:len(_TOKENS)], warm), [c.state for c in warm])
    cache = make_prompt_cache(model)
    started = time.perf_counter()
    logits = _prefill(model, split, tokens, cache)
    mx.eval(logits, [c.state for c in cache])
    prefill_s = time.perf_counter() - started
    steps = []
    for _ in range(DECODE_STEPS):
        started = time.perf_counter()
        out = model(mx.array([_TOKENS[:1]]), cache=cache)[:, -1, :]
        mx.eval(mx.argmax(out, axis=-1), [c.state for c in cache])
        steps.append(time.perf_counter() - started)
    best = min(steps)
    return Calibration(prompt_tokens / prefill_s if prefill_s > 0 else 0.0, 1.0 / best if best > 0 else 0.0)


__all__ = ["CALIBRATION_PROMPT_TOKENS", "Calibration", "calibrate"]
