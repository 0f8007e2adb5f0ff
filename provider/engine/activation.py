"""The activation profile a text model's load measures (memory/activation.py), on the engine thread.

No pass of its own: the load's timed passes (calibration.py: the split probe, the pass costs, the
rates' prompt) each run one prompt into a fresh cache on the engine thread, MLX's only user. Around each
`PassMeter.measure` starts MLX's peak afresh (`memory.probe.reset_peak_memory`, which keeps the
process's peak for the heartbeats) and reads it after: the pass's activations are that peak less the
active bytes before it and the KV it made. The samples, less the attention's part as the engine runs it,
give the line memory/activation.py scales to the engine's full prefill window at the model's context.

The attention's part (`attention_model`): this thread's attention.py on the CPU holds about five
buffers of one block's scores (`HELD_BLOCKS`, counted six; tests/test_engine_attention.py measures
it), so its pairs are bounded; MLX's own (a GPU, or `cpu_attention` off) is probed once on a small shape
of the model's heads, which costs milliseconds: a fused kernel holds no scores, MLX's fallback about
one float32 buffer of them, and the probe's bytes per query-key pair say which. A model whose KV is kept
quantized also holds one block of dequantized keys and values in each attention (attention.py,
"Quantized KV"): counted in the fixed part.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from memory.activation import ActivationProfile, ModelShape, PassSample, measured_profile
from memory.probe import reset_peak_memory
from provider.engine import attention
from provider.engine.decode import EngineBatchGenerator, prefill_tokens_for_device
from provider.engine.prefill import PREFILL_STEP

HELD_BLOCKS = 6  # blocks of scores attention.py holds at once (about five measured)
SCORE_BYTES = 4  # its scores are float32 whatever the model's dtype
PROBE_QUERIES, PROBE_KEYS = 64, 512  # MLX's own attention, probed: past one query (its decode kernel)


class PassMeter:
    """The activation bytes of each pass it measures (`samples`), on the thread that runs them."""

    def __init__(self) -> None:
        self.samples: list[PassSample] = []

    @contextlib.contextmanager
    def measure(self, tokens: int, cache: Sequence) -> Iterator[None]:
        """Measure the pass run inside: MLX's peak over it less the active bytes before and its KV (`cache`,
        fresh before the pass, evaluated by its end)."""
        before = mx.get_active_memory()
        reset_peak_memory()
        yield
        kv = sum(c.nbytes for c in cache if not c.empty())
        self.samples.append(PassSample(tokens, max(0, mx.get_peak_memory() - before - kv)))


def window_tokens(generator: EngineBatchGenerator, solo: bool) -> int:
    """The most prompt tokens one pass of this model takes: a batched wave, or a prompt's solo chunk."""
    return max(generator.prefill_tokens, PREFILL_STEP if solo else 0)


def window_for(prefill_tokens: int | None) -> int:
    """`window_tokens` before a load, for an engine of this `EngineOptions.prefill_tokens` (None: by
    device), a model that splits or not: what the estimates of models never loaded are made for."""
    return max(prefill_tokens_for_device(prefill_tokens), PREFILL_STEP)


def attention_model(shape: ModelShape, dtype: mx.Dtype) -> tuple[float, int | None]:
    """(bytes per query-key pair, the most a blocked attention holds or None) for the attention this thread
    runs (module docstring)."""
    if attention.enabled():
        return float(HELD_BLOCKS * SCORE_BYTES * shape.heads), HELD_BLOCKS * attention.BLOCK_BYTES
    q = mx.zeros((1, shape.heads, PROBE_QUERIES, shape.head_dim), dtype=dtype)
    k = mx.zeros((1, shape.kv_heads, PROBE_KEYS, shape.head_dim), dtype=dtype)
    mx.eval(q, k)
    before = mx.get_active_memory()
    reset_peak_memory()
    out = mx.fast.scaled_dot_product_attention(q, k, k, scale=shape.head_dim ** -0.5, mask="causal")
    mx.eval(out)
    held = max(0, mx.get_peak_memory() - before - out.nbytes)
    return held / (PROBE_QUERIES * PROBE_KEYS), None


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the model computes in: its first floating parameter's (a quantized model's scales')."""
    for _, array in tree_flatten(model.parameters()):
        if mx.issubdtype(array.dtype, mx.floating):
            return array.dtype
    return mx.float32


def profile(meter: PassMeter, shape: ModelShape | None, model: nn.Module, *, window: int, batch_rows: int,
            quantized_kv: bool) -> ActivationProfile | None:
    """The load's measured profile; None when no pass was measured or the config has no shape (the
    estimate, else the fixed reserve, then stands)."""
    if shape is None or not meter.samples:
        return None
    pair, blocked = attention_model(shape, activation_dtype(model))
    measured = measured_profile(meter.samples, pair_bytes=pair, blocked_bytes=blocked, window_tokens=window,
                                batch_rows=batch_rows)
    if measured is None or not quantized_kv:
        return measured
    return dataclasses.replace(measured, fixed_bytes=measured.fixed_bytes + attention.DEQUANTIZED_BYTES)


__all__ = ["HELD_BLOCKS", "PassMeter", "activation_dtype", "attention_model", "profile", "window_for",
           "window_tokens"]
