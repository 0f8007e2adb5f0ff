"""What mlx-lm itself answers on the trained model, to hold the server's answers against.

`greedy(model, tokenizer, messages, max_tokens)` runs `mlx_lm.generate.stream_generate` (greedy, one
sequence, mlx-lm's own prompt cache) and returns the tokens and, for each, how far the chosen token led
the runner-up in log-probability. A lead under `NEAR_TIE` is a near-tie: another batch shape, padding or
BLAS kernel may honestly pick the other token there, so comparisons stop at the first one (`comparable`).
Trained weights rarely have one in a short answer; random weights have them everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import stream_generate

NEAR_TIE = 1e-3  # nats

PROMPTS = (
    "What is the capital of France?",
    "Name three colors.",
    "What is 2 plus 2?",
    "What is the largest planet in our solar system?",
    "Translate 'thank you' into French.",
    "What color is the sky on a clear day?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Name a fruit that is yellow.",
    "What do bees make?",
    "What is the boiling point of water in Celsius?",
    "Which animal is known as the king of the jungle?",
    "What is the capital of Japan?",
    "How many legs does a spider have?",
    "What is the chemical symbol for gold?",
    "Name the first month of the year.",
    "What is 10 divided by 2?",
    "What language is spoken in Spain?",
    "What is frozen water called?",
    "Which season comes after winter?",
)


@dataclass(frozen=True, slots=True)
class Greedy:
    tokens: list[int]
    leads: list[float]
    finish_reason: str | None

    def comparable(self) -> int:
        """How many leading tokens any correct greedy decoder must reproduce (up to the first near-tie)."""
        return next((i for i, lead in enumerate(self.leads) if lead < NEAR_TIE), len(self.tokens))


def greedy(model, tokenizer, messages: list[dict[str, str]], max_tokens: int) -> Greedy:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    tokens, leads, finish = [], [], None
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        top2 = mx.sort(response.logprobs)[-2:]
        leads.append(float((top2[1] - top2[0]).item()))
        tokens.append(response.token)
        finish = response.finish_reason
    eos = set(tokenizer.eos_token_ids)
    if tokens and tokens[-1] in eos:  # the server does not return the EOS token itself
        tokens, leads = tokens[:-1], leads[:-1]
    return Greedy(tokens, leads, finish)


__all__ = ["NEAR_TIE", "PROMPTS", "Greedy", "greedy"]
