"""Images made in the tests (nothing downloaded): PNG / JPEG bytes, data: URIs, a PNG decode bomb."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image


def png_bytes(width: int, height: int, color=(200, 40, 40), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(width: int, height: int, color=(30, 160, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def noise_png(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of random pixels (does not compress: a realistic decode)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG",
                                                                                    compress_level=1)
    return buf.getvalue()


def data_uri(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def bomb_png(side: int = 16_000) -> bytes:
    """A valid 1-bit grayscale PNG of side×side, all zeros, compressed row by row (no raster)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed bits
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def image_part(uri: str) -> dict:
    return {"type": "image_url", "image_url": {"url": uri}}


def detokenized(model_path, token_ids: list[int], eos: frozenset[int] = frozenset({1, 4})) -> str:
    """Token ids as the engine streams them: mlx-lm's streaming detokenizer over the model's
    tokenizer, EOS left out. (mlx-vlm's own `text` shows invalid UTF-8 from a random model's
    tokens differently; comparing through one detokenizer compares the tokens.)"""
    from mlx_lm.utils import load_tokenizer

    detok = load_tokenizer(model_path).detokenizer
    for token in token_ids:
        if token not in eos:
            detok.add_token(token)
    detok.finalize()
    return detok.text
