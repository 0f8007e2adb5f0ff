"""Plain mlx-lm on the tiny model, the reference the engine's greedy output is compared with.

``reference`` (module scope) is ``mlx_lm.load`` of ``tiny_model_path``; ``reference_greedy(reference,
content, max_tokens)`` is mlx-lm's own greedy answer to one user message: its tokens, its text and the
prompt's length, after checking that no greedy choice was a near-tie (the engine computes the logits
another way, so only decisive choices are compared exactly). ``PROMPTS``, ``messages`` and ``greedy``
build the requests both sides run.
"""

from __future__ import annotations

import mlx_lm
import pytest
from mlx_lm.generate import stream_generate

from engine_arithmetic import StepLogits, assert_decisive
from provider.engine import SamplingParams

PROMPTS = [
    "hello",
    "the river model token batch stream is blue and green",
    "café 日本語 🚀 naïve",
    "one two three four five six seven eight nine ten hundred thousand apple",
]
NO_EOS = frozenset()


def messages(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """Plain mlx-lm on the same model, for comparisons (runs on the test thread, engine idle)."""
    return mlx_lm.load(str(tiny_model_path))


def reference_greedy(reference, content: str, max_tokens: int, eos: frozenset[int] | None = None):
    model, tok = reference
    saved = set(tok.eos_token_ids)
    if eos is not None:
        tok.eos_token_ids = set(eos)
    try:
        ids = tok.apply_chat_template(messages(content), add_generation_prompt=True)
        logits = StepLogits()
        responses = list(stream_generate(model, tok, ids, max_tokens=max_tokens, logits_processors=[logits]))
        text = mlx_lm.generate(model, tok, ids, max_tokens=max_tokens)
    finally:
        tok.eos_token_ids = saved
    tokens = [r.token for r in responses]
    # The engine computes these logits another way: compared exactly only if no choice is a near-tie.
    assert_decisive(logits.scores(), tokens, f"mlx-lm on {content!r}")
    return tokens, text, len(ids)
