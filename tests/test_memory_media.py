"""memory.media: the vision request's projected decode bytes, KV span and half-cap limit."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memory.media import (
    DECODE_FIXED_BYTES,
    DECODE_OVERHEAD_FACTOR,
    DEFAULT_SOFT_TOKENS_PER_IMAGE,
    MAX_IMAGE_PIXELS,
    MAX_MEDIA_DECODED_BYTES,
    MAX_REQUEST_IMAGE_PIXELS,
    TENSOR_BYTES_PER_INPUT_PIXEL,
    MediaLimits,
    decoded_length,
    image_pixels,
    projected_decode_bytes,
    request_pixels,
    vision_reservation,
    vision_span,
)
from memory.policy import MAX_BYTES, GiB, default_max_tokens, figures

sides = st.integers(min_value=1, max_value=20_000)
headers = st.one_of(st.tuples(sides, sides), st.just((None, None)), st.tuples(st.just(None), sides))


# -- projected decode bytes -----------------------------------------------------------------------

def test_no_images_project_nothing() -> None:
    assert projected_decode_bytes([]) == 0
    assert request_pixels([]) == 0


FIXED = DECODE_FIXED_BYTES  # once per request with images (measured decoder and processor state)


PER_PIXEL = 4 * DECODE_OVERHEAD_FACTOR  # RGBA raster × decode overhead


def test_one_image_is_rgba_times_the_decode_overhead() -> None:
    assert DECODE_OVERHEAD_FACTOR == 5  # the seed's 4, raised to what our decode path measures
    assert projected_decode_bytes([(640, 480)]) == 640 * 480 * 4 * 5 + FIXED


def test_eight_images_sum() -> None:
    sizes = [(1024, 768)] * 8
    assert projected_decode_bytes(sizes) == 8 * 1024 * 768 * PER_PIXEL + FIXED


def test_each_image_adds_the_models_input_tensor() -> None:
    """A 1×1 image still becomes a 896×896 tensor for a Gemma-3 sized processor."""
    assert TENSOR_BYTES_PER_INPUT_PIXEL == 64
    assert projected_decode_bytes([(1, 1)], input_pixels=896 * 896) == PER_PIXEL + 896 * 896 * 64 + FIXED
    assert projected_decode_bytes([(1, 1)] * 3, input_pixels=896 * 896) == 3 * PER_PIXEL + 3 * 896 * 896 * 64 + FIXED
    assert projected_decode_bytes([], input_pixels=896 * 896) == 0


def test_unreadable_header_counts_as_the_per_image_ceiling() -> None:
    assert image_pixels(None, None) == MAX_IMAGE_PIXELS
    assert image_pixels(0, 100) == MAX_IMAGE_PIXELS
    assert projected_decode_bytes([(None, None)]) == MAX_IMAGE_PIXELS * PER_PIXEL + FIXED
    # Two unreadable headers are clamped by the request ceiling, never beyond it.
    limits = MediaLimits(max_image_pixels=100, max_request_pixels=150)
    assert projected_decode_bytes([(None, None), (None, None)], limits) == 150 * PER_PIXEL + FIXED


def test_clamped_at_the_request_ceiling() -> None:
    # A decode bomb's header: 16000² is far above both ceilings; the projection stops at the request one.
    assert projected_decode_bytes([(16_000, 16_000)]) == MAX_REQUEST_IMAGE_PIXELS * PER_PIXEL + FIXED
    assert projected_decode_bytes([(8192, 6144)] * 3) == MAX_REQUEST_IMAGE_PIXELS * PER_PIXEL + FIXED
    # Just under the request ceiling: not clamped.
    assert projected_decode_bytes([(8192, 6144)] * 2) == 2 * 8192 * 6144 * PER_PIXEL + FIXED


def test_stated_ceilings() -> None:
    assert MAX_MEDIA_DECODED_BYTES == 25 * 2**20
    assert MAX_IMAGE_PIXELS == 8192 * 6144
    assert MAX_REQUEST_IMAGE_PIXELS == 2 * MAX_IMAGE_PIXELS
    assert 16_000 * 16_000 > MAX_REQUEST_IMAGE_PIXELS  # the seed's bomb is refused, not just clamped


@given(st.lists(headers, max_size=12), st.integers(0, 4096 * 4096))
def test_projection_properties(sizes: list, input_pixels: int) -> None:
    projected = projected_decode_bytes(sizes, input_pixels=input_pixels)
    pixels = request_pixels(sizes)
    assert projected == (pixels * PER_PIXEL + len(sizes) * input_pixels * 64 + FIXED if sizes else 0)
    assert 0 <= pixels <= MAX_REQUEST_IMAGE_PIXELS
    readable = sum(w * h for w, h in sizes if w is not None and h is not None)
    unreadable = sum(1 for w, h in sizes if w is None or h is None)
    assert pixels == min(readable + unreadable * MAX_IMAGE_PIXELS, MAX_REQUEST_IMAGE_PIXELS)


@given(st.lists(headers, max_size=8), headers)
def test_projection_is_monotonic(sizes: list, extra: tuple) -> None:
    assert projected_decode_bytes(sizes + [extra]) >= projected_decode_bytes(sizes)


def test_saturates_instead_of_overflowing() -> None:
    limits = MediaLimits(max_image_pixels=MAX_BYTES, max_request_pixels=MAX_BYTES)
    assert projected_decode_bytes([(2**40, 2**40)] * 3, limits) == MAX_BYTES


# -- data: URI lengths ----------------------------------------------------------------------------

@given(st.binary(max_size=300))
def test_decoded_length_matches_base64(raw: bytes) -> None:
    text = base64.b64encode(raw)
    assert decoded_length(len(text), text.count(b"=")) == len(raw)


def test_decoded_length_of_unpadded_is_an_upper_bound() -> None:
    assert decoded_length(6) == 6  # "AAAAAA" is 4.5 bytes: counted as a padded 8-char group
    assert decoded_length(0) == 0
    assert decoded_length(-5) == 0


# -- KV span ------------------------------------------------------------------------------------

def test_span_of_text_only() -> None:
    span = vision_span(prompt_tokens=100, images=0, soft_tokens_per_image=256, context_length=4096, max_tokens=50)
    assert (span.input_tokens, span.max_tokens, span.tokens) == (100, 50, 150)


def test_span_covers_prompt_soft_tokens_and_output() -> None:
    # The seed's false-admit bug reserved the output alone; the span is prompt + vision + output.
    span = vision_span(prompt_tokens=40, images=1, soft_tokens_per_image=256, context_length=8192, max_tokens=64)
    assert span.tokens == 40 + 256 + 64
    span8 = vision_span(prompt_tokens=40, images=8, soft_tokens_per_image=256, context_length=8192, max_tokens=64)
    assert span8.tokens == 40 + 8 * 256 + 64
    assert span8.vision_tokens == 40 + 8 * 256


def test_span_defaults_to_1024_soft_tokens() -> None:
    assert DEFAULT_SOFT_TOKENS_PER_IMAGE == 1024
    span = vision_span(prompt_tokens=10, images=2, soft_tokens_per_image=None, context_length=32768, max_tokens=5)
    assert span.tokens == 10 + 2048 + 5


def test_span_clamps_input_to_context_then_adds_output() -> None:
    span = vision_span(prompt_tokens=500, images=8, soft_tokens_per_image=None, context_length=4096, max_tokens=100)
    assert span.input_tokens == 4096
    assert span.tokens == 4096 + 100


def test_span_default_output_is_the_text_default() -> None:
    span = vision_span(prompt_tokens=10, images=1, soft_tokens_per_image=16, context_length=4096, max_tokens=None)
    assert span.max_tokens == default_max_tokens(4096) == 4096
    unbounded = vision_span(prompt_tokens=10, images=1, soft_tokens_per_image=16, context_length=None, max_tokens=None)
    assert unbounded.input_tokens == 26 and unbounded.max_tokens == 8192


@given(prompt=st.integers(0, 10**6), images=st.integers(0, 64), soft=st.one_of(st.none(), st.integers(0, 20_000)),
       context=st.one_of(st.none(), st.integers(1, 10**6)), out=st.one_of(st.none(), st.integers(1, 10**5)))
def test_span_properties(prompt: int, images: int, soft: int | None, context: int | None, out: int | None) -> None:
    span = vision_span(prompt_tokens=prompt, images=images, soft_tokens_per_image=soft, context_length=context,
                       max_tokens=out)
    per_image = DEFAULT_SOFT_TOKENS_PER_IMAGE if soft is None else soft
    wanted_input = prompt + images * per_image
    assert span.input_tokens == (wanted_input if context is None else min(wanted_input, context))
    assert span.tokens == span.input_tokens + span.max_tokens
    if out is not None:
        assert span.max_tokens == out
    # Never less than what a text request of the same prompt and output would reserve.
    text_only = vision_span(prompt_tokens=prompt, images=0, soft_tokens_per_image=soft, context_length=context,
                            max_tokens=out)
    assert span.tokens >= text_only.tokens


# -- half the hard cap --------------------------------------------------------------------------

def test_a_vision_request_never_reserves_more_than_half_the_hard_cap() -> None:
    cap = figures(16 * GiB, env={})
    assert cap.single_request_limit_bytes == cap.hard_cap_bytes // 2
    fits = vision_reservation(cap, media_bytes=GiB, kv_bytes=cap.hard_cap_bytes // 2 - GiB)
    assert fits.within_limit and fits.total_bytes == cap.hard_cap_bytes // 2
    over = vision_reservation(cap, media_bytes=GiB, kv_bytes=cap.hard_cap_bytes // 2 - GiB + 1)
    assert not over.within_limit


@given(media=st.integers(0, 2**62), kv=st.integers(0, 2**62), physical=st.integers(0, 2**40))
def test_reservation_limit_property(media: int, kv: int, physical: int) -> None:
    cap = figures(physical, env={})
    r = vision_reservation(cap, media_bytes=media, kv_bytes=kv)
    assert r.within_limit == (min(media + kv, MAX_BYTES) <= cap.hard_cap_bytes // 2)


@pytest.mark.parametrize("images", [0, 1, 8])
def test_projection_and_span_together(images: int) -> None:
    """0, 1 and 8 images of 800×600 on a Gemma-like model (256 soft tokens per image)."""
    sizes = [(800, 600)] * images
    assert projected_decode_bytes(sizes) == (images * 800 * 600 * PER_PIXEL + FIXED if images else 0)
    span = vision_span(prompt_tokens=30, images=images, soft_tokens_per_image=256, context_length=131072,
                       max_tokens=200)
    assert span.tokens == 30 + images * 256 + 200
