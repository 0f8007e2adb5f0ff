"""Is a model folder a vision-language model, and what does one image cost it?

A folder is a VLM when its `config.json` has a `vision_config` object and the folder carries the
image-side configuration a processor is built from (`preprocessor_config.json` or
`processor_config.json`), which is what mlx-vlm's loader needs. Such a model is served through
mlx-vlm (the `vision` extra) and advertised with `is_vision`.

Soft tokens per image (the image's share of the KV span, `memory.media.vision_span`) are read
where the model states them, first match wins:

1. a fixed count: `image_seq_length` (processor/preprocessor config; Gemma, PaliGemma),
   `mm_tokens_per_image` (config.json or its text_config; Gemma 3), `num_image_tokens`,
   `image_token_count`;
2. a pixel budget (Qwen-VL style): `max_pixels` (or `size.max_pixels` / `size.longest_edge²`)
   with `patch_size` and `merge_size`: at most `max_pixels / (patch_size × merge_size)²` tokens;
3. otherwise None, and the policy's conservative default (1024) applies.

Input pixels per image (the resolution the processor resizes to; its tensors are that size whatever
the image's): `size.height × size.width`, else `max_pixels` / `size.max_pixels`, else
`size.longest_edge²`, else `vision_config.image_size²`, else the policy's 1024² default.

The vision tower's weights are in the same `model*.safetensors` files as the language model, so
the fit verdict (padded on-disk weights) includes them; `vision_weight_bytes` says how much of the
total they are, read from the safetensors headers.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from memory.media import DEFAULT_INPUT_PIXELS

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
_COUNT_KEYS = ("image_seq_length", "mm_tokens_per_image", "num_image_tokens", "image_token_count")
# Tensor name prefixes of vision towers and projectors across mlx-vlm architectures.
_VISION_PREFIXES = ("vision_tower", "vision_model", "visual", "multi_modal_projector", "mm_projector",
                    "vision_embed", "image_newline")
_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4,
          "I64": 8, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True, slots=True)
class VisionInfo:
    soft_tokens_per_image: int | None  # None: the model states none (the policy's default applies)
    vision_weight_bytes: int  # of the model's weight bytes, those of the vision tower and projector
    input_pixels: int = DEFAULT_INPUT_PIXELS  # the processor's output resolution per image
    # Text tokens the processor wraps around each image beyond its template marker (Gemma 3: blank
    # lines, begin/end of image). Not in any config: measured by the engine at load (0 until then).
    image_text_tokens: int = 0


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def soft_tokens_per_image(config: Mapping[str, Any], processor_configs: Sequence[Mapping[str, Any]]) -> int | None:
    """The soft tokens one image occupies, as the configs state them (see the module docstring)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    sources = [*processor_configs, config, text]
    for source in sources:
        nested = source.get("image_processor")
        for candidate in (source, nested if isinstance(nested, Mapping) else {}):
            for key in _COUNT_KEYS:
                if (n := _positive_int(candidate.get(key))) is not None:
                    return n
    for source in processor_configs:
        size = source.get("size") if isinstance(source.get("size"), Mapping) else {}
        max_pixels = _positive_int(source.get("max_pixels")) or _positive_int(size.get("max_pixels"))
        if max_pixels is None and (edge := _positive_int(size.get("longest_edge"))) is not None:
            max_pixels = edge * edge
        patch = _positive_int(source.get("patch_size"))
        merge = _positive_int(source.get("merge_size")) or 1
        if max_pixels is not None and patch is not None:
            return max(1, max_pixels // (patch * merge) ** 2)
    return None


def input_pixels(config: Mapping[str, Any], processor_configs: Sequence[Mapping[str, Any]]) -> int:
    """Pixels of one image as the processor hands it to the vision tower (see the module docstring)."""
    for source in processor_configs:
        nested = source.get("image_processor")
        for candidate in (source, nested if isinstance(nested, Mapping) else {}):
            size = candidate.get("size") if isinstance(candidate.get("size"), Mapping) else {}
            h, w = _positive_int(size.get("height")), _positive_int(size.get("width"))
            if h is not None and w is not None:
                return h * w
            cap = _positive_int(candidate.get("max_pixels")) or _positive_int(size.get("max_pixels"))
            if cap is not None:
                return cap
            if (edge := _positive_int(size.get("longest_edge"))) is not None:
                return edge * edge
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), Mapping) else {}
    if (side := _positive_int(vision.get("image_size"))) is not None:
        return side * side
    return DEFAULT_INPUT_PIXELS


def vision_weight_bytes(weight_files: Sequence[Path]) -> int:
    """Bytes of the tensors that belong to the vision tower and projector (headers only)."""
    total = 0
    for path in weight_files:
        try:
            with safe_open(str(path), framework="numpy") as handle:
                for name in handle.keys():
                    if not name.startswith(_VISION_PREFIXES) and not name.split(".", 1)[-1].startswith(_VISION_PREFIXES):
                        continue
                    tensor = handle.get_slice(name)
                    count = 1
                    for dim in tensor.get_shape():
                        count *= dim
                    total += count * _BYTES.get(tensor.get_dtype(), 4)
        except (SafetensorError, OSError):
            continue  # discovery has already checked the files; a race just counts nothing
    return total


def vision_runtime_available() -> bool:
    """mlx-vlm and Pillow (the `vision` extra) are installed, so a vision model can load and serve."""
    return all(importlib.util.find_spec(name) is not None for name in ("mlx_vlm", "PIL"))


def vision_info(directory: Path, config: Mapping[str, Any], weight_files: Sequence[Path]) -> VisionInfo | None:
    """VisionInfo for a VLM folder, None for a text-only model."""
    if not isinstance(config.get("vision_config"), Mapping):
        return None
    present = [directory / name for name in PROCESSOR_FILES if (directory / name).is_file()]
    if not present:
        return None
    processors = [_read_json(p) for p in present]
    return VisionInfo(soft_tokens_per_image(config, processors), vision_weight_bytes(weight_files),
                      input_pixels(config, processors))


__all__ = ["PROCESSOR_FILES", "VisionInfo", "input_pixels", "vision_runtime_available", "soft_tokens_per_image", "vision_info",
           "vision_weight_bytes"]
