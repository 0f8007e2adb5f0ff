"""Per-request samplers for a shared batch.

* temperature 0 -> mlx-lm's `greedy_sampler`. Every greedy request shares that one object, so
  the batch samples them in a single call.
* temperature > 0, no seed -> `make_sampler(temp, top_p)`, drawing from MLX's global RNG.
* temperature > 0 with a seed -> a sampler with its own PRNG key, split once per step. Its draws
  do not depend on which other requests share the batch, so the same seed, prompt and
  settings give the same completion whether the request runs alone or batched.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import Sampler, apply_top_p, greedy_sampler, make_sampler

from provider.engine.types import SamplingParams


def sampler_for(params: SamplingParams) -> Sampler:
    if params.temperature == 0:
        return greedy_sampler
    if params.seed is None:
        return make_sampler(temp=params.temperature, top_p=params.top_p)
    return _SeededSampler(params.temperature, params.top_p, params.seed)


class _SeededSampler:
    __slots__ = ("_key", "_inv_temp", "_top_p")

    def __init__(self, temperature: float, top_p: float, seed: int):
        self._key = mx.random.key(seed & 0xFFFF_FFFF_FFFF_FFFF)  # OpenAI seeds may be negative
        self._inv_temp = 1.0 / temperature
        self._top_p = top_p

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._key, step_key = mx.random.split(self._key)
        if 0 < self._top_p < 1:
            logprobs = apply_top_p(logprobs, self._top_p)
        return mx.random.categorical(logprobs * self._inv_temp, key=step_key)
