"""One GGUF tensor's blocks as MLX arrays: kept quantized where MLX's affine format holds the same codes,
requantized (with a note) where it cannot, or plain floats.

MLX's affine quantization stores, per group of `group_size` values along a row, a scale and a bias
(value = scale × code + bias) and packs the codes as one little-endian bit stream in uint32 words. Many
ggml block formats are that same thing at group size 32:

| ggml | block | code bits | scale, bias of each 32 values |
|---|---|---|---|
| Q4_0 | d, 32 × 4-bit | 4 | d, −8d |
| Q4_1 | d, m, 32 × 4-bit | 4 | d, m |
| Q5_0 | d, 32 × 5-bit | 5 | d, −16d |
| Q5_1 | d, m, 32 × 5-bit | 5 | d, m |
| Q8_0 | d, 32 × int8 | 8 | d, −128d (codes shifted by 128) |
| Q4_K | d, dmin, 8 × (6-bit sc, m), 256 × 4-bit | 4 | d·sc, −dmin·m |
| Q5_K | as Q4_K with 5-bit codes | 5 | d·sc, −dmin·m |

Those keep their codes bit for bit; the scales and biases are float16 as in the file (d, m, −8d, −16d,
−128d are exact; the K formats' products d·sc and dmin·m are rounded to float16, a relative 5e-4 of a
scale). Every other quantized type (Q6_K and Q2_K/Q3_K have 16-value sub-blocks, the IQ and TQ types
use codebooks) is decoded by the `gguf` package and requantized by MLX at group size 32 and one bit
more than its bits per weight, rounded up to a width MLX has (`requant_bits`), so it loses little
beside its own quantization; the import prints what it became and its size.

`dequantize=True` gives floats instead: ggml's own decoding (value = d·code + …, in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GROUP = 32
MLX_BITS = (2, 3, 4, 5, 6, 8)
FLOATS = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
}
EXACT_BITS = {
    GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q5_0: 5,
    GGMLQuantizationType.Q5_1: 5, GGMLQuantizationType.Q8_0: 8, GGMLQuantizationType.Q4_K: 4,
    GGMLQuantizationType.Q5_K: 5,
}
_ROWS_PER_CHUNK = 4096  # rows decoded at a time: a chunk's temporaries stay in the tens of MB


class UnsupportedType(Exception):
    """A ggml type this import cannot turn into MLX arrays (the message names it)."""


@dataclass(frozen=True, slots=True)
class Affine:
    """Codes (uint8, one per value) with float32 scales and biases per group of 32 along each row."""

    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int

    def values(self) -> np.ndarray:
        rows, cols = self.codes.shape
        grouped = self.codes.reshape(rows, cols // GROUP, GROUP).astype(np.float32)
        return (grouped * self.scales[..., None] + self.biases[..., None]).reshape(rows, cols)


def is_float(qtype: GGMLQuantizationType) -> bool:
    return qtype in FLOATS or qtype is GGMLQuantizationType.BF16


def bits_per_weight(qtype: GGMLQuantizationType) -> float:
    block, size = GGML_QUANT_SIZES[qtype]
    return size * 8 / block


def requant_bits(qtype: GGMLQuantizationType) -> int:
    """The MLX width a type without an exact mapping is requantized to: one bit more than its bits per
    weight, rounded up to a width MLX has (Q6_K 6.56 → 8, Q3_K 3.44 → 5, Q2_K 2.63 → 4)."""
    wanted = bits_per_weight(qtype) + 1
    return next((bits for bits in MLX_BITS if bits >= wanted), MLX_BITS[-1])


def can_requantize(qtype: GGMLQuantizationType) -> bool:
    """`gguf` can decode it (every type llama.cpp writes to files today)."""
    try:
        quants.dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


# --- the exact formats: codes, scales and biases of each 32 values


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start:start + 2].copy().view("<f2").astype(np.float32)  # (blocks, 1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit layout: byte j holds value j (low nibble) and value j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of the 32-bit word is value j's fifth bit."""
    word = qh.copy().view("<u4")  # (blocks, 1)
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The K formats' eight 6-bit (scale, min) pairs, packed in 12 bytes."""
    s = raw.astype(np.uint8)
    low = [s[:, j] & 63 for j in range(4)] + [(s[:, j + 4] & 0x0F) | ((s[:, j - 4] >> 6) << 4) for j in range(4, 8)]
    mins = [s[:, j + 4] & 63 for j in range(4)] + [(s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4) for j in range(4, 8)]
    return np.stack(low, axis=1).astype(np.float32), np.stack(mins, axis=1).astype(np.float32)


def _decode_exact(qtype: GGMLQuantizationType, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes per value, scale per 32, bias per 32) for `blocks` (one row of bytes per block)."""
    n = len(blocks)
    if qtype is GGMLQuantizationType.Q4_0:
        d = _half(blocks, 0)
        return _nibbles(blocks[:, 2:18]), d, -8 * d
    if qtype is GGMLQuantizationType.Q4_1:
        return _nibbles(blocks[:, 4:20]), _half(blocks, 0), _half(blocks, 2)
    if qtype is GGMLQuantizationType.Q5_0:
        d = _half(blocks, 0)
        return _nibbles(blocks[:, 6:22]) | _high_bits(blocks[:, 2:6]), d, -16 * d
    if qtype is GGMLQuantizationType.Q5_1:
        return _nibbles(blocks[:, 8:24]) | _high_bits(blocks[:, 4:8]), _half(blocks, 0), _half(blocks, 2)
    if qtype is GGMLQuantizationType.Q8_0:
        d = _half(blocks, 0)
        return blocks[:, 2:34] ^ np.uint8(0x80), d, -128 * d
    if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        d, dmin = _half(blocks, 0), _half(blocks, 2)
        sc, m = _k_scales(blocks[:, 4:16])
        if qtype is GGMLQuantizationType.Q4_K:
            qs = blocks[:, 16:144].reshape(n, 4, 32)
            codes = np.stack([qs & 0x0F, qs >> 4], axis=2)  # (n, chunk, low/high, 32)
        else:
            qh = blocks[:, 16:48].reshape(n, 1, 1, 32)
            qs = blocks[:, 48:176].reshape(n, 4, 32)
            shift = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1, 1) + np.arange(2, dtype=np.uint8).reshape(1, 1, 2, 1)
            codes = np.stack([qs & 0x0F, qs >> 4], axis=2) | (((qh >> shift) & 1) << 4)
        return codes.reshape(n, 256), d * sc, -dmin * m
    raise AssertionError(qtype)


def decode_affine(qtype: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, int]) -> Affine:
    """A 2-D tensor of an exact type as codes, scales and biases (float32, ggml's own products)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    codes, scales, biases = _decode_exact(qtype, raw.reshape(-1, size))
    return Affine(codes.reshape(rows, cols), scales.reshape(rows, cols // GROUP),
                  biases.reshape(rows, cols // GROUP), EXACT_BITS[qtype])


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing: the codes of a row as one little-endian bit stream, read as uint32 words."""
    rows, cols = codes.shape
    if bits == 8:
        return np.ascontiguousarray(codes, dtype=np.uint8).view("<u4")
    if bits == 4:
        return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4), dtype=np.uint8).view("<u4")
    stream = (codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(stream.reshape(rows, cols * bits), axis=-1, bitorder="little").view("<u4")


# --- one tensor


def floats(qtype: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, ...]) -> mx.array:
    """A float tensor as it is in the file (BF16 through MLX: numpy has no bfloat16)."""
    if qtype is GGMLQuantizationType.BF16:
        return mx.array(raw.view("<u2").reshape(shape)).view(mx.bfloat16)
    return mx.array(raw.view(FLOATS[qtype]).reshape(shape))


def decoded(qtype: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Any quantized type's values as float32, ggml's own decoding (through `gguf` where not exact)."""
    if qtype in EXACT_BITS and len(shape) == 2:
        return decode_affine(qtype, raw, (shape[0], shape[1])).values()
    try:
        values = quants.dequantize(raw.reshape(-1, GGML_QUANT_SIZES[qtype][1]), qtype)
    except NotImplementedError:
        raise UnsupportedType(qtype.name) from None
    return values.reshape(shape).astype(np.float32, copy=False)


def _row_chunks(rows: int) -> list[slice]:
    return [slice(start, min(rows, start + _ROWS_PER_CHUNK)) for start in range(0, rows, _ROWS_PER_CHUNK)]


def quantized(qtype: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, int],
              scale_dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array, int]:
    """A 2-D quantized tensor as MLX affine (weight, scales, biases, bits): its own codes where the
    format is exact, else requantized (`requant_bits`)."""
    rows, cols = shape
    row_bytes = raw.size // rows
    by_row = raw.reshape(rows, row_bytes)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray] | tuple[mx.array, mx.array, mx.array]] = []
    if qtype in EXACT_BITS:
        bits = EXACT_BITS[qtype]
        for part in _row_chunks(rows):
            affine = decode_affine(qtype, by_row[part], (part.stop - part.start, cols))
            parts.append((pack(affine.codes, bits), affine.scales, affine.biases))
    else:
        bits = requant_bits(qtype)
        for part in _row_chunks(rows):
            values = decoded(qtype, by_row[part], (part.stop - part.start, cols))
            w, s, b = mx.quantize(mx.array(values), group_size=GROUP, bits=bits)
            parts.append((w, s, b))
    weight, scales, biases = (mx.concatenate([mx.array(p[i]) for p in parts]) if len(parts) > 1
                              else mx.array(parts[0][i]) for i in range(3))
    return weight, scales.astype(scale_dtype), biases.astype(scale_dtype), bits


def quantized_bytes(qtype: GGMLQuantizationType, shape: tuple[int, int], scale_dtype_bytes: int) -> int:
    """What `quantized` will return, in bytes (for the plan, before anything is read)."""
    rows, cols = shape
    bits = EXACT_BITS.get(qtype) or requant_bits(qtype)
    return rows * cols * bits // 8 + 2 * rows * (cols // GROUP) * scale_dtype_bytes


__all__ = ["Affine", "EXACT_BITS", "GROUP", "UnsupportedType", "bits_per_weight", "can_requantize", "decode_affine",
           "decoded", "floats", "is_float", "pack", "quantized", "quantized_bytes", "requant_bits"]
