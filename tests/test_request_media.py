"""provider.request.media and the body parser: images are bounded before anything is decoded.

The decode bomb is a real 16000×16000 PNG (1-bit, so it compresses to a few KB without this test
ever holding its raster); "before any raster exists" is checked with the process's peak RSS
(`VmHWM`, reset through /proc/self/clear_refs) and with tracemalloc for the base64 case.
"""

from __future__ import annotations

import base64
import io
import re
import sys
import tracemalloc
from pathlib import Path

import pytest
from PIL import Image

from memory.media import MediaLimits, projected_decode_bytes
from protocol.vocab import FailureCode
from provider.request.body import IMAGE_MARKER, InvalidBody, parse_chat_body
from provider.request.media import MediaRefused, decode_images, inspect_images
from vision_images import bomb_png, data_uri, jpeg_bytes, png_bytes

MiB = 2**20


def peak_rss_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def current_rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def refused(urls, limits: MediaLimits = MediaLimits()) -> MediaRefused:
    with pytest.raises(MediaRefused) as info:
        inspect_images(urls, limits)
    return info.value


# -- headers, not rasters ------------------------------------------------------------------------------

def test_png_and_jpeg_headers_are_read() -> None:
    plan = inspect_images([data_uri(png_bytes(40, 30)), data_uri(jpeg_bytes(64, 48), "image/jpeg")])
    assert plan.sizes == ((40, 30), (64, 48))
    assert [im.format for im in plan.images] == ["PNG", "JPEG"]
    assert plan.decode_bytes(64 * 64) == projected_decode_bytes([(40, 30), (64, 48)], input_pixels=64 * 64)
    assert repr(plan).count("data=") == 0  # the bytes are never in a repr (logs)


def test_decoded_images_are_rgb_with_the_header_size() -> None:
    plan = inspect_images([data_uri(png_bytes(40, 30, (1, 2, 3, 200), mode="RGBA")),
                           data_uri(jpeg_bytes(64, 48), "image/jpeg")])
    images = decode_images(plan)
    assert [(im.mode, im.size) for im in images] == [("RGB", (40, 30)), ("RGB", (64, 48))]


def test_the_16000_square_png_bomb_is_refused_before_any_raster_exists() -> None:
    bomb = bomb_png()
    assert len(bomb) < 200_000  # a few KB on the wire (compressed 1-bit rows)
    uri = data_uri(bomb)
    reset_peak_rss()
    before = current_rss_kib()
    err = refused([uri])
    grew_mib = (peak_rss_kib() - before) / 1024
    assert err.failure.code is FailureCode.INVALID_MEDIA and err.failure.status_code == 400
    assert err.kind == "image_pixels"
    # Its RGBA raster would be 16000² × 4 = 977 MiB; the check held nothing near even one of its rows' worth.
    assert grew_mib < 16, f"RSS grew {grew_mib:.1f} MiB while refusing the bomb"


def test_a_30_mib_data_uri_is_refused_from_its_length_before_decoding() -> None:
    uri = "data:image/png;base64," + "A" * (40 * MiB)  # decodes to 30 MiB
    tracemalloc.start()
    try:
        err = refused([uri])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.failure.code is FailureCode.MEDIA_TOO_LARGE and err.failure.status_code == 413
    assert err.kind == "decoded_length"
    assert peak < MiB  # nothing was decoded (30 MiB would have been allocated)


def test_just_under_25_mib_is_not_refused_for_its_length() -> None:
    limits = MediaLimits(max_decoded_bytes=25 * MiB)
    uri = "data:image/png;base64," + "A" * (25 * MiB // 3 * 4)
    assert refused([uri], limits).kind != "decoded_length"  # it gets as far as the header


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "HTTP://example.com/cat.png",
                                 "http://127.0.0.1:8080/x.png"])
def test_remote_urls_are_refused_and_never_fetched(url: str) -> None:
    err = refused([url])
    assert err.failure.code is FailureCode.UNSUPPORTED_MEDIA and err.kind == "remote_url"


@pytest.mark.parametrize(("url", "code", "kind"), [
    ("file:///etc/passwd", FailureCode.UNSUPPORTED_MEDIA, "url_scheme"),
    ("data:text/plain;base64,aGVsbG8=", FailureCode.UNSUPPORTED_MEDIA, "media_type"),
    ("data:image/png,raw-not-base64", FailureCode.INVALID_MEDIA, "data_uri"),
    ("data:image/png;base64", FailureCode.INVALID_MEDIA, "data_uri"),
    ("data:image/png;base64,@@@@", FailureCode.INVALID_MEDIA, "base64"),
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), FailureCode.INVALID_MEDIA,
     "image_header"),
])
def test_malformed_or_unsupported(url: str, code: FailureCode, kind: str) -> None:
    err = refused([url])
    assert (err.failure.code, err.kind) == (code, kind)


def test_an_undecodable_format_is_unsupported() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="TIFF")
    assert refused([data_uri(buf.getvalue(), "image/tiff")]).failure.code is FailureCode.UNSUPPORTED_MEDIA


def test_too_many_images() -> None:
    one = data_uri(png_bytes(4, 4))
    assert inspect_images([one] * 8).count == 8
    err = refused([one] * 9)
    assert err.failure.code is FailureCode.INVALID_MEDIA and err.kind == "too_many_images"


def test_per_image_and_per_request_pixel_ceilings() -> None:
    limits = MediaLimits(max_image_pixels=100 * 100, max_request_pixels=150 * 100)
    assert inspect_images([data_uri(png_bytes(100, 100))], limits).pixels == 10_000
    assert refused([data_uri(png_bytes(101, 100))], limits).kind == "image_pixels"
    err = refused([data_uri(png_bytes(100, 100)), data_uri(png_bytes(60, 100))], limits)
    assert err.kind == "request_pixels" and err.failure.status_code == 400


def test_no_images_is_the_empty_plan() -> None:
    plan = inspect_images([])
    assert plan.count == 0 and plan.decode_bytes(896 * 896) == 0


# -- the body parser ------------------------------------------------------------------------------------

def test_image_parts_become_markers_and_urls_keep_their_order() -> None:
    body = parse_chat_body({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
            {"type": "image_url", "image_url": "data:image/jpeg;base64,BBBB"},
            {"type": "text", "text": "please"},
        ]},
    ]})
    assert body.images == ("data:image/png;base64,AAAA", "data:image/jpeg;base64,BBBB")
    assert body.messages[0] == {"role": "system", "content": "be brief"}
    assert body.messages[1]["content"] == ({"type": "text", "text": "compare"}, IMAGE_MARKER, IMAGE_MARKER,
                                           {"type": "text", "text": "please"})
    assert "BBBB" not in repr(body.messages)


def test_text_only_parts_still_become_one_string() -> None:
    body = parse_chat_body({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert body.messages[0]["content"] == "ab" and body.images == ()


@pytest.mark.parametrize("part", [{"type": "input_audio", "input_audio": {}}, {"type": "image_url"},
                                  {"type": "image_url", "image_url": {"url": ""}}, {"type": "text"}, "text"])
def test_other_parts_are_invalid(part) -> None:
    with pytest.raises(InvalidBody):
        parse_chat_body({"model": "m", "messages": [{"role": "user", "content": [part]}]})


def test_without_the_vision_extra_an_image_is_unsupported_media(monkeypatch) -> None:
    uri = data_uri(png_bytes(8, 8))
    monkeypatch.setitem(sys.modules, "PIL", None)  # Pillow not installed
    err = refused([uri])
    assert err.failure.code is FailureCode.UNSUPPORTED_MEDIA and err.kind == "no_vision_runtime"
