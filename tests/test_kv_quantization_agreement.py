"""Quantized KV keeps a trained model's answers: teacher-forced top-1 agreement with `none` on
SmolLM2-135M-Instruct (trained weights: its top token usually leads by whole logits, so a flip is the
quantization's doing, not a near-tie's), over 1,008 positions, q8 at least 0.99 and q4 at least 0.95
(the goal's 2,000 positions and more: benchmarks/kv_quant_bench.py on the same model, 2,112).

The token sequences are chats of questions and short answers, the same pairs in another order in each
row, cut to one length. They go through the model as one batch, a chunk of every row a pass, once with
the plain KV cache and once with every layer's KV quantized as the engine's batch keeps it
(`BatchQuantizedKVCache`, attended as the engine thread attends on this CPU: attention.enable()); at
every position the argmax of the next-token logits is compared. Measured on 4 such rows (2,016
positions): q8 0.9975, q4 0.978; the forms they replaced (keys and values at one bits in groups of 64)
0.993 and 0.907; keys and values at 4 bits in groups of 32 0.947. A plain forward of these 1,008
positions takes ~7 s of one core, three of them the test's time.
"""

from __future__ import annotations

import random

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvcache.quantized import BatchQuantizedKVCache
from provider.engine import attention
from provider.models.kv import kv_quantization_bits

PAIRS = (
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name three colors.", "Red, blue and green."),
    ("What is 2 plus 2?", "2 plus 2 is 4."),
    ("What is the largest planet in our solar system?", "Jupiter is the largest planet in our solar system."),
    ("Translate 'thank you' into French.", "Merci."),
    ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
    ("How many days are in a week?", "A week has seven days."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("Name a fruit that is yellow.", "A banana is yellow."),
    ("What do bees make?", "Bees make honey and wax."),
    ("What is the boiling point of water in Celsius?", "Water boils at 100 degrees Celsius at sea level."),
    ("Which animal is known as the king of the jungle?", "The lion is known as the king of the jungle."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is the chemical symbol for gold?", "The chemical symbol for gold is Au."),
    ("Name the first month of the year.", "January is the first month of the year."),
    ("What is 10 divided by 2?", "10 divided by 2 is 5."),
    ("What language is spoken in Spain?", "Spanish is spoken in Spain."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("Which season comes after winter?", "Spring comes after winter."),
)
ROWS = 2
LENGTH = 504  # tokens of each row (every chat is 549): 2 x 504 = 1,008 positions
CHUNK = 126  # tokens of a row a pass: the later passes attend over the earlier ones' quantized KV
GOAL = {"q8": 0.99, "q4": 0.95}


@pytest.fixture(scope="module")
def agreement(trained_model_path) -> dict[str, float]:
    model, tokenizer = mlx_lm.load(str(trained_model_path))
    rows = []
    for seed in range(ROWS):
        pairs = list(PAIRS)
        random.Random(seed).shuffle(pairs)
        chat = [{"role": role, "content": text} for pair in pairs for role, text in zip(("user", "assistant"), pair)]
        rows.append(tokenizer.apply_chat_template(chat)[:LENGTH])
    assert min(len(r) for r in rows) == LENGTH
    tokens = mx.array(rows)

    def top1(cache) -> mx.array:
        out = []
        for at in range(0, LENGTH, CHUNK):
            out.append(mx.argmax(model(tokens[:, at: at + CHUNK], cache=cache), axis=-1))
            mx.eval(out[-1])
        return mx.concatenate(out, axis=1)

    attention.enable()  # as the engine thread attends on this CPU (quantized KV: dequantized)
    try:
        plain = top1(make_prompt_cache(model))
        return {setting: (top1([BatchQuantizedKVCache([0] * ROWS, kv_quantization_bits(setting))
                                for _ in range(len(model.layers))]) == plain).mean().item()
                for setting in GOAL}
    finally:
        attention.disable()


@pytest.mark.parametrize("setting", GOAL)
def test_quantized_kv_keeps_the_trained_models_top_token(agreement, setting):
    assert ROWS * LENGTH >= 1000
    assert agreement[setting] >= GOAL[setting], f"{setting}: top-1 agreement {agreement[setting]:.4f} with none"
