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


# -- the real shapes (measuring on a GPU) and --no-eos ---------------------------------------

def test_real_shape_presets_are_bf16_llama_at_1b_and_8b_without_building_them():
    from provider.tinymodel import model_config, parameter_count

    one, eight = PRESETS["1b"], PRESETS["8b"]
    assert (one.hidden_size, one.num_hidden_layers, one.intermediate_size,
            one.num_attention_heads, one.num_key_value_heads) == (2048, 16, 8192, 32, 8)
    assert (eight.hidden_size, eight.num_hidden_layers, eight.intermediate_size,
            eight.num_attention_heads, eight.num_key_value_heads) == (4096, 32, 14336, 32, 8)
    for shape in (one, eight):
        assert (shape.vocab_size, shape.max_position_embeddings, shape.dtype) == (32000, 8192, "bfloat16")
    config = model_config("8b")
    assert (config["head_dim"], config["max_position_embeddings"], config["eos_token_id"]) == (128, 8192, [2, 0])
    # bf16 bytes from the shape: ~2.1 GB and ~14.2 GB (tied embeddings).
    assert 2.0e9 < 2 * parameter_count(one) < 2.2e9
    assert 14.0e9 < 2 * parameter_count(eight) < 14.5e9
    # The small presets keep float32 (their marker, hence their cached folders, are unchanged).
    assert {PRESETS[p].dtype for p in ("tiny", "small", "medium")} == {"float32"}


def test_8b_weights_are_planned_lazily_in_bf16_without_computing_them():
    # The same code path as every build, stopped before anything is evaluated: shapes and dtypes
    # of all 8B tensors, in shards of at most 5 GiB, with no memory spent on them.
    import mlx.core as mx

    from provider.tinymodel import lazy_weights, model_config, parameter_count

    before = mx.get_active_memory()
    weights = lazy_weights(model_config("8b"), "bfloat16", seed=0, no_eos=True)
    assert {v.dtype for v in weights.values()} == {mx.bfloat16}
    assert sum(v.size for v in weights.values()) == parameter_count(PRESETS["8b"])
    assert weights["model.embed_tokens.weight"].shape == (32000, 4096)
    assert weights["model.layers.31.mlp.down_proj.weight"].shape == (4096, 14336)
    assert mx.get_active_memory() - before < 1e6


@pytest.fixture(scope="module")
def no_eos_model_path(tiny_models_dir):
    return build_tiny_model(tiny_models_dir / "tiny-f32-noeos", preset="tiny", no_eos=True)


def test_no_eos_zeroes_only_the_eos_rows_and_keeps_the_declared_eos(no_eos_model_path, tiny_model_path):
    import mlx.core as mx

    plain = mx.load(str(tiny_model_path / "model.safetensors"))
    no_eos = mx.load(str(no_eos_model_path / "model.safetensors"))
    assert plain.keys() == no_eos.keys()
    for name in plain:
        if name != "model.embed_tokens.weight":
            assert mx.array_equal(plain[name], no_eos[name]).item(), name
    embed, ref = no_eos["model.embed_tokens.weight"], plain["model.embed_tokens.weight"]
    assert mx.all(embed[mx.array([0, 2])] == 0).item()  # eos ids: their tied logits are exactly 0
    assert mx.array_equal(embed[3:], ref[3:]).item() and mx.array_equal(embed[1], ref[1]).item()
    assert json.loads((no_eos_model_path / "config.json").read_text())["eos_token_id"] == [2, 0]
    marker = json.loads((no_eos_model_path / MARKER_FILE).read_text())
    assert marker["no_eos"] is True
    # A default build's marker is the one folders were built with before the option existed.
    assert "no_eos" not in json.loads((tiny_model_path / MARKER_FILE).read_text())


def test_no_eos_greedy_runs_to_max_tokens_in_mlx_lm_and_in_the_engine(no_eos_model_path):
    import asyncio

    from mlx_lm.generate import stream_generate

    from provider.engine import ChatRequest, Engine, Finished, FinishReason, SamplingParams

    model, tok = mlx_lm.load(str(no_eos_model_path))
    assert tok.eos_token_ids == {0, 2}  # still declared: unreachable, not undeclared
    prompts = [[{"role": "user", "content": f"Tell me about {w} number {i}."}]
               for i, w in enumerate(["the river", "memory", "seven apples"])]
    for messages in prompts:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        out = list(stream_generate(model, tok, ids, max_tokens=96))
        assert len(out) == 96 and out[-1].finish_reason == "length"
        assert not {r.token for r in out} & tok.eos_token_ids

    async def engine_run() -> list[Finished]:
        async with Engine() as engine:
            await engine.load("m", no_eos_model_path)  # the tokenizer's own EOS set
            params = SamplingParams(max_tokens=96, temperature=0.0)
            streams = [engine.submit("m", ChatRequest(f"r{i}", m, params)) for i, m in enumerate(prompts)]
            return [(await s.collect())[1] for s in streams]

    for final in asyncio.run(engine_run()):
        assert isinstance(final, Finished) and final.reason is FinishReason.LENGTH
        assert final.usage.completion_tokens == 96


def test_the_tools_variant_is_a_json_tools_family_for_mlx_lm_and_keeps_the_chatml_ids(tiny_tools_model_path,
                                                                                       tiny_model_path):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tiny_tools_model_path)
    assert tok.has_tool_calling and tok.tool_parser.__module__ == "mlx_lm.tool_parsers.json_tools"
    assert (tok.tool_call_start_tokens, tok.tool_call_end_tokens) == ((3,), (4,))
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert not load_tokenizer(tiny_model_path).has_tool_calling  # the plain tiny model is unchanged
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                                    "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "7"}],
                                   tools=tools, add_generation_prompt=True, tokenize=False)
    system = text.split("<|im_end|>")[0]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in system  # the definitions
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n7\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    assert json.loads((tiny_tools_model_path / MARKER_FILE).read_text())["tools"] is True
    assert "tools" not in json.loads((tiny_model_path / MARKER_FILE).read_text())
