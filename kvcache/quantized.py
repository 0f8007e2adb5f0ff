"""Quantized KV inside the running batch (the `kv_quantization` setting: q8, q4).

mlx-lm quantizes one sequence's KV (`QuantizedKVCache`: every `group_size` elements of a key or value
row kept as `bits`-bit integers with a scale and a bias, as `mx.quantize` makes them) and its attention
reads that form directly (`mlx_lm.models.base.quantized_scaled_dot_product_attention`, two
`mx.quantized_matmul`s, never a dequantized copy), but its batch has no quantized cache, and it keeps
keys and values at the same bits. Here, in the form a `KvBits` names (kvcache/bits.py: keys and values
each at their own bits):

* `PromptQuantizedKVCache`: mlx-lm's single-sequence cache, keys and values at their own bits, that a
  batch can take in (`merge`): a fresh request's, a prefix reused from the prefix cache, a prompt
  prefilled alone.
* `BatchQuantizedKVCache`: mlx-lm's `BatchKVCache` (left-padded rows, `prepare` / `finalize` for a
  right-padded prefill pass, `filter`, `extend`, `extract`, `make_mask`) with every key and value held
  as the three arrays of `mx.quantize`. Rows are quantized one token at a time along the head
  dimension, so a row's quantized KV is the same whatever batch it is in.
* `quantized_attention`: mlx-lm's quantized attention with the keys' bits and the values' bits each
  read from their packed arrays (a row of `dim` elements packs into `dim * bits / 32` words). mlx-lm's
  models call it through `mlx_lm.models.base` with the cache's `group_size` and one `bits`, so
  importing this module puts it there, in place of mlx-lm's (for keys and values of the same bits it
  computes what mlx-lm's does). Off Metal the engine thread reads the same form dequantized
  (provider/engine/attention.py).

The bytes a token costs (provider/models/kv.py counts them for admission): the packed integers plus a
scale and a bias per group, in the model's dtype: over bfloat16, a key row of 64 elements at 8 bits in
groups of 32 is 72 bytes and a value row at 4 bits 40, where each was 128.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache, dynamic_roll, make_prompt_cache

from kvcache.bits import GROUP_SIZE, KvBits

Quantized = tuple[mx.array, mx.array, mx.array]  # mx.quantize's packed values, scales, biases


def packed_bits(parts: Quantized, group_size: int) -> int:
    """The bits `mx.quantize` packed `parts` at: a row of `dim` elements (`dim / group_size` scales) is
    `dim * bits / 32` words."""
    return parts[0].shape[-1] * 32 // (parts[1].shape[-1] * group_size)


def quantized_attention(queries: mx.array, q_keys: Quantized, q_values: Quantized, scale: float, mask,
                        group_size: int = GROUP_SIZE, bits: int | None = None) -> mx.array:
    """mlx-lm's `quantized_scaled_dot_product_attention`, with the keys' and the values' bits read from
    their arrays (`bits`, the one mlx-lm passes, is not needed)."""
    key_bits, value_bits = packed_bits(q_keys, group_size), packed_bits(q_values, group_size)
    b, heads, length, dim = queries.shape
    kv = q_keys[0].shape[-3]
    rep = heads // kv
    queries = queries * scale
    if rep > 1:
        queries = queries.reshape(b, kv, rep, length, dim)
        q_keys = tuple(mx.expand_dims(x, -3) for x in q_keys)
        q_values = tuple(mx.expand_dims(x, -3) for x in q_values)
    scores = mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size, bits=key_bits)
    if mask is not None:
        if isinstance(mask, str):  # causal, aligned to the end of the keys
            q_len, k_len = scores.shape[-2:]
            mask = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
        if rep > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *q_values, transpose=False, group_size=group_size, bits=value_bits)
    return out.reshape(b, heads, length, -1) if rep > 1 else out


# mlx-lm's models attend over a cache with `bits` through this name (see the module docstring).
mlx_lm_quantized_attention = mlx_lm_base.quantized_scaled_dot_product_attention  # mlx-lm's own (one bits)
mlx_lm_base.quantized_scaled_dot_product_attention = quantized_attention


def _zeros(shape: tuple[int, ...], dim: int, bits: int, group_size: int, dtype) -> Quantized:
    return (mx.zeros((*shape, dim * bits // 32), dtype=mx.uint32),
            mx.zeros((*shape, dim // group_size), dtype=dtype),
            mx.zeros((*shape, dim // group_size), dtype=dtype))


def _append(held: tuple[Quantized, Quantized] | None, used: int, keys: mx.array, values: mx.array, kv_bits: KvBits,
            step: int) -> tuple[Quantized, Quantized]:
    """`held` (the keys' and values' buffers, `used` positions written) with `keys` and `values` quantized
    and written after them, the buffers grown by whole `step`s of positions when they are full."""
    batch, heads, n, _ = keys.shape
    if held is None or used + n > held[0][0].shape[2]:
        steps = (step + n - 1) // step * step
        new_k = _zeros((batch, heads, steps), keys.shape[-1], kv_bits.keys, kv_bits.group_size, keys.dtype)
        new_v = _zeros((batch, heads, steps), values.shape[-1], kv_bits.values, kv_bits.group_size, values.dtype)
        if held is None:
            held = new_k, new_v
        else:
            if used % step:
                held = tree_map(lambda x: x[..., :used, :], held)
            held = (tuple(mx.concatenate([a, b], axis=2) for a, b in zip(held[0], new_k)),
                    tuple(mx.concatenate([a, b], axis=2) for a, b in zip(held[1], new_v)))
    q_keys = mx.quantize(keys, group_size=kv_bits.group_size, bits=kv_bits.keys)
    q_values = mx.quantize(values, group_size=kv_bits.group_size, bits=kv_bits.values)
    for i in range(3):
        held[0][i][..., used: used + n, :] = q_keys[i]
        held[1][i][..., used: used + n, :] = q_values[i]
    return held


class PromptQuantizedKVCache(QuantizedKVCache):
    """One sequence's quantized KV, keys and values at their own bits, which a batch takes in through
    `merge`. `bits` (what mlx-lm's models look for) is the keys' bits, `value_bits` the values'."""

    def __init__(self, kv_bits: KvBits):
        super().__init__(group_size=kv_bits.group_size, bits=kv_bits.keys)
        self.value_bits = kv_bits.values

    @property
    def kv_bits(self) -> KvBits:
        return KvBits(self.bits, self.value_bits, self.group_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        held = None if self.keys is None else (self.keys, self.values)
        self.keys, self.values = _append(held, self.offset, keys, values, self.kv_bits, self.step)
        self.offset += keys.shape[2]
        return self.keys_and_values()

    @property
    def state(self):
        return self.keys, self.values

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values = v

    @property
    def meta_state(self):
        return tuple(map(str, (self.offset, self.group_size, self.bits, self.value_bits)))

    @meta_state.setter
    def meta_state(self, v) -> None:
        self.offset, self.group_size, self.bits, self.value_bits = map(int, v)

    @classmethod
    def merge(cls, caches: Sequence[PromptQuantizedKVCache]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)

    def size(self) -> int:
        return self.offset


def quantizable(model) -> bool:
    """Whether every layer of the model's own cache is plain growing KV (what is quantized here)."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def make_quantized_cache(model, kv_bits: KvBits) -> list[PromptQuantizedKVCache]:
    """A fresh prompt cache of the model, every layer quantized (`quantizable(model)` must hold)."""
    return [PromptQuantizedKVCache(kv_bits) for _ in make_prompt_cache(model)]


class BatchQuantizedKVCache(_BaseCache):
    """`BatchKVCache` with quantized keys and values (see the module docstring). `bits` (what mlx-lm's
    models look for) is the keys' bits, `value_bits` the values'."""

    step = 256

    def __init__(self, left_padding: list[int], kv_bits: KvBits):
        self.keys: Quantized | None = None
        self.values: Quantized | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.group_size = kv_bits.group_size
        self.bits = kv_bits.keys
        self.value_bits = kv_bits.values

    @property
    def kv_bits(self) -> KvBits:
        return KvBits(self.bits, self.value_bits, self.group_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        held = None if self.keys is None else (self.keys, self.values)
        self.keys, self.values = _append(held, self._idx, keys, values, self.kv_bits, self.step)
        n = keys.shape[2]
        self.offset = self.offset + n
        self._idx += n
        return self.keys_and_values()

    def keys_and_values(self):
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            left_padding = mx.array(left_padding)
            self.left_padding = self.left_padding + left_padding
            self.offset = self.offset - left_padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is None:
            return
        padding = self._right_padding
        if self.keys is not None:
            self.keys = tuple(dynamic_roll(x, padding[:, None], axis=2) for x in self.keys)
            self.values = tuple(dynamic_roll(x, padding[:, None], axis=2) for x in self.values)
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None

    @property
    def state(self):
        if self.keys is None:
            return None, None, self.offset, self.left_padding
        keys, values = self.keys_and_values()
        return keys, values, self.offset, self.left_padding

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, self.offset, self.left_padding = v
        self._idx = 0 if self.keys is None else self.keys[0].shape[2]

    @property
    def meta_state(self):
        return tuple(map(str, (self._idx, self.group_size, self.bits, self.value_bits)))

    @meta_state.setter
    def meta_state(self, v) -> None:
        self._idx, self.group_size, self.bits, self.value_bits = map(int, v)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices) -> None:
        if self.keys is not None:
            self.keys = tuple(x[batch_indices] for x in self.keys)
            self.values = tuple(x[batch_indices] for x in self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())  # the padding every kept row has: dropped
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(lambda x: x[..., shift:, :], (self.keys, self.values))
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if other.kv_bits != self.kv_bits:
            raise ValueError("quantized KV of other bits cannot join this batch")
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        reference = self if self.keys is not None else other
        top = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def aligned(c: BatchQuantizedKVCache):
            rows = c.offset.shape[0]
            if c.keys is None:
                parts_k = tuple(mx.zeros((rows, *x.shape[1:2], 0, x.shape[3]), dtype=x.dtype) for x in reference.keys)
                parts_v = tuple(mx.zeros((rows, *x.shape[1:2], 0, x.shape[3]), dtype=x.dtype) for x in reference.values)
            else:
                parts_k, parts_v = c.keys, c.values
            left = top - c._idx
            right = size - parts_k[0].shape[2] - left
            if right < 0:
                parts_k = tuple(x[..., :right, :] for x in parts_k)
                parts_v = tuple(x[..., :right, :] for x in parts_v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                parts_k = tuple(mx.pad(x, widths) for x in parts_k)
                parts_v = tuple(mx.pad(x, widths) for x in parts_v)
            return parts_k, parts_v, c.offset, c.left_padding + left

        (ak, av, ao, al), (bk, bv, bo, bl) = aligned(self), aligned(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(ak, bk))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(av, bv))
        self.offset = mx.concatenate([ao, bo])
        self.left_padding = mx.concatenate([al, bl])
        self._idx = top

    def extract(self, idx: int) -> PromptQuantizedKVCache:
        """Row `idx` as one sequence's cache, its padding dropped, exactly its tokens, contiguous."""
        cache = PromptQuantizedKVCache(self.kv_bits)
        if self.keys is None:
            return cache
        start = self.left_padding.tolist()[idx]
        cache.keys = tuple(mx.contiguous(x[idx: idx + 1, :, start: self._idx]) for x in self.keys)
        cache.values = tuple(mx.contiguous(x[idx: idx + 1, :, start: self._idx]) for x in self.values)
        cache.offset = cache.keys[0].shape[2]
        return cache

    @classmethod
    def merge(cls, caches: Sequence[PromptQuantizedKVCache]) -> BatchQuantizedKVCache:
        """Sequences' caches as one batch, right-aligned: each row left-padded to the longest."""
        first = caches[0]
        if any(c.kv_bits != first.kv_bits for c in caches):
            raise ValueError("quantized KV of other bits cannot join this batch")
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), first.kv_bits)
        padding = [longest - n for n in lengths]
        sample = next(c for c in caches if c.keys is not None)

        def buffers(parts: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
            return tuple(mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), dtype=x.dtype) for x in parts)

        keys, values = buffers(sample.keys), buffers(sample.values)
        for i, (pad, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for dst, src in zip(keys, c.keys):
                dst[i: i + 1, :, pad: pad + c.offset] = src[..., : c.offset, :]
            for dst, src in zip(values, c.values):
                dst[i: i + 1, :, pad: pad + c.offset] = src[..., : c.offset, :]
        batch = cls(padding, first.kv_bits)
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


__all__ = ["BatchQuantizedKVCache", "PromptQuantizedKVCache", "make_quantized_cache", "mlx_lm_quantized_attention",
           "packed_bits", "quantizable", "quantized_attention"]
