"""Weight layout for MLX's CPU backend: each dense linear weight stored as its own transpose.

`nn.Linear` computes `x @ W.T` with W stored [out, in], so every matmul hands the BLAS a transposed
right-hand side. OpenBLAS packs that operand afresh on every call; with a handful of rows (a decode
step of a batch) the packing is as much work as the multiply. Stored [in, out] and viewed as
[out, in] (same values, same bytes, strides swapped), `W.T` is a plain row-major matrix and the
packing is cheaper. Measured on this machine's CPU backend with the medium tiny model, bare mlx-lm
`BatchGenerator` on both layouts in one process: a decode step 0.87x at batch 8 and 0.77x at
batch 1, prefill passes within noise, greedy tokens identical (the same products, summed in the
same order).

Only on the CPU device: Metal's kernels read either layout and nothing was measured there. Only
dense float weights: quantized layers have their own kernels, and the tied input embedding keeps
its rows contiguous for the token lookup. Each weight is copied alone, so the load peaks at one
weight above the model; a weight above `max_bytes` keeps its layout (the worker passes a tenth of
the loaded weights, at most 256 MiB: half the margin of the load's estimate, on-disk bytes x 1.2).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

MAX_WEIGHT_BYTES = 256 << 20  # the load's transient: at most one such copy at a time


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def transpose_weights(model: nn.Module, *, max_bytes: int = MAX_WEIGHT_BYTES) -> int:
    """Store every dense linear weight of `model` as its transpose (see module docstring); how many."""
    done = 0
    for module in model.modules():
        if type(module) is not nn.Linear:  # subclasses may read `weight` their own way
            continue
        weight = module.weight
        if weight.ndim != 2 or not mx.issubdtype(weight.dtype, mx.floating) or weight.nbytes > max_bytes:
            continue
        module.weight = mx.contiguous(weight.T).T
        del weight
        mx.eval(module.weight)
        done += 1
    return done


__all__ = ["MAX_WEIGHT_BYTES", "on_cpu", "transpose_weights"]
