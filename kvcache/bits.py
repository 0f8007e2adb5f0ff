"""The form quantized KV is kept in (`KvBits`), without MLX: the engine's caches (kvcache/quantized.py),
the tiers' host form and files (kvcache/host.py, kvcache/ssd.py) and the byte counts for admission
(provider/models/kv.py) all name it with this one value.

Keys and values are quantized as `mx.quantize` does it: every `group_size` elements of a key or value
row as integers of `keys` (or `values`) bits, with a scale and a bias of the model's dtype per group.
The two sides have their own bits because they do not hold the same kind of numbers: a few channels
of a trained model's keys are many times larger than the rest, and at 4 bits a group holding one of
them keeps little of its other elements, while the values have no such channels (benchmarks/README.md
has the measurements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GROUP_SIZE = 32  # elements per scale and bias (the smallest group `mx.quantize` takes)
BITS = (2, 3, 4, 5, 6, 8)  # what `mx.quantize` packs
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, slots=True)
class KvBits:
    """Keys kept at `keys` bits and values at `values` bits, a scale and a bias per `group_size` elements."""

    keys: int
    values: int
    group_size: int = GROUP_SIZE

    def __post_init__(self) -> None:
        if self.keys not in BITS or self.values not in BITS:
            raise ValueError(f"quantized KV bits must be among {BITS}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"quantized KV group size must be among {GROUP_SIZES}")

    def __str__(self) -> str:
        return f"K{self.keys} V{self.values} g{self.group_size}"

    def as_json(self) -> dict[str, int]:
        return {"keys": self.keys, "values": self.values, "group_size": self.group_size}

    @classmethod
    def from_json(cls, value: Any) -> KvBits:
        """The value `as_json` made (raises ValueError for anything else)."""
        if not isinstance(value, dict) or set(value) != {"keys", "values", "group_size"} \
                or not all(type(v) is int for v in value.values()):
            raise ValueError("not quantized KV bits")
        return cls(value["keys"], value["values"], value["group_size"])


__all__ = ["BITS", "GROUP_SIZE", "GROUP_SIZES", "KvBits"]
