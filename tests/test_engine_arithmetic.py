"""The near-tie guard of tests/engine_arithmetic.py, which lets tests compare greedy tokens exactly."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest

from engine_arithmetic import NEAR_TIE, assert_decisive, assert_decisive_continuation, forced_logits, margins


def test_a_margin_is_the_lead_over_the_best_other_token():
    scores = mx.array([[0.0, 0.5, 0.25], [0.25, 0.25 - 2**-20, 0.125], [0.5, 0.125, 0.0]])
    assert margins(scores, [1, 0, 2]) == [0.25, 2**-20, -0.5]


def test_a_near_tie_fails_with_its_step_and_a_clear_win_passes():
    scores = mx.array([[0.0, 0.1], [0.05 + NEAR_TIE / 2, 0.05]])
    assert_decisive(scores[:1], [1])
    with pytest.raises(AssertionError, match=r"here: .* runner-up \(step, margin\) \[\(1, "):
        assert_decisive(scores, [1, 0], "here")


def test_the_forced_pass_scores_a_generated_continuation(tiny_model_path):
    model, tokenizer = mlx_lm.load(str(tiny_model_path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    logits = forced_logits(model, prompt, [0] * 6)
    greedy = mx.argmax(logits, axis=-1).tolist()
    assert logits.shape[0] == 6 and greedy[0] == mx.argmax(model(mx.array(prompt)[None])[0, -1]).item()
    sequence = [greedy[0]]  # the greedy continuation, one token at a time
    for _ in range(5):
        sequence.append(mx.argmax(model(mx.array(prompt + sequence)[None])[0, -1]).item())
    assert_decisive_continuation(model, prompt, sequence)
    wrong = sequence[:3] + [(sequence[3] + 1) % logits.shape[-1]] + sequence[4:]
    with pytest.raises(AssertionError, match=r"\(3, -"):
        assert_decisive_continuation(model, prompt, wrong)
