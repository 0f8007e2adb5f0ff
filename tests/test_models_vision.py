"""provider.models.vision and discovery: VLM folders are recognised, with verdicts whose weights
include the vision tower."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from memory import figures, fit
from memory.policy import GiB, padded_weight_bytes
from memory.snapshot import MemorySnapshot
from provider.models import inspect_model
from provider.models.vision import input_pixels, soft_tokens_per_image


def test_the_tiny_vlm_is_a_vision_model(tiny_vlm_path: Path, tiny_model_path: Path) -> None:
    vlm = inspect_model(tiny_vlm_path, "tiny-vlm")
    assert vlm.is_vision and vlm.vision is not None
    assert vlm.vision.soft_tokens_per_image == 16  # processor_config.json's image_seq_length
    assert vlm.vision.input_pixels == 64 * 64  # preprocessor_config.json's size
    assert vlm.context_length == 4096  # from text_config
    assert vlm.kv.full_layers == 1 and vlm.kv.sliding[0].window == 512
    assert not inspect_model(tiny_model_path, "tiny").is_vision


def test_weight_bytes_include_the_vision_tower(tiny_vlm_path: Path) -> None:
    vlm = inspect_model(tiny_vlm_path, "tiny-vlm")
    tower = 0
    total = 0
    with safe_open(str(tiny_vlm_path / "model.safetensors"), framework="numpy") as f:
        for name in f.keys():
            n = f.get_tensor(name).nbytes
            total += n
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                tower += n
    assert tower > 0
    assert vlm.vision.vision_weight_bytes == tower
    assert vlm.weight_bytes >= total  # the file (header included) holds the tower too
    verdict = fit(figures(16 * GiB, env={}), MemorySnapshot(16 * GiB, 14 * GiB),
                  vlm.weight_bytes)
    assert verdict.weights_bytes == padded_weight_bytes(vlm.weight_bytes) > padded_weight_bytes(vlm.weight_bytes - tower)


def test_vision_config_without_a_processor_config_is_a_text_model(tiny_vlm_path: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-processor"
    shutil.copytree(tiny_vlm_path, folder)
    (folder / "processor_config.json").unlink()
    (folder / "preprocessor_config.json").unlink()
    assert not inspect_model(folder, "x").is_vision


@pytest.mark.parametrize(("config", "processors", "expected"), [
    ({}, [{"image_seq_length": 256}], 256),  # Gemma / PaliGemma processor config
    ({"text_config": {"mm_tokens_per_image": 256}}, [{}], 256),  # Gemma 3 config.json
    ({"mm_tokens_per_image": 64}, [{"image_processor": {"image_seq_length": 32}}], 32),
    # Qwen2-VL: max_pixels 12845056 with 14-pixel patches merged 2×2 -> 16384 tokens at most.
    ({}, [{"max_pixels": 12845056, "patch_size": 14, "merge_size": 2}], 16384),
    ({}, [{"size": {"longest_edge": 1024}, "patch_size": 16, "merge_size": 2}], 1024),
    ({}, [{"size": {"height": 384, "width": 384}}], None),  # nothing stated: the policy default applies
    ({}, [], None),
])
def test_soft_tokens_where_the_model_states_them(config, processors, expected) -> None:
    assert soft_tokens_per_image(config, processors) == expected


@pytest.mark.parametrize(("config", "processors", "expected"), [
    ({}, [{"size": {"height": 896, "width": 896}}], 896 * 896),  # Gemma 3
    ({}, [{"max_pixels": 12845056}], 12845056),  # Qwen2-VL
    ({}, [{"size": {"longest_edge": 1540}}], 1540 * 1540),
    ({"vision_config": {"image_size": 384}}, [{}], 384 * 384),
    ({}, [{}], 1024 * 1024),  # stated nowhere: the policy default
])
def test_input_pixels(config, processors, expected) -> None:
    assert input_pixels(config, processors) == expected


def test_a_vision_folder_without_the_vision_extra_is_skipped(tiny_vlm_path, tiny_model_path, monkeypatch) -> None:
    import provider.models.discovery as discovery
    from provider.models import SkipReason, discover

    monkeypatch.setattr(discovery, "vision_runtime_available", lambda: False)
    inventory = discover(hf_cache=None, aliases={"vlm": tiny_vlm_path, "text": tiny_model_path})
    assert [m.id for m in inventory.models] == ["text"]  # never advertised: it could not load
    (skipped,) = inventory.skipped
    assert skipped.id == "vlm" and skipped.reason is SkipReason.NO_VISION_RUNTIME


def test_register_advertises_is_vision(tiny_vlm_path: Path, tiny_model_path: Path) -> None:
    from provider.models import discover
    from provider.session.register import advertised_models

    inventory = discover(hf_cache=None, aliases={"vlm": tiny_vlm_path, "text": tiny_model_path})
    cap = figures(16 * GiB, env={})
    snap = MemorySnapshot(16 * GiB, 14 * GiB)
    by_id = {m.id: m for m in advertised_models([(m, fit(cap, snap, m.weight_bytes)) for m in inventory.models])}
    assert by_id["vlm"].is_vision is True and by_id["text"].is_vision is False
    assert '"is_vision":true' in by_id["vlm"].model_dump_json(exclude_defaults=True)
    assert "is_vision" not in by_id["text"].model_dump_json(exclude_defaults=True)
