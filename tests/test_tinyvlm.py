"""provider.tinyvlm: a real mlx-vlm architecture, built offline, loadable by mlx-vlm unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from PIL import Image

from provider.tinyvlm import BOI, EOI, IMAGE_TOKEN, IMAGE_TOKEN_ID, build_tiny_vlm


def test_folder_layout(tiny_vlm_path: Path) -> None:
    config = json.loads((tiny_vlm_path / "config.json").read_text())
    assert config["model_type"] == "gemma3"
    assert config["vision_config"]["model_type"] == "siglip_vision_model"
    assert json.loads((tiny_vlm_path / "processor_config.json").read_text())["image_seq_length"] == 16
    assert (tiny_vlm_path / "preprocessor_config.json").is_file()
    assert (tiny_vlm_path / "model.safetensors").is_file()


def test_rebuild_is_deterministic_and_reused(tiny_vlm_path: Path, tmp_path: Path) -> None:
    copy = build_tiny_vlm(tmp_path / "vlm")
    assert (copy / "model.safetensors").read_bytes() == (tiny_vlm_path / "model.safetensors").read_bytes()
    mtime = (copy / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_vlm(tmp_path / "vlm") == copy
    assert (copy / "model.safetensors").stat().st_mtime_ns == mtime  # the marker matched: not rebuilt


def test_mlx_vlm_loads_it_and_the_image_matters(tiny_vlm_path: Path) -> None:
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    model, processor = load(str(tiny_vlm_path))
    tokenizer = processor.tokenizer
    assert tokenizer.image_token == IMAGE_TOKEN and tokenizer.image_token_id == IMAGE_TOKEN_ID
    assert (tokenizer.boi_token, tokenizer.eoi_token) == (BOI, EOI)
    prompt = apply_chat_template(processor, model.config, "what is this?", num_images=1)
    red, blue = Image.new("RGB", (40, 30), (220, 20, 20)), Image.new("RGB", (40, 30), (20, 20, 220))
    inputs = prepare_inputs(processor, images=[red], prompts=prompt, image_token_index=IMAGE_TOKEN_ID)
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(IMAGE_TOKEN_ID) == 16  # the processor expands one image into its soft tokens
    assert inputs["pixel_values"].shape == (1, 3, 64, 64)
    out_red = generate(model, processor, prompt, image=[red], max_tokens=12, temperature=0.0)
    out_blue = generate(model, processor, prompt, image=[blue], max_tokens=12, temperature=0.0)
    assert out_red.generation_tokens == 12
    assert out_red.prompt_tokens == len(ids)
    assert out_red.text != out_blue.text  # the vision tower feeds the language model
    mx.clear_cache()
