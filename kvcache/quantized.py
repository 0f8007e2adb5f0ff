"""Quantized KV inside the running batch (the `kv_quantization` setting: q8, q4).

mlx-lm quantizes one sequence's KV (`QuantizedKVCache`: every `group_size` elements of a key or value
row kept as `bits`-bit integers with a scale and a bias, as `mx.quantize` makes them) and its attention
reads that form directly (`mlx_lm.models.base.quantized_scaled_dot_product_attention`, two
`mx.quantized_matmul`s, never a dequantized copy), but its batch has no quantized cache. Here:

* `PromptQuantizedKVCache`: mlx-lm's single-sequence cache that a batch can take in (`merge`): a fresh
  request's, a prefix reused from the prefix cache, a prompt prefilled alone.
* `BatchQuantizedKVCache`: mlx-lm's `BatchKVCache` (left-padded rows, `prepare` / `finalize` for a
  right-padded prefill pass, `filter`, `extend`, `extract`, `make_mask`) with every key and value held
  as the three arrays of `mx.quantize`. Rows are quantized one token at a time along the head
  dimension, so a row's quantized KV is the same whatever batch it is in.

The bytes a token costs (provider/models/kv.py counts them for admission): the packed integers plus a
scale and a bias per group, in the model's dtype: 8 bits in groups of 64 over bfloat16 is 68 bytes
where 128 were.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache, dynamic_roll, make_prompt_cache

GROUP_SIZE = 64  # mlx-lm's QuantizedKVCache default (provider/models/kv.py counts the bytes with it)


class PromptQuantizedKVCache(QuantizedKVCache):
    """One sequence's quantized KV, which a batch takes in through `merge`."""

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)

    def size(self) -> int:
        return self.offset


def quantizable(model) -> bool:
    """Whether every layer of the model's own cache is plain growing KV (what is quantized here)."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def make_quantized_cache(model, bits: int, group_size: int = GROUP_SIZE) -> list[PromptQuantizedKVCache]:
    """A fresh prompt cache of the model, every layer quantized (`quantizable(model)` must hold)."""
    return [PromptQuantizedKVCache(group_size=group_size, bits=bits) for _ in make_prompt_cache(model)]



class BatchQuantizedKVCache(_BaseCache):
    """`BatchKVCache` with quantized keys and values (see the module docstring)."""

    step = 256

    def __init__(self, left_padding: list[int], group_size: int = GROUP_SIZE, bits: int = 8):
        self.keys: tuple[mx.array, mx.array, mx.array] | None = None
        self.values: tuple[mx.array, mx.array, mx.array] | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.group_size = group_size
        self.bits = bits

    def _init(self, batch: int, heads: int, steps: int, dim: int, dtype) -> tuple[mx.array, mx.array, mx.array]:
        per_int = 32 // self.bits
        shape = (batch, heads, steps)
        return (mx.zeros((*shape, dim // per_int), dtype=mx.uint32),
                mx.zeros((*shape, dim // self.group_size), dtype=dtype),
                mx.zeros((*shape, dim // self.group_size), dtype=dtype))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        batch, heads, n, k_dim = keys.shape
        prev = self._idx
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            steps = (self.step + n - 1) // self.step * self.step
            new_k = self._init(batch, heads, steps, k_dim, keys.dtype)
            new_v = self._init(batch, heads, steps, values.shape[3], values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step:
                    self.keys, self.values = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
                self.keys = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.keys, new_k))
                self.values = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.values, new_v))
        self.offset = self.offset + n
        self._idx += n
        q_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        q_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev:self._idx, :] = q_keys[i]
            self.values[i][..., prev:self._idx, :] = q_values[i]
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
        return tuple(map(str, (self._idx, self.group_size, self.bits)))

    @meta_state.setter
    def meta_state(self, v) -> None:
        self._idx, self.group_size, self.bits = map(int, v)

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
        cache = PromptQuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if self.keys is None:
            return cache
        start = self.left_padding.tolist()[idx]
        cache.keys = tuple(mx.contiguous(x[idx: idx + 1, :, start: self._idx]) for x in self.keys)
        cache.values = tuple(mx.contiguous(x[idx: idx + 1, :, start: self._idx]) for x in self.values)
        cache.offset = cache.keys[0].shape[2]
        return cache

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """Sequences' caches as one batch, right-aligned: each row left-padded to the longest."""
        first = caches[0]
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size=first.group_size, bits=first.bits)
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
        batch = cls(padding, group_size=first.group_size, bits=first.bits)
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


__all__ = ["GROUP_SIZE", "BatchQuantizedKVCache", "PromptQuantizedKVCache", "make_quantized_cache", "quantizable"]
