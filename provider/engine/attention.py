"""Attention for MLX's CPU backend with a vectorised softmax.

On the CPU device `mx.fast.scaled_dot_product_attention` runs as plain MLX ops (matmul, mask,
softmax, matmul), and MLX's CPU `exp` is a scalar `std::exp` per element on this machine's x86
build (21 ns each, against 0.4 ns for an add). A prefill of 150 tokens at 1,700 tokens of context
spends about 60 % of its time in that softmax (medium tiny model, measured with attention replaced
by a no-op). Here the same attention is built from ops MLX's compiler fuses into vectorised loops:

* the scores are taken in base 2 (`log2(e)` folded into the query scale), so the softmax needs
  `2**t` for `t <= 0`;
* `2**t` is `2**n * 2**f` with `n` the nearest integer to `t` (the round-to-nearest bias trick) and
  `f` in [-0.5, 0.5]: `2**f` is a degree-7 Taylor polynomial (relative error 9e-8 against float64,
  within a float32 ulp) and `2**n` is written straight into the exponent bits. `t` is clamped at -127,
  where those bits are 0 and the weight exactly 0 (a masked score);
* the normalisation divides the [L, head_dim] output, not the [L, S] weights.

Grouped-query heads share one matmul per KV head, as MLX's own fallback does. The softmax runs in
float32 whatever the input dtype (MLX's `precise`). Masks: None, "causal" (aligned to the end of the
keys, as MLX's) or an array broadcastable to [B, heads, L, S], boolean (True = attend) or additive.
Anything else (attention sinks, other shapes) goes to MLX's own function.

Memory: MLX's own attention peaks at about one [B, heads, L, S] float32 buffer of scores (its
softmax works in place); this one holds about five buffers of scores at once (the scores, and exp2's
steps). So when the scores would take more than `BLOCK_BYTES`, the queries go in blocks of rows whose
scores take at most that, each block evaluated before the next is built (left lazy, MLX runs them
side by side): the peak stays about five blocks, 24 MiB, whatever the prompt (measured with
`mx.get_peak_memory`: MLX's own took 264 MiB for 1,024 queries on 4,096 keys and 16 heads; tested in
tests/test_engine_attention.py). Small blocks are also faster here (they stay in the CPU's caches:
a 1,500-token prompt 0.70x of one block). A decode step (one query row) is one block, never
evaluated early.

Quantized KV (`kv_quantization`): kvcache/quantized.py attends over it with `mx.quantized_matmul` (as
mlx-lm does, the keys and the values each at their own bits), which MLX's CPU backend runs without BLAS
(a 64-token chunk of a prompt over 1,000 cached tokens took 77 ms that way against 8 ms here at
float32, a decode step's row 1.5 ms against 0.7; 16 heads, 4 KV heads, head size 64), and which MLX's
CUDA backend does not implement for these shapes at all (every such step fails there). So off Metal, the engine thread's attention over quantized KV dequantizes the keys and values
and runs a float attention (this module's on the CPU, MLX's on a GPU), in blocks of batch rows, and of
KV heads where one row is too large, whose copy takes at most `DEQUANTIZED_BYTES` (a block's copy is
used up before the next is made, in the order MLX evaluates the graph). On Metal kvcache/quantized.py's
attention runs as it is.

`enable()` installs it for the calling thread only, so the engine thread gets it and every other
thread (mlx-lm used directly, the tests' reference runs) keeps MLX's.
"""

from __future__ import annotations

import math
import threading
from functools import partial

import mlx.core as mx
from mlx_lm.models import base as mlx_lm_base

from kvcache import quantized as quantized_kv

LOG2E = 1.0 / math.log(2.0)
_MAGIC = 12582912.0  # 1.5 * 2**23: adding it rounds a float32 in (-2**22, 2**22) to an integer
_MAGIC_BITS = 0x4B400000  # its bit pattern; r's bits minus this are that integer
_TAYLOR = [math.log(2.0) ** k / math.factorial(k) for k in range(8)]  # 2**f = sum c_k f**k
_MASKED = -1e30  # a masked score: its weight is exactly 0, and a row masked whole stays finite
BLOCK_BYTES = 4 << 20  # float32 scores of one block of query rows (see "Memory")
DEQUANTIZED_BYTES = 64 << 20  # the most one layer's dequantized keys and values may take (see "Quantized KV")

mlx_attention = mx.fast.scaled_dot_product_attention  # MLX's own, kept for every other call
mlx_quantized_attention = quantized_kv.quantized_attention  # MLX's quantized kernels, likewise (kvcache/quantized.py)
_local = threading.local()


# exp2, compiled. MLX's CPU compiler fuses an elementwise graph into one vectorised loop only while
# it is small (measured: a polynomial of 8 coefficients in one function ran unfused, 8x slower), so
# exp2 is three compiled steps of a few ops each.
#
# They are compiled for each shape they meet, and MLX keeps a trace per shape for as long as the
# compiled function lives: ~33 KiB a shape, and finding one among 12,000 took 0.7 ms, while a decode
# step or a prefill meets a new shape nearly every time (the context grows by a token each step).
# So after `MAX_SHAPES` shapes the steps are compiled anew, which drops the old traces: a shape met
# again is traced again (~0.05 ms). (Compiled `shapeless`, one trace for every shape, the steps give
# the same bits but ran 1.1-1.4x slower from 256K elements of scores: such a trace broadcasts both
# operands of every binary op, so a step the compiler fuses holds half as many ops, and exp2 took
# six passes over the scores instead of three.)

MAX_SHAPES = 64  # shapes exp2 is compiled for at once (~2 MiB of MLX's traces)


def _reduce(t: mx.array) -> tuple[mx.array, mx.array]:
    t = mx.maximum(t, -127.0)
    r = t + _MAGIC
    return r, t - (r - _MAGIC)


def _poly_high(f: mx.array) -> mx.array:
    p = f * _TAYLOR[7] + _TAYLOR[6]
    for c in reversed(_TAYLOR[3:6]):
        p = p * f + c
    return p


def _poly_low_scaled(p: mx.array, f: mx.array, r: mx.array) -> mx.array:
    for c in reversed(_TAYLOR[:3]):
        p = p * f + c
    bits = (mx.view(r, mx.int32) - (_MAGIC_BITS - 127)) << 23
    return p * mx.view(bits, mx.float32)


class _Compiled:
    """exp2's steps compiled for the shapes they meet, `MAX_SHAPES` shapes at a time."""

    def __init__(self) -> None:
        self._renew()

    def _renew(self) -> None:
        # A new function object for each (partial): MLX keys its traces to the function, and erases
        # them when the compiled function is dropped (the one it replaces, here).
        self.shapes: set[tuple[int, ...]] = set()
        self.reduce, self.poly_high, self.poly_low_scaled = (
            mx.compile(partial(fn)) for fn in (_reduce, _poly_high, _poly_low_scaled))

    def exp2(self, t: mx.array) -> mx.array:
        if t.shape not in self.shapes:
            if len(self.shapes) >= MAX_SHAPES:
                self._renew()
            self.shapes.add(t.shape)
        r, f = self.reduce(t)
        return self.poly_low_scaled(self.poly_high(f), f, r)


_compiled = _Compiled()


def exp2(t: mx.array) -> mx.array:
    """2**t for float32 `t <= 0` (0 below -127), within about one ulp of MLX's."""
    return _compiled.exp2(t)


def _mask_for(mask, b: int, kv: int, rep: int, length: int, keys: int):
    """`mask` shaped [B or 1, KV or 1, rep or 1, L or 1, S or 1] for the grouped scores ("causal" as
    it is); None if it cannot be."""
    if isinstance(mask, str):
        return mask if mask == "causal" else None
    if mask.ndim > 4 or mask.shape[-2:] not in ((length, keys), (1, keys), (length, 1), (1, 1)):
        return None
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    mb, mh = mask.shape[:2]
    if mb not in (1, b) or mh not in (1, kv * rep):
        return None
    return mask.reshape(mb, kv if mh > 1 else 1, rep if mh > 1 else 1, *mask.shape[2:])


def _rows(mask, start: int, stop: int, length: int, keys: int):
    """The grouped mask of query rows [start, stop)."""
    if isinstance(mask, str):  # causal, aligned to the end of the keys (MLX's)
        return mx.arange(keys - length + start, keys - length + stop)[:, None] >= mx.arange(keys)[None]
    return mask if mask.shape[-2] == 1 else mask[..., start:stop, :]


def _block(q: mx.array, k: mx.array, v: mx.array, scale: float, mask, kv: int) -> mx.array:
    """Attention of a block of query rows: [B, heads, rows, dim], `mask` grouped or None."""
    b, heads, rows, dim = q.shape
    rep, keys = heads // kv, k.shape[2]
    scores = (q * (scale * LOG2E)).reshape(b, kv, rep * rows, dim) @ k.swapaxes(-1, -2)
    scores = scores.astype(mx.float32)
    if mask is not None:
        scores = scores.reshape(b, kv, rep, rows, keys)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, _MASKED)
        else:
            scores = scores + mask.astype(mx.float32) * LOG2E
        scores = scores.reshape(b, kv, rep * rows, keys)
    weights = exp2(scores - scores.max(axis=-1, keepdims=True))
    out = (weights.astype(v.dtype) @ v) / weights.sum(axis=-1, keepdims=True).astype(v.dtype)
    return out.reshape(b, heads, rows, dim)


def scaled_dot_product_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None,
                                 sinks=None, stream=None) -> mx.array:
    """`mx.fast.scaled_dot_product_attention`, with the softmax described in the module docstring."""
    if sinks is not None or stream is not None or q.ndim != 4 or k.ndim != 4:
        return mlx_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)
    b, heads, length, _ = q.shape
    kv, keys = k.shape[1], k.shape[2]
    if heads % kv:
        return mlx_attention(q, k, v, scale=scale, mask=mask)
    grouped = None if mask is None else _mask_for(mask, b, kv, heads // kv, length, keys)
    if mask is not None and grouped is None:
        return mlx_attention(q, k, v, scale=scale, mask=mask)
    # Query rows per block: a block's scores take at most BLOCK_BYTES (see "Memory").
    step = max(1, BLOCK_BYTES // (b * heads * keys * 4))
    if step >= length:
        return _block(q, k, v, scale, None if grouped is None else _rows(grouped, 0, length, length, keys), kv)
    blocks: list[mx.array] = []
    for i in range(0, length, step):
        rows_mask = None if grouped is None else _rows(grouped, i, min(i + step, length), length, keys)
        blocks.append(_block(q[:, :, i:i + step], k, v, scale, rows_mask, kv))
        try:  # one block after the other: left lazy, MLX runs the blocks side by side (all the memory)
            mx.eval(blocks[-1])
        except ValueError:  # inside mx.compile or a transform, where nothing may be evaluated
            return mlx_attention(q, k, v, scale=scale, mask=mask)
    return mx.concatenate(blocks, axis=2)


def _dispatch(q, k, v, *, scale, mask=None, sinks=None, stream=None):
    if enabled():
        return scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)
    return mlx_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)


def quantized_attention(queries: mx.array, q_keys: tuple[mx.array, ...], q_values: tuple[mx.array, ...],
                        scale: float, mask, group_size: int = 32, bits: int | None = None, *,
                        attend=None) -> mx.array:
    """kvcache.quantized's `quantized_attention` (keys and values each at the bits their arrays were packed
    at, `bits` not needed), over dequantized keys and values, in blocks whose copy takes at most
    `DEQUANTIZED_BYTES` (see "Quantized KV"). `attend`: the float attention (default: this module's)."""
    attend = attend or scaled_dot_product_attention
    b, heads = queries.shape[:2]
    kv = q_keys[0].shape[1]
    rep = heads // kv
    one_head = max(1, dequantized_bytes(queries, q_keys) // (b * kv))  # one batch row's one KV head
    fits = max(1, DEQUANTIZED_BYTES // one_head)  # KV heads a block may hold
    rows, group = (max(1, fits // kv), kv) if fits >= kv else (1, fits)
    if rows >= b and group >= kv:
        return _attend_dequantized(queries, q_keys, q_values, scale, mask, group_size, attend)
    out = []
    for r in range(0, b, rows):
        per_row = []
        for h in range(0, kv, group):
            rs, hs = slice(r, r + rows), slice(h, h + group)
            per_row.append(_attend_dequantized(
                queries[rs, h * rep:(h + group) * rep], tuple(a[rs, hs] for a in q_keys),
                tuple(a[rs, hs] for a in q_values), scale, _mask_block(mask, rs, slice(h * rep, (h + group) * rep)),
                group_size, attend))
        out.append(per_row[0] if len(per_row) == 1 else mx.concatenate(per_row, axis=1))
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)


def _attend_dequantized(queries, q_keys, q_values, scale, mask, group_size, attend) -> mx.array:
    keys = dequantize(*q_keys, group_size=group_size, bits=quantized_kv.packed_bits(q_keys, group_size))
    values = dequantize(*q_values, group_size=group_size, bits=quantized_kv.packed_bits(q_values, group_size))
    return attend(queries, keys, values, scale=scale, mask=mask)


def _mask_block(mask, rows: slice, heads: slice):
    """The part of a [B, heads, L, S]-broadcastable mask array that a block of rows and heads reads."""
    if not isinstance(mask, mx.array) or mask.ndim < 4:
        return mask  # None, "causal", or the same for every row and head
    return mask[rows if mask.shape[0] > 1 else slice(None), heads if mask.shape[1] > 1 else slice(None)]


def dequantize(packed: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int) -> mx.array:
    """`mx.dequantize` for 8 and 4 bits from elementwise ops (the packed words read as bytes, nibbles low
    first), which MLX's CPU backend runs 2.5-3.7x faster than its dequantize kernel; the same values."""
    if bits not in (8, 4):
        return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)
    q = mx.view(packed, mx.uint8)
    if bits == 4:
        q = mx.stack([q & 15, q >> 4], axis=-1).reshape(*q.shape[:-1], 2 * q.shape[-1])
    shape = q.shape
    q = q.reshape(*shape[:-1], shape[-1] // group_size, group_size).astype(scales.dtype)
    return (q * scales[..., None] + biases[..., None]).reshape(shape)


def dequantized_bytes(queries: mx.array, q_keys: tuple[mx.array, ...]) -> int:
    """What the float copy of these keys and values would take: the packed rows at the queries' width."""
    return 2 * math.prod(q_keys[0].shape[:-1]) * queries.shape[-1] * queries.dtype.size


def _quantized_dispatch(queries, q_keys, q_values, scale, mask, group_size=32, bits=None):
    if dequantizes():
        return quantized_attention(queries, q_keys, q_values, scale, mask, group_size,
                                   attend=scaled_dot_product_attention if enabled() else mlx_attention)
    return mlx_quantized_attention(queries, q_keys, q_values, scale, mask, group_size)


def enable() -> None:
    """Use this attention for MLX attention calls made on the calling thread, and attend over quantized KV
    dequantized (see module docstring)."""
    enable_dequantized_kv()
    if mx.fast.scaled_dot_product_attention is not _dispatch:
        mx.fast.scaled_dot_product_attention = _dispatch
    _local.on = True


def enable_dequantized_kv() -> None:
    """Attend over quantized KV dequantized, with MLX's own float attention, on the calling thread only
    (a GPU whose backend has no quantized attention: see "Quantized KV")."""
    if mlx_lm_base.quantized_scaled_dot_product_attention is not _quantized_dispatch:
        mlx_lm_base.quantized_scaled_dot_product_attention = _quantized_dispatch
    _local.dequantize = True


def disable() -> None:
    _local.on = False
    _local.dequantize = False


def enabled() -> bool:
    return getattr(_local, "on", False)


def dequantizes() -> bool:
    return getattr(_local, "dequantize", False)


def quantized_kernels() -> bool:
    """Whether the default device attends over quantized KV with MLX's quantized kernels: Metal (and the
    CPU, slowly, which this module replaces); MLX's CUDA backend lacks them."""
    return mx.default_device() != mx.gpu or mx.metal.is_available()


__all__ = ["DEQUANTIZED_BYTES", "LOG2E", "dequantize", "dequantized_bytes", "dequantizes", "disable", "enable",
           "enable_dequantized_kv", "enabled", "exp2", "mlx_attention", "quantized_kernels",
           "mlx_quantized_attention", "quantized_attention", "scaled_dot_product_attention"]
