"""Host-side (MLX-free) form of a per-layer KV cache: raw bytes plus dtype names and shapes.

`kvcache/state` converts mlx-lm caches to this form (`host_copy`, on the SSD tier's writer thread) and
back (`from_host`, on the engine thread); `kvcache/ssd` encrypts it to disk and back without touching
MLX, so the on-disk format is tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.bits import KvBits

# Bytes a single copy or cipher call handles: the calls hold the GIL, and the SSD tier's writer
# thread runs beside the engine thread; a 1 MiB slice is ~0.1 ms of copying, ~0.5 ms of AES-GCM.
SLICE_BYTES = 1 << 20

# The dtype names the SSD tier accepts (MLX names), with their item sizes (uint32: quantized KV's packed values).
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "uint32": 4}


@dataclass(frozen=True, slots=True)
class HostArray:
    dtype: str
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError("unsupported dtype")
        if any(d < 0 for d in self.shape):
            raise ValueError("negative dimension")
        if len(self.data) != self.expected_nbytes(self.dtype, self.shape):
            raise ValueError("data does not match dtype and shape")

    @staticmethod
    def expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
        n = DTYPE_ITEMSIZE[dtype]
        for d in shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class HostCache:
    """One cached prefix: `tokens` positions, the arrays of each layer: (keys, values), or for KV kept
    quantized (`kv_bits`), keys then values as `mx.quantize`'s three arrays each (packed values, scales,
    biases)."""

    tokens: int
    layers: tuple[tuple[HostArray, ...], ...]
    kv_bits: KvBits | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(a.data) for layer in self.layers for a in layer)


def copy_sliced(src: memoryview, dst: memoryview) -> None:
    """`dst[:] = src`, a `SLICE_BYTES` slice at a time: the GIL is free between slices, so another
    thread (the engine's) never waits for a whole cache's copy."""
    if len(src) != len(dst):
        raise ValueError("source and destination differ in length")
    for at in range(0, len(src), SLICE_BYTES):
        dst[at: at + SLICE_BYTES] = src[at: at + SLICE_BYTES]
