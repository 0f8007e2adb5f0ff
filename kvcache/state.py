"""mlx-lm cache lists ↔ what the tiers keep. Engine thread only, but for `host_copy`.

The tiers store plain `KVCache` layers (the Llama-style models mlx-lm builds by default), cut to
exactly the token sequence they are keyed by (a finished request's prompt + completion, or a
shorter prefix of a cache), and the slice is made contiguous so its `nbytes` is what the entry
really pins (mlx-lm's own buffers are rounded up to 256-token steps).

Nothing here waits for the device: `prefix_copy` only schedules its copies (`mx.async_eval`), so
a store or a fetch between two decode steps never stalls the step in flight (an `mx.eval` there
waited for it: the copy reads the batch cache that step writes). `host_copy` reads arrays that are
already evaluated into host bytes with no MLX operation, so the SSD tier's writer thread does the
device→host copy, not the engine thread (`ModelKvCache` hands an entry over only once it is done).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from kvcache.bits import KvBits
from kvcache.host import HostArray, HostCache, copy_sliced
from kvcache.quantized import PromptQuantizedKVCache

# MLX dtype ↔ (name on disk, numpy dtype used to move the bytes). bfloat16 travels as uint16 bits.
_DTYPES: dict[mx.Dtype, tuple[str, type]] = {
    mx.float32: ("float32", np.float32),
    mx.float16: ("float16", np.float16),
    mx.bfloat16: ("bfloat16", np.uint16),
}
# ... and quantized KV's packed values.
_HOST_DTYPES: dict[mx.Dtype, tuple[str, type]] = {**_DTYPES, mx.uint32: ("uint32", np.uint32)}
_BY_NAME: dict[str, tuple[mx.Dtype, type]] = {name: (dt, npt) for dt, (name, npt) in _HOST_DTYPES.items()}


def reusable(cache: Sequence[object]) -> bool:
    """True for a non-empty list of plain `KVCache` layers with KV in them, or of quantized ones (what
    the tiers keep)."""
    if not cache:
        return False
    if all(type(c) is KVCache and not c.empty() and c.keys.dtype in _DTYPES for c in cache):
        return True
    return all(isinstance(c, PromptQuantizedKVCache) and not c.empty() and c.keys[1].dtype in _DTYPES for c in cache)


def quantization(cache: Sequence[object]) -> KvBits | None:
    """The bits of a quantized cache, None for a plain one."""
    first = cache[0] if cache else None
    return first.kv_bits if isinstance(first, PromptQuantizedKVCache) else None


def _parts(c) -> tuple[mx.array, ...]:
    """A layer's arrays: keys and values, or for quantized KV keys' then values' (packed, scales, biases)."""
    return (*c.keys, *c.values) if isinstance(c, PromptQuantizedKVCache) else (c.keys, c.values)


def cache_tokens(cache: Sequence[KVCache]) -> int:
    return cache[0].offset if cache else 0


def cache_nbytes(cache: Sequence[KVCache]) -> int:
    return sum(c.nbytes for c in cache)


def prefix_copy(cache: Sequence[KVCache], n: int) -> list[KVCache]:
    """New `KVCache` layers holding exactly the first `n` positions, contiguous, scheduled (not
    waited for: whatever reads them next, on this thread, waits for them as MLX does for any input).

    The result shares nothing mutable with `cache`: a batch may write into it freely."""
    if not 0 < n <= cache_tokens(cache):
        raise ValueError("prefix length out of range")
    out = []
    for layer in cache:
        if isinstance(layer, PromptQuantizedKVCache):
            c = PromptQuantizedKVCache(layer.kv_bits)
            c.keys = tuple(mx.contiguous(x[..., :n, :]) for x in layer.keys)
            c.values = tuple(mx.contiguous(x[..., :n, :]) for x in layer.values)
        else:
            c = KVCache()
            c.keys = mx.contiguous(layer.keys[..., :n, :])
            c.values = mx.contiguous(layer.values[..., :n, :])
        c.offset = n
        out.append(c)
    mx.async_eval([_parts(c) for c in out])
    return out


def settle(cache: Sequence[KVCache]) -> None:
    """Wait for `cache`'s arrays (engine thread). Cheap once their copy has run: a later step has."""
    mx.eval([_parts(c) for c in cache])


def host_copy(cache: Sequence[KVCache]) -> HostCache:
    """Every layer's keys and values as host bytes. Any thread: the arrays must be evaluated
    (`settle`), contiguous and exactly `cache_tokens` long (what `prefix_copy` makes), so reading them
    is a plain buffer copy (the buffer protocol, no MLX operation; bfloat16 as its 16-bit pattern)."""
    n = cache_tokens(cache)
    return HostCache(n, tuple(tuple(_host_bytes(a, n) for a in _parts(c)) for c in cache), kv_bits=quantization(cache))


def _host_bytes(a: mx.array, n: int) -> HostArray:
    name, _ = _HOST_DTYPES[a.dtype]
    if a.shape[-2] != n:
        raise ValueError("not an entry of exactly its tokens")
    src = memoryview(a).cast("B")
    out = bytearray(len(src))
    copy_sliced(src, memoryview(out))
    return HostArray(name, tuple(a.shape), out)


def _from_host(h: HostArray) -> mx.array:
    dt, np_type = _BY_NAME[h.dtype]
    a = mx.array(np.frombuffer(h.data, dtype=np_type).reshape(h.shape))
    return a.view(dt) if dt == mx.bfloat16 else a


def from_host(host: HostCache) -> list:
    """Rebuild the cache's layers from host bytes (quantized ones as they were), materialized."""
    out = []
    for arrays in host.layers:
        parts = tuple(_from_host(a) for a in arrays)
        if host.kv_bits is None:
            c = KVCache()
            c.keys, c.values = parts
        else:
            c = PromptQuantizedKVCache(host.kv_bits)
            c.keys, c.values = parts[:3], parts[3:]
        c.offset = host.tokens
        out.append(c)
    mx.eval([_parts(c) for c in out])
    return out
