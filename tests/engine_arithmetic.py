"""Run a reference (mlx-lm or mlx-vlm called directly) under the attention the engine thread uses.

The engine's CPU attention (provider/engine/attention.py) agrees with MLX's to float32 rounding,
and the random-weight tiny models' greedy tokens can flip on rounding alone; a test that compares
the engine's tokens with a reference run checks the pipeline, so both sides get the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from provider.engine import attention
from provider.engine.layout import on_cpu


@contextmanager
def engine_attention(on: bool | None = None) -> Iterator[None]:
    """The engine's default (`on_cpu()`) unless `on` says otherwise, on the calling thread."""
    if on_cpu() if on is None else on:
        attention.enable()
    try:
        yield
    finally:
        attention.disable()
