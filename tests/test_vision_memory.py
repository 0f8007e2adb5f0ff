"""The media projection against the real decode: for random image sizes within the ceilings, the
projected decode bytes (memory.media: `width × height × 4 × 4` summed, + the model-resolution
tensor term, + the fixed term) are at least the process's measured peak RSS growth while the
images are decoded and turned into the model's pixel tensor — the memory the `media` reservation
stands for until the vision encoder has run. Two processors: the tiny VLM's (64² input) and the
same one resized to Gemma 3's 896² input (the processor alone; no weights needed).

Measured with the kernel's own peak (`VmHWM`, reset through /proc/self/clear_refs) after returning
freed heap to the OS (`malloc_trim`), so earlier allocations cannot hide the growth — in a process of
its own (one spawned worker per processor), so no other test's threads can add to the figure.
"""

from __future__ import annotations

import ctypes
import gc
import io
import json
import multiprocessing
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from memory.media import MAX_IMAGE_PIXELS, MAX_REQUEST_IMAGE_PIXELS, projected_decode_bytes
from provider.models.vision import input_pixels
from provider.request.media import decode_images, inspect_images
from vision_images import data_uri

_PROCESSOR: dict = {}


def processor(model_path: Path):
    if model_path not in _PROCESSOR:
        from mlx_vlm.utils import load_config, load_processor

        _PROCESSOR[model_path] = (load_processor(model_path, add_detokenizer=False), load_config(model_path))
    return _PROCESSOR[model_path]


@pytest.fixture(scope="module", params=[64, 896], ids=["input-64", "input-896"])
def processor_dir(request, tiny_vlm_path, tmp_path_factory) -> Iterator[tuple[Path, int, Any]]:
    """The tiny VLM's processor files, its preprocessor resized to `param`² (weights not copied)."""
    side = request.param
    folder = tmp_path_factory.mktemp(f"processor-{side}")
    for name in ("config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "preprocessor_config.json"):
        shutil.copy(tiny_vlm_path / name, folder / name)
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    pre["size"] = {"height": side, "width": side}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    info_pixels = input_pixels(json.loads((folder / "config.json").read_text()), [pre])
    assert info_pixels == side * side
    with multiprocessing.get_context("spawn").Pool(1) as worker:  # a clean process: only our decode runs
        yield folder, info_pixels, worker


def rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def encoded(width: int, height: int, kind: str) -> bytes:
    """A smooth image (compresses well, decodes to a full raster like any other)."""
    mode = "RGBA" if kind == "png-rgba" else "RGB"
    image = Image.linear_gradient("L").resize((width, height)).convert(mode)
    buf = io.BytesIO()
    image.save(buf, format="JPEG" if kind == "jpeg" else "PNG", **({"quality": 90} if kind == "jpeg" else {}))
    return buf.getvalue()


def measure_peak(folder: str, images: list[tuple[int, int, str]]) -> int:
    """In the worker process: encode the images, warm the processor, then the peak RSS growth (bytes)
    of decoding them and making the pixel tensor."""
    uris = [data_uri(encoded(w, h, kind), "image/jpeg" if kind == "jpeg" else "image/png") for w, h, kind in images]
    decode_and_prepare(Path(folder), uris[:1])  # the processor's lazy state, outside the measurement
    gc.collect()
    mx.clear_cache()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before = rss_kib("VmRSS")
    decode_and_prepare(Path(folder), uris)
    return (rss_kib("VmHWM") - before) * 1024


def decode_and_prepare(model_path: Path, uris: list[str]) -> None:
    """What the media reservation covers: the rasters, the processor's pixel tensor, its MLX copy."""
    from mlx_vlm.utils import prepare_inputs

    from provider.engine.vlm import render_prompt

    proc, config = processor(model_path)
    plan = inspect_images(uris)
    images = decode_images(plan)
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}] + [{"type": "image_url"}] * len(uris)}]
    prompt, _ = render_prompt(proc, config, messages)
    inputs = prepare_inputs(proc, images=images, prompts=prompt, image_token_index=config.get("image_token_index"))
    mx.eval(inputs["pixel_values"])


side = st.integers(min_value=1, max_value=8192)
image = st.tuples(side, side, st.sampled_from(["png", "png-rgba", "jpeg"])).filter(
    lambda t: t[0] * t[1] <= MAX_IMAGE_PIXELS)


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example([(8192, 6144, "png")])  # the per-image ceiling
@example([(4000, 3000, "png-rgba"), (4000, 3000, "jpeg")])
@example([(1, 1, "png")] * 3)  # tiny images: the model-resolution tensors dominate
@given(st.lists(image, min_size=1, max_size=3).filter(
    lambda ims: sum(w * h for w, h, _ in ims) <= MAX_REQUEST_IMAGE_PIXELS))
def test_projection_covers_the_measured_decode_peak(processor_dir, images) -> None:
    folder, pixels, worker = processor_dir
    projected = projected_decode_bytes([(w, h) for w, h, _ in images], input_pixels=pixels)
    grew = worker.apply(measure_peak, (str(folder), images))
    assert grew <= projected, f"decode of {images} grew RSS by {grew} bytes, projected {projected}"
