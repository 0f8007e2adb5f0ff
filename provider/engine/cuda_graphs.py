"""Kernels launched one by one on MLX's CUDA backend, not recorded into CUDA graphs.

By default MLX's CUDA backend records a step's kernels into CUDA graphs and launches a graph once it
holds `MLX_MAX_OPS_PER_BUFFER` operations or its inputs `MLX_MAX_MB_PER_BUFFER` megabytes (on an
H100/H200: 30 ops, 400 MB), updating a cached executable graph or building one afresh each time, on
the thread that calls `mx.async_eval`. For a decode step that host work is the step's critical path.
Measured on an H200 (mlx 0.32.4, the ~8B bf16 shape, the engine's decode batch, median step;
`.gpu`-style run of `benchmarks/decode_bench.py` and a per-step probe):

| setting | batch 1 | batch 32 | 2,048-token prefill: time, peak above the weights |
|---|---|---|---|
| graphs, 30 ops / 400 MB (MLX's default) | 10.1 ms | 16.2 ms | 3.97 GiB |
| graphs, 3,000 ops / 20,000 MB | 10.5 ms | 17.8 ms | 343 ms, 6.89 GiB |
| no graphs (`MLX_USE_CUDA_GRAPHS=0`) | 10.8 ms | 10.0 ms | 335 ms, 4.23 GiB |

So the engine turns graphs off where MLX runs on CUDA, unless the operator set the variable. MLX
reads it once, when its CUDA device is first used: `Engine()` sets it before its worker thread
touches MLX. Nothing changes on Apple silicon or the CPU.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import mlx.core as mx

USE_CUDA_GRAPHS = "MLX_USE_CUDA_GRAPHS"


def without_cuda_graphs(environ: MutableMapping[str, str] | None = None, *, cuda: bool | None = None) -> dict[str, str]:
    """Launch kernels directly where MLX runs on CUDA and the operator said nothing; returns what was set."""
    environ = os.environ if environ is None else environ
    if not (mx.cuda.is_available() if cuda is None else cuda) or USE_CUDA_GRAPHS in environ:
        return {}
    environ[USE_CUDA_GRAPHS] = "0"
    return {USE_CUDA_GRAPHS: "0"}


__all__ = ["USE_CUDA_GRAPHS", "without_cuda_graphs"]
