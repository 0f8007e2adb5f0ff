"""Comparing what two computation paths of the same model give, on any CPU and any BLAS.

The engine computes a model's logits another way than a reference (mlx-lm or mlx-vlm called
directly) does: its CPU attention (provider/engine/attention.py), its weight layout
(provider/engine/layout.py), a batch's shapes, a prefix cache's split of the prompt; and the BLAS
kernel (OpenBLAS picks one per CPU, MLX has its own) decides the last bits of every matmul. So:

* values computed two ways are compared within a tolerance, never bit for bit;
* greedy tokens are compared exactly, which is sound only where each choice beats the runner-up by
  far more than those last bits: `assert_decisive` checks that margin on the sequence a test
  compares, so a prompt that meets a near-tie fails on every machine with a message that says so,
  instead of flipping on some BLAS and not others;
* `engine_attention` runs a reference under the engine's attention on the calling thread, and
  `mlx_vlm_greedy` runs mlx-vlm so (its random tiny VLM's tokens flipped when the attention's scale
  moved from the queries to the keys).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx

from provider.engine import attention
from provider.engine.layout import on_cpu

# The most one logit was seen to differ between two of these paths: 1.4e-7, on the tiny and small
# models (logits below 0.1 in magnitude), across OpenBLAS's Cooperlake, SkylakeX, Zen and Haswell
# kernels and MLX's own BLAS, both weight layouts, both attentions, a decode step or a split prompt
# against the whole sequence in one pass. A margin then moves by 2.8e-7 at most: ten times that is
# a near-tie.
NEAR_TIE = 3e-6


@contextmanager
def engine_attention(on: bool | None = None) -> Iterator[None]:
    """The engine's default (`on_cpu()`) unless `on` says otherwise, on the calling thread."""
    if on_cpu() if on is None else on:
        attention.enable()
    try:
        yield
    finally:
        attention.disable()


def margins(scores: mx.array, chosen: Sequence[int]) -> list[float]:
    """How far each chosen token's score (logit or log-probability, one row per step) is above the
    best other token's: negative where it was not the best."""
    scores = scores.reshape(-1, scores.shape[-1])[: len(chosen)].astype(mx.float32)
    picked = mx.array(list(chosen))
    mine = mx.take_along_axis(scores, picked[:, None], axis=-1)[:, 0]
    others = mx.where(mx.arange(scores.shape[-1])[None] == picked[:, None], -mx.inf, scores)
    return (mine - others.max(axis=-1)).tolist()


def assert_decisive(scores: mx.array, chosen: Sequence[int], what: str = "") -> None:
    """Every greedy choice in `chosen` beats the runner-up by NEAR_TIE at least (module docstring)."""
    near = [(step, m) for step, m in enumerate(margins(scores, chosen)) if m < NEAR_TIE]
    assert not near, (f"{what}: greedy choices within {NEAR_TIE} of the runner-up (step, margin) {near}; "
                      "another computation path may pick the other token: use another prompt or fewer tokens")


def forced_logits(model, prompt: Sequence[int], completion: Sequence[int]) -> mx.array:
    """The logits `model` gives for each completion token, the whole sequence in one pass."""
    tokens = mx.array([*prompt, *completion[:-1]])[None]
    return model(tokens)[0, len(prompt) - 1:]


def assert_decisive_continuation(model, prompt: Sequence[int], completion: Sequence[int], what: str = "") -> None:
    """`assert_decisive` for a completion another run produced (e.g. the engine with a cache off)."""
    assert_decisive(forced_logits(model, prompt, completion), completion, what)


def assert_decisive_reply(reference, messages: list[dict], completion: Sequence[int], what: str = "") -> None:
    """`assert_decisive_continuation` for a chat reply; `reference` is `mlx_lm.load`'s (model, tokenizer)."""
    model, tokenizer = reference
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert_decisive_continuation(model, prompt, completion, what)


class StepLogits:
    """A logits processor (mlx-lm and mlx-vlm take a list of them) that keeps each step's logits."""

    def __init__(self) -> None:
        self.rows: list[mx.array] = []

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.rows.append(logits.reshape(-1, logits.shape[-1])[-1])
        return logits

    def scores(self) -> mx.array:
        return mx.stack(self.rows)


def mlx_vlm_greedy(model, processor, prompt: str, images: list, max_tokens: int, **kwargs):
    """mlx-vlm's own `generate`, greedy, under the engine's attention, each choice checked decisive."""
    from mlx_vlm import generate

    logits = StepLogits()
    with engine_attention():
        result = generate(model, processor, prompt, image=images, max_tokens=max_tokens, temperature=0.0,
                          logits_processors=[logits], **kwargs)
    assert_decisive(logits.scores(), result.token_ids, "mlx-vlm")
    return result
