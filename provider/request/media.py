"""Images in a chat request: bounds before allocation, then the decode.

`inspect_images(urls)` runs before admission and allocates nothing large: for each `image_url` it

1. refuses a remote `http(s)://` URL (the provider never fetches on a consumer's behalf) and any
   scheme but `data:` — 415 `unsupported_media`;
2. reads the `data:` URI's media type (`image/*` only, 415 otherwise) and computes its decoded
   length from the base64 length — refused above 25 MiB *before* decoding, 413 `media_too_large`;
3. decodes the base64 (bounded by step 2) and reads width and height from the image **header only**
   (Pillow's lazy `Image.open(...).size`: no raster exists yet) — an unreadable header, a format we
   do not decode, or a header above the per-image pixel ceiling is refused, 400 `invalid_media`
   (a decode bomb: a 16000×16000 PNG is a few KB compressed and 1 GB as a raster);
4. refuses more than `max_images` images, or a pixel total above the per-request ceiling, 400.

The result, a `MediaPlan`, carries the compressed bytes and header sizes: admission projects the
decode bytes from it and the model's input resolution (`memory.media`), and `decode_images(plan)` — run only after the `media`
reservation is in the ledger — makes the RGB rasters (EXIF orientation applied, as mlx-vlm's own
`load_image` does). Ceilings: `memory.media.MediaLimits` (stated in deploy/README.md).

Privacy: a refusal carries a fixed `Failure` and a short `kind` for logs; never a URL or its bytes.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from memory.media import DEFAULT_LIMITS, MediaLimits, decoded_length, projected_decode_bytes, request_pixels
from protocol.errors import Failure

# Formats Pillow decodes that consumers send; anything else (TIFF, PSD, ICO, ...) is refused.
DECODABLE_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})


class MediaRefused(ValueError):
    """An image the request may not carry. `failure` becomes the frame; `kind` is safe to log."""

    def __init__(self, failure: Failure, kind: str) -> None:
        super().__init__(kind)
        self.failure = failure
        self.kind = kind


@dataclass(frozen=True, slots=True)
class ImageHeader:
    """One image as its header describes it, with its compressed bytes (never logged)."""

    width: int
    height: int
    format: str
    data: bytes = field(repr=False)

    @property
    def pixels(self) -> int:
        return self.width * self.height


@dataclass(frozen=True, slots=True)
class MediaPlan:
    """The images of one request, checked against the ceilings, not yet decoded."""

    images: tuple[ImageHeader, ...]
    limits: MediaLimits = DEFAULT_LIMITS

    @property
    def count(self) -> int:
        return len(self.images)

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        return tuple((im.width, im.height) for im in self.images)

    @property
    def pixels(self) -> int:
        return request_pixels(self.sizes, self.limits)

    def decode_bytes(self, input_pixels: int) -> int:
        """The projected peak of decoding these images into a model's pixel tensors of
        `input_pixels` each (the `media` reservation; memory.media.projected_decode_bytes)."""
        return projected_decode_bytes(self.sizes, self.limits, input_pixels=input_pixels)


NO_MEDIA = MediaPlan(())


def _payload_start(url: str, limits: MediaLimits) -> int:
    """Where the base64 payload of an image `data:` URI starts, after the length check. Nothing
    is copied: the payload is sliced only once it is known to decode to at most the ceiling."""
    scheme = url[:8].lower()
    if scheme.startswith(("http://", "https://")):
        raise MediaRefused(Failure.unsupported_media(), "remote_url")
    if not scheme.startswith("data:"):
        raise MediaRefused(Failure.unsupported_media(), "url_scheme")
    comma = url.find(",", 0, 256)  # a media type with parameters is short
    if comma < 0:
        raise MediaRefused(Failure.invalid_media(), "data_uri")
    params = url[len("data:"):comma].split(";")
    if not params[0].lower().startswith("image/"):
        raise MediaRefused(Failure.unsupported_media(), "media_type")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise MediaRefused(Failure.invalid_media(), "data_uri")
    length = len(url) - comma - 1
    padding = (url[-1] == "=") + (url[-2:] == "==") if length >= 2 else 0
    if decoded_length(length, padding) > limits.max_decoded_bytes:
        raise MediaRefused(Failure.media_too_large(), "decoded_length")
    return comma + 1


def _read_header(data: bytes, limits: MediaLimits) -> ImageHeader:
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:  # no `vision` extra: no model here can take an image anyway
        raise MediaRefused(Failure.unsupported_media(), "no_vision_runtime") from None

    try:
        with warnings.catch_warnings():
            # Pillow warns (and above 2× its own limit raises) for huge headers; our ceiling decides.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:  # lazy: reads the header, decodes nothing
                width, height = image.size
                fmt = (image.format or "").upper()
    except Image.DecompressionBombError:
        raise MediaRefused(Failure.invalid_media(), "image_pixels") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        raise MediaRefused(Failure.invalid_media(), "image_header") from None
    if width <= 0 or height <= 0:
        raise MediaRefused(Failure.invalid_media(), "image_header")
    if width * height > limits.max_image_pixels:
        raise MediaRefused(Failure.invalid_media(), "image_pixels")
    if fmt not in DECODABLE_FORMATS:
        raise MediaRefused(Failure.unsupported_media(), "image_format")
    return ImageHeader(width, height, fmt, data)


def inspect_images(urls: Sequence[str], limits: MediaLimits = DEFAULT_LIMITS) -> MediaPlan:
    """Check every image against the bounds, reading headers only; raises `MediaRefused`.
    Blocking (base64 of up to 25 MiB per image): call it off the event loop."""
    if not urls:
        return NO_MEDIA
    if len(urls) > limits.max_images:
        raise MediaRefused(Failure.invalid_media(), "too_many_images")
    starts = [_payload_start(url, limits) for url in urls]  # every cheap check before any decode
    headers = []
    total = 0
    for url, start in zip(urls, starts, strict=True):
        try:
            data = base64.b64decode(url[start:], validate=True)
        except (binascii.Error, ValueError):
            raise MediaRefused(Failure.invalid_media(), "base64") from None
        header = _read_header(data, limits)
        total += header.pixels
        if total > limits.max_request_pixels:
            raise MediaRefused(Failure.invalid_media(), "request_pixels")
        headers.append(header)
    return MediaPlan(tuple(headers), limits)


def decode_images(plan: MediaPlan) -> list:
    """The RGB rasters of a checked plan (EXIF orientation applied). Allocates up to the projected
    decode bytes: call it only while the plan's `media` reservation is held, off the event loop."""
    from PIL import Image, ImageOps

    images = []
    for header in plan.images:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(header.data)) as image:
                if image.size != (header.width, header.height):  # the bytes cannot change, but be sure
                    raise MediaRefused(Failure.invalid_media(), "image_header")
                try:
                    ImageOps.exif_transpose(image, in_place=True)  # mlx-vlm's load_image does the same
                    if image.mode == "RGB":
                        image.load()  # already RGB: keep this raster rather than copy it
                        images.append(image)
                    else:
                        images.append(image.convert("RGB"))
                except (OSError, ValueError, SyntaxError, EOFError):
                    raise MediaRefused(Failure.invalid_media(), "image_data") from None
    return images


__all__ = ["DECODABLE_FORMATS", "NO_MEDIA", "ImageHeader", "MediaPlan", "MediaRefused", "decode_images",
           "inspect_images"]
