"""Host-side (MLX-free) form of a per-layer KV cache: raw bytes plus dtype names and shapes.

`kvcache/state` converts mlx-lm caches to this form (`host_copy`, on the SSD tier's writer thread) and
back (`from_host`, on the engine thread); `kvcache/ssd` encrypts it to disk and back without touching
MLX, so the on-disk format is tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass

# The dtype names the SSD tier accepts (MLX names), with their item sizes.
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class HostArray:
    dtype: str
    shape: tuple[int, ...]
    data: bytes

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
    """One cached prefix: `tokens` positions, a (keys, values) pair per layer."""

    tokens: int
    layers: tuple[tuple[HostArray, HostArray], ...]

    @property
    def nbytes(self) -> int:
        return sum(len(k.data) + len(v.data) for k, v in self.layers)
