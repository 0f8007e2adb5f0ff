"""Weight layout for the CPU's BLAS (provider/engine/layout.py) on the real tiny models.

Every dense linear weight is stored as its transpose and viewed back: same values, same bytes, the
matmul's right-hand side row-major. The engine does it at load on the CPU device, and its greedy
tokens stay mlx-lm's.
"""

from __future__ import annotations

import asyncio
import gc

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest

from engine_reference import NO_EOS, PROMPTS, greedy, messages, reference_greedy
from provider.engine import ChatRequest, Engine
from provider.engine.layout import on_cpu, transpose_weights


def dense_linears(model: nn.Module) -> list[nn.Linear]:
    return [m for _, m in model.named_modules() if type(m) is nn.Linear]


def row_major(a: mx.array) -> bool:
    return memoryview(a).c_contiguous


def test_every_dense_weight_is_stored_transposed_with_its_values(tiny_model_path):
    model, _ = mlx_lm.load(str(tiny_model_path))
    linears = dense_linears(model)
    assert linears and all(row_major(m.weight) and not row_major(m.weight.T) for m in linears)
    before = [mx.array(m.weight) for m in linears]
    x = mx.random.normal((3, linears[0].weight.shape[1]), key=mx.random.key(0))
    y = linears[0](x)
    mx.eval(before, y)

    assert transpose_weights(model) == len(linears)

    for m, old in zip(linears, before, strict=True):
        assert m.weight.shape == old.shape and mx.array_equal(m.weight, old).item()  # a copy: exact
        assert row_major(m.weight.T) and not row_major(m.weight)
    # The product goes through another BLAS call (its operand no longer transposed), and the kernel
    # decides the last bit (OpenBLAS's SkylakeX and Cooperlake kernels change it, on Intel and AMD):
    # equal to float32 rounding. A weight used the wrong way round would be far off.
    assert mx.allclose(linears[0](x), y, rtol=1e-5, atol=1e-6).item()


def test_the_model_takes_no_more_memory_after_the_layout(tiny_model_path):
    model, _ = mlx_lm.load(str(tiny_model_path))
    gc.collect()
    before = mx.get_active_memory()
    assert transpose_weights(model) > 0
    gc.collect()
    assert mx.get_active_memory() == before


def test_quantized_layers_and_weights_over_the_bound_keep_their_layout(quantized_model_path, tiny_model_path):
    quantized, _ = mlx_lm.load(str(quantized_model_path))
    quantized_layers = [m for _, m in quantized.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert quantized_layers
    assert transpose_weights(quantized) == len(dense_linears(quantized))
    assert all(row_major(m.weight) for m in quantized_layers)

    model, _ = mlx_lm.load(str(tiny_model_path))
    linears = dense_linears(model)
    bound = max(m.weight.nbytes for m in linears) - 1
    small = sum(m.weight.nbytes <= bound for m in linears)
    assert 0 < small < len(linears)
    assert transpose_weights(model, max_bytes=bound) == small
    assert all(row_major(m.weight) == (m.weight.nbytes > bound) for m in linears)


@pytest.mark.parametrize("layout", [None, True, False])
async def test_the_engine_lays_out_at_load_and_keeps_mlx_lm_greedy_tokens(tiny_model_path, reference, layout):
    expected = [reference_greedy(reference, p, 16, eos=NO_EOS)[0] for p in PROMPTS]
    linears = len(dense_linears(reference[0]))
    async with Engine(weight_layout=layout) as engine:
        info = await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
        results = await asyncio.gather(*(
            engine.submit("tiny", ChatRequest(f"r{i}", messages(p), greedy(16))).collect()
            for i, p in enumerate(PROMPTS)))
    on = on_cpu() if layout is None else layout
    assert info.transposed_weights == (linears if on else 0)
    assert [list(r[1].completion_ids) for r in results] == expected
