"""mlx-lm cache lists ↔ what the tiers keep. Engine thread only: everything here runs MLX.

The tiers store plain `KVCache` layers (the Llama-style models mlx-lm builds by default), cut to
exactly the token sequence they are keyed by (a finished request's prompt + completion, or a
shorter prefix of a cache), and the slice is made contiguous so its `nbytes` is what the entry
really pins (mlx-lm's own buffers are rounded up to 256-token steps).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from kvcache.host import HostArray, HostCache

# MLX dtype ↔ (name on disk, numpy dtype used to move the bytes). bfloat16 travels as uint16 bits.
_DTYPES: dict[mx.Dtype, tuple[str, type]] = {
    mx.float32: ("float32", np.float32),
    mx.float16: ("float16", np.float16),
    mx.bfloat16: ("bfloat16", np.uint16),
}
_BY_NAME: dict[str, tuple[mx.Dtype, type]] = {name: (dt, npt) for dt, (name, npt) in _DTYPES.items()}


def reusable(cache: Sequence[object]) -> bool:
    """True for a non-empty list of plain `KVCache` layers with KV in them (what the tiers keep)."""
    return bool(cache) and all(type(c) is KVCache and not c.empty() and c.keys.dtype in _DTYPES
                               for c in cache)


def cache_tokens(cache: Sequence[KVCache]) -> int:
    return cache[0].offset if cache else 0


def cache_nbytes(cache: Sequence[KVCache]) -> int:
    return sum(c.nbytes for c in cache)


def prefix_copy(cache: Sequence[KVCache], n: int) -> list[KVCache]:
    """New `KVCache` layers holding exactly the first `n` positions, materialized.

    The result shares nothing mutable with `cache`: a batch may write into it freely."""
    if not 0 < n <= cache_tokens(cache):
        raise ValueError("prefix length out of range")
    out = []
    for layer in cache:
        c = KVCache()
        c.keys = mx.contiguous(layer.keys[..., :n, :])
        c.values = mx.contiguous(layer.values[..., :n, :])
        c.offset = n
        out.append(c)
    mx.eval([(c.keys, c.values) for c in out])
    return out


def _to_host(a: mx.array) -> HostArray:
    name, np_type = _DTYPES[a.dtype]
    raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return HostArray(name, tuple(a.shape), np.asarray(raw, dtype=np_type).tobytes())


def _from_host(h: HostArray) -> mx.array:
    dt, np_type = _BY_NAME[h.dtype]
    a = mx.array(np.frombuffer(h.data, dtype=np_type).reshape(h.shape))
    return a.view(dt) if dt == mx.bfloat16 else a


def to_host(cache: Sequence[KVCache], n: int | None = None) -> HostCache:
    """Copy the first `n` positions (default: all valid ones) of every layer into host bytes."""
    n = cache_tokens(cache) if n is None else n
    if not 0 < n <= cache_tokens(cache):
        raise ValueError("prefix length out of range")
    mx.eval([(c.keys, c.values) for c in cache])
    layers = tuple((_to_host(c.keys[..., :n, :]), _to_host(c.values[..., :n, :])) for c in cache)
    return HostCache(n, layers)


def from_host(host: HostCache) -> list[KVCache]:
    """Rebuild `KVCache` layers from host bytes, materialized."""
    out = []
    for k, v in host.layers:
        c = KVCache()
        c.keys, c.values, c.offset = _from_host(k), _from_host(v), host.tokens
        out.append(c)
    mx.eval([(c.keys, c.values) for c in out])
    return out
