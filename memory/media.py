"""Vision requests under the cap: decoded media and the KV span, as pure arithmetic.

A vision request commits two kinds of memory that the cap must see *before* they exist:

* **Decoded media.** Image rasters and the processor's pixel arrays are not MLX arrays until late, so
  MLX's counters never show them in time. The projection is the seed's (Darkbloom PR #363):
  per image `width × height × 4` (an RGBA raster) `× DECODE_OVERHEAD_FACTOR` (the raster, the
  converted copy, the resampled pixel tensor and its MLX copy coexist briefly; the seed measured
  ~1.8 GB peak for the 1 GB raster of a 16000² decode bomb with CoreImage and set 4).
  **(ours, measured)** Our decode path — Pillow, then the transformers image processor, which
  works on the full-resolution image before it resizes — peaks at up to 17.2 bytes per source
  pixel (4.3× the RGBA raster; 14–15 for the largest images), so the factor here is 5. Width and height come from the image
  *header* only; an unreadable header counts as `MAX_IMAGE_PIXELS`. Pixels are summed over the
  request and clamped to `MAX_REQUEST_IMAGE_PIXELS`, the same ceiling the request bounds enforce,
  so many unreadable headers cannot project past what a request may ever decode.
  **(ours, measured)** Two terms the seed's rule misses, found by measuring the peak RSS of our
  decode path (tests/test_vision_memory.py): the processor's tensors are at the *model's* input
  resolution, not the image's — Gemma 3's 896² input costs ~39 MB per image (~49 bytes per input
  pixel: float copies and the MLX array) even for a 1×1 image, and puts a 4000×3000 PNG at 17 B/px
  against the rule's 16 — so each image adds `input_pixels × TENSOR_BYTES_PER_INPUT_PIXEL` (64);
  and the decoder and processor state is ~0.3 MB whatever the size, so a request with images adds
  `DECODE_FIXED_BYTES` (4 MiB) once.
* **The whole KV span** (the seed's false-admit fix): prompt text + `soft tokens per image × images`,
  clamped to the context window, then + the output bound. Soft tokens per image come from the
  model's processor config where it states them (Gemma: 256), else `DEFAULT_SOFT_TOKENS_PER_IMAGE`
  (1024, the seed's conservative default).

A single vision request never reserves more than half the hard cap (media + KV together), the
same limit `CapFigures.single_request_limit_bytes` puts on a text request's KV.

The ceilings (also in deploy/README.md) are refusals, checked before any byte is decoded
(`provider/request/media.py` applies them): a `data:` URI whose decoded length — computed from its
base64 length — exceeds `MAX_MEDIA_DECODED_BYTES` (25 MiB, the seed's); more than
`MAX_IMAGES_PER_REQUEST` images; an image above `MAX_IMAGE_PIXELS`; a request above
`MAX_REQUEST_IMAGE_PIXELS` in total. Everything here saturates at `MAX_BYTES`; nothing raises on
huge inputs. No I/O: pixel counts and token counts come in as numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from memory.policy import MAX_BYTES, CapFigures, default_max_tokens, saturate

MiB = 2**20

RGBA_BYTES_PER_PIXEL = 4
DECODE_OVERHEAD_FACTOR = 5  # seed (CoreImage): 4; our Pillow + transformers path measures up to 4.3
MAX_MEDIA_DECODED_BYTES = 25 * MiB  # one data: URI, computed from its base64 length
MAX_IMAGES_PER_REQUEST = 8
MAX_IMAGE_PIXELS = 48 * MiB  # 50.3 Mpx, e.g. 8192 × 6144: a 48 MP phone photo fits, a 16000² bomb does not
MAX_REQUEST_IMAGE_PIXELS = 2 * MAX_IMAGE_PIXELS  # 100.7 Mpx summed over a request
DEFAULT_SOFT_TOKENS_PER_IMAGE = 1024  # seed: 4 × Gemma's 256, when the processor config states none
DEFAULT_MAX_VISION_REQUESTS = 2  # per model, running or waiting (provider setting max_vision_requests)
TENSOR_BYTES_PER_INPUT_PIXEL = 64  # measured ~49 at Gemma 3's 896² (float32 chain + MLX copy)
DECODE_FIXED_BYTES = 4 * MiB  # decoder and processor state (~0.3 MB) + allocator slack (measured up to 1.5 MB)
DEFAULT_INPUT_PIXELS = 1024 * 1024  # a model whose processor config states no input size


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """The request ceilings (defaults above); tests and operators may tighten them."""

    max_decoded_bytes: int = MAX_MEDIA_DECODED_BYTES
    max_images: int = MAX_IMAGES_PER_REQUEST
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_request_pixels: int = MAX_REQUEST_IMAGE_PIXELS


DEFAULT_LIMITS = MediaLimits()


def image_pixels(width: int | None, height: int | None, limits: MediaLimits = DEFAULT_LIMITS) -> int:
    """Pixels one image counts for: `width × height` from its header; an unreadable header
    (`None` or a non-positive side) counts as the per-image ceiling."""
    if width is None or height is None or width <= 0 or height <= 0:
        return limits.max_image_pixels
    return saturate(width * height)


def request_pixels(sizes: Iterable[tuple[int | None, int | None]], limits: MediaLimits = DEFAULT_LIMITS) -> int:
    """Σ image pixels of a request, clamped to the per-request ceiling."""
    total = 0
    for width, height in sizes:
        total = saturate(total + image_pixels(width, height, limits))
    return min(total, limits.max_request_pixels)


def projected_decode_bytes(sizes: Iterable[tuple[int | None, int | None]],
                           limits: MediaLimits = DEFAULT_LIMITS, *, input_pixels: int = 0) -> int:
    """Projected peak bytes of decoding a request's images and making the model's pixel tensors:
    clamped Σ pixels × 4 (RGBA) × 5, + images × `input_pixels` (the model's input resolution) × 64,
    + 4 MiB once. No images: 0."""
    sizes = list(sizes)
    if not sizes:
        return 0
    raster = request_pixels(sizes, limits) * RGBA_BYTES_PER_PIXEL * DECODE_OVERHEAD_FACTOR
    tensors = len(sizes) * max(0, input_pixels) * TENSOR_BYTES_PER_INPUT_PIXEL
    return saturate(raster + saturate(tensors) + DECODE_FIXED_BYTES)


def decoded_length(base64_length: int, padding: int = 0) -> int:
    """Bytes a standard base64 payload of `base64_length` characters decodes to (no decoding):
    3 bytes per 4 characters, less the `=` padding. A length that is not a multiple of 4 is
    counted as if padded, an upper bound."""
    n = max(0, base64_length)
    return max(0, -(-n // 4) * 3 - max(0, min(padding, 2)))


@dataclass(frozen=True, slots=True)
class VisionSpan:
    """The tokens a vision request's KV must hold."""

    input_tokens: int  # prompt text + soft tokens, clamped to the context window
    max_tokens: int  # the output bound added on top
    tokens: int  # input + output: what the KV reservation covers

    @property
    def vision_tokens(self) -> int:
        return self.tokens - self.max_tokens


def vision_span(*, prompt_tokens: int, images: int, soft_tokens_per_image: int | None,
                context_length: int | None, max_tokens: int | None) -> VisionSpan:
    """KV span = min(prompt text + soft tokens × images, context) + output bound.

    `soft_tokens_per_image=None`: the model states none → `DEFAULT_SOFT_TOKENS_PER_IMAGE`.
    `max_tokens=None`: the request sets none → min(context, 8192). `context_length=None`: no
    window to clamp to.
    """
    per_image = DEFAULT_SOFT_TOKENS_PER_IMAGE if soft_tokens_per_image is None else max(0, soft_tokens_per_image)
    raw_input = saturate(max(0, prompt_tokens) + saturate(max(0, images) * per_image))
    context = MAX_BYTES if context_length is None else max(0, context_length)
    input_tokens = min(raw_input, context)
    output = default_max_tokens(context) if max_tokens is None else max(0, max_tokens)
    return VisionSpan(input_tokens=input_tokens, max_tokens=output, tokens=saturate(input_tokens + output))


@dataclass(frozen=True, slots=True)
class VisionReservation:
    """What one vision request reserves: its media (kind `media`) and its KV (kind `request_kv`)."""

    media_bytes: int
    kv_bytes: int
    limit_bytes: int  # half the hard cap, for media and KV together

    @property
    def total_bytes(self) -> int:
        return saturate(self.media_bytes + self.kv_bytes)

    @property
    def within_limit(self) -> bool:
        return self.total_bytes <= self.limit_bytes


def vision_reservation(figures: CapFigures, *, media_bytes: int, kv_bytes: int) -> VisionReservation:
    """Media + KV of one vision request, against the single-request limit (half the hard cap)."""
    return VisionReservation(media_bytes=saturate(media_bytes), kv_bytes=saturate(kv_bytes),
                             limit_bytes=figures.single_request_limit_bytes)
