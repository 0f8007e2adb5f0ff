"""The tiny-model builder: real layout, loadable by mlx_lm unchanged, deterministic, reused."""

from __future__ import annotations

import json

import mlx_lm
import pytest

from provider.tinymodel import (
    BUILDER_VERSION,
    MARKER_FILE,
    PRESETS,
    build_tiny_model,
    weights_bytes,
)

MESSAGES = [{"role": "user", "content": "Hello, wörld! 日本語 🚀"}]


def test_tiny_model_has_the_normal_layout(tiny_model_path):
    names = {p.name for p in tiny_model_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((tiny_model_path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["eos_token_id"] == [2, 0]
    tok_config = json.loads((tiny_model_path / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_sizes_are_about_5_and_50_megabytes(tiny_model_path, small_model_path):
    assert 4e6 < weights_bytes(tiny_model_path) < 7e6
    assert 45e6 < weights_bytes(small_model_path) < 56e6


def test_medium_preset_is_about_400_megabytes_without_building_it():
    # Parameter count from the shape: tied embedding + per-layer attention, MLP and norms.
    s = PRESETS["medium"]
    head_dim = s.hidden_size // s.num_attention_heads
    attn = 2 * s.hidden_size * s.hidden_size + 2 * s.hidden_size * s.num_key_value_heads * head_dim
    per_layer = attn + 3 * s.hidden_size * s.intermediate_size + 2 * s.hidden_size
    params = s.vocab_size * s.hidden_size + s.num_hidden_layers * per_layer + s.hidden_size
    assert 370e6 < 4 * params < 430e6


def test_loads_with_mlx_lm_and_generates_through_the_chat_template(tiny_model_path):
    model, tok = mlx_lm.load(str(tiny_model_path))
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nHello, wörld! 日本語 🚀<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token_ids == {0, 2}
    assert len(tok) == PRESETS["tiny"].vocab_size
    out = mlx_lm.generate(model, tok, ids, max_tokens=8)
    assert isinstance(out, str) and out


def test_quantized_variant_loads_and_generates(quantized_model_path, tiny_model_path):
    config = json.loads((quantized_model_path / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert weights_bytes(quantized_model_path) < weights_bytes(tiny_model_path) / 4
    model, tok = mlx_lm.load(str(quantized_model_path))
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert mlx_lm.generate(model, tok, ids, max_tokens=4)


def test_build_is_deterministic_and_reused(tmp_path, tiny_model_path):
    a = build_tiny_model(tmp_path / "a", preset="tiny")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (tiny_model_path / name).read_bytes(), name
    marker = json.loads((a / MARKER_FILE).read_text())
    assert marker["builder_version"] == BUILDER_VERSION

    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "a", preset="tiny") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt

    # A different seed is a different model, and replaces the folder.
    build_tiny_model(tmp_path / "a", preset="tiny", seed=1)
    assert (a / "model.safetensors").read_bytes() != (tiny_model_path / "model.safetensors").read_bytes()
    assert json.loads((a / MARKER_FILE).read_text())["seed"] == 1


def test_unknown_preset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        build_tiny_model(tmp_path / "x", preset="huge")
