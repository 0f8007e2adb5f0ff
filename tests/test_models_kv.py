"""KV bytes from configs, checked against published architectures and against the caches mlx-lm
really allocates (tiny random-weight models of each layout, plus the tiny model on disk)."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from provider.models import (
    ALLOC_STEP,
    KvAccuracy,
    KvConfigError,
    inspect_model,
    kv_bytes_for_tokens,
    kv_layout,
)

KiB, MiB = 1024, 1024 * 1024

LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16",
}
# google/gemma-3-27b-it: the text part is nested, and sliding_window_pattern 6 means 5 local
# layers then 1 global.
GEMMA3_27B = {
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text", "hidden_size": 5376, "num_hidden_layers": 62,
        "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
        "sliding_window": 1024, "sliding_window_pattern": 6,
    },
}
# mistralai/Mistral-7B-v0.1 declares sliding_window 4096, but mlx-lm runs it as llama with a plain
# KVCache per layer.
MISTRAL_7B = {
    "model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096,
}


def test_llama3_8b_is_128_kib_per_token_in_bf16() -> None:
    layout = kv_layout(LLAMA3_8B, dtype_bytes=2)
    assert layout.bytes_per_token == 128 * KiB
    assert layout.accuracy is KvAccuracy.EXACT and layout.sliding == ()
    assert kv_bytes_for_tokens(layout, 4096) == 512 * MiB
    # allocation is in 256-token blocks
    assert kv_bytes_for_tokens(layout, 1) == 256 * 128 * KiB
    assert kv_bytes_for_tokens(layout, 257) == 512 * 128 * KiB
    assert kv_bytes_for_tokens(layout, 0) == 0


def test_gemma3_sliding_layers_are_bounded_by_the_window() -> None:
    layout = kv_layout(GEMMA3_27B, dtype_bytes=2)
    per_layer = 2 * 16 * 128 * 2  # 8 KiB
    assert layout.full_layers == 10  # layers 5, 11, ..., 59
    assert layout.bytes_per_token == 10 * per_layer
    (group,) = layout.sliding
    assert (group.window, group.layers, group.bytes_per_token) == (1024, 52, 52 * per_layer)
    # short: sliding layers hold at most tokens + 255
    assert kv_bytes_for_tokens(layout, 100) == 256 * 10 * per_layer + 355 * 52 * per_layer
    # long: full layers keep growing, sliding layers stop at the window
    long = kv_bytes_for_tokens(layout, 32_768)
    assert long == 32_768 * 10 * per_layer + 1024 * 52 * per_layer
    # a 2048-token prefill chunk appended past the window holds window - 1 + 2048 for a moment
    peak = kv_bytes_for_tokens(layout, 32_768, prefill_step=2048)
    assert peak == long + (2047 * 52 * per_layer)


def test_gemma3_defaults_fill_fields_published_configs_leave_out() -> None:
    sparse = {"model_type": "gemma3", "text_config": {"hidden_size": 2560, "num_hidden_layers": 34}}
    layout = kv_layout(sparse, dtype_bytes=2)
    # mlx-lm's gemma3 wrapper defaults: 4 kv heads, head_dim 256, window 512, pattern 6
    assert layout.full_layers == 5
    assert layout.bytes_per_token == 5 * 2 * 4 * 256 * 2
    assert layout.sliding[0].window == 512 and layout.sliding[0].layers == 29


def test_mistral_sliding_window_without_layer_types_counts_as_full() -> None:
    layout = kv_layout(MISTRAL_7B, dtype_bytes=2)
    assert layout.bytes_per_token == 128 * KiB and layout.sliding == ()


def test_layer_types_and_kv_shared_layers() -> None:
    config = {
        "model_type": "gemma4_text", "hidden_size": 256, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "global_head_dim": 64,
        "num_kv_shared_layers": 2, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 3,
    }
    layout = kv_layout(config, dtype_bytes=2)
    # layers 4 and 5 share earlier caches; of 0..3, layers 1 and 3 are full with the global head dim
    assert layout.full_layers == 2
    assert layout.bytes_per_token == 2 * (2 * 2 * 64 * 2)
    assert layout.sliding[0].layers == 2 and layout.sliding[0].bytes_per_token == 2 * (2 * 2 * 32 * 2)


def test_hybrid_linear_attention_counts_only_attention_layers_and_says_so() -> None:
    config = {
        "model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "full_attention_interval": 4,
    }
    layout = kv_layout(config, dtype_bytes=2)
    assert layout.full_layers == 12 and layout.recurrent_layers == 36
    assert layout.bytes_per_token == 12 * 2 * 2 * 256 * 2
    assert layout.accuracy is KvAccuracy.APPROXIMATE and "recurrent" in layout.note


def test_unmodelled_hybrid_is_an_upper_bound() -> None:
    config = {"model_type": "jamba", "hidden_size": 512, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 2}
    layout = kv_layout(config, dtype_bytes=2)
    assert layout.accuracy is KvAccuracy.APPROXIMATE
    assert layout.bytes_per_token == 8 * 2 * 2 * 64 * 2


def test_deepseek_v3_caches_the_mla_latent() -> None:
    config = {
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    }
    layout = kv_layout(config, dtype_bytes=2)
    assert layout.bytes_per_token == 61 * (512 + 64) * 2
    assert layout.accuracy is KvAccuracy.EXACT


@pytest.mark.parametrize("config", [
    {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4},  # no layer count
    {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": "2", "num_attention_heads": 4},
    {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
     "layer_types": ["sliding_attention", "full_attention"]},  # sliding without a window
])
def test_malformed_configs_raise_kv_config_error(config: dict) -> None:
    with pytest.raises(KvConfigError):
        kv_layout(config, dtype_bytes=2)


# --- measured against mlx-lm's own caches ------------------------------------------------------

def _tiny_llama(**extra) -> dict:
    return {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 128, "tie_word_embeddings": True, **extra}


def _build(config: dict, dtype: mx.Dtype):
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _feed(model, cache, n: int) -> None:
    tokens = mx.array([[i % 100 + 3 for i in range(n)]])
    mx.eval(model(tokens, cache=cache))


def _cache_bytes(cache, kind) -> int:
    return sum(c.nbytes for c in cache if type(c) is kind)


ARCHS = {
    "llama-gqa": _tiny_llama(),
    "llama-sliding": _tiny_llama(
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=300),
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 4,
                    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 16, "vocab_size": 128, "sliding_window": 300,
                    "sliding_window_pattern": 2},
    "deepseek_v3-mla": {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2,
                        "intermediate_size": 128, "moe_intermediate_size": 32,
                        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
                        "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                        "v_head_dim": 16, "vocab_size": 128, "first_k_dense_replace": 2},
}


@pytest.mark.parametrize("name", sorted(ARCHS))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_layout_matches_the_caches_mlx_lm_allocates(name: str, dtype: mx.Dtype) -> None:
    config = ARCHS[name]
    model = _build(config, dtype)
    layout = kv_layout(config, dtype_bytes=dtype.size)
    cache = make_prompt_cache(model)
    assert sum(type(c) is KVCache for c in cache) == layout.full_layers
    assert sum(type(c) is RotatingKVCache for c in cache) == sum(g.layers for g in layout.sliding)

    # A prefill chunk, then one-token decode steps across block boundaries and past the window.
    tokens = 0
    for step in [200] + [1] * 120:  # to 320 tokens, past the 256 block and the 300 window
        _feed(model, cache, step)
        tokens += step
        if step == 1 and tokens % 17 and tokens not in (256, 257, 300, 301):
            continue  # check a spread of points, not all of them
        full = _cache_bytes(cache, KVCache)
        assert full == ALLOC_STEP * -(-tokens // ALLOC_STEP) * layout.bytes_per_token
        sliding = _cache_bytes(cache, RotatingKVCache)
        bound = kv_bytes_for_tokens(layout, tokens) - (full if tokens else 0)
        assert sliding <= bound
        if layout.sliding and tokens >= layout.sliding[0].window:
            assert sliding == bound  # settled at exactly window tokens per layer


def test_kv_formula_matches_measured_growth_of_the_tiny_model(tiny_model_path) -> None:
    import mlx_lm

    info = inspect_model(tiny_model_path, "tiny")
    assert info.kv.accuracy is KvAccuracy.EXACT, info
    model, _ = mlx_lm.load(str(tiny_model_path))
    mx.eval(model.parameters())
    gc.collect()
    before = mx.get_active_memory()
    cache = make_prompt_cache(model)
    tokens = 0
    # generate_step's pattern: 256-aligned prefill chunks, a last partial chunk, then single
    # tokens; crossing the 256 and 512 boundaries.
    for chunk in (256, 44, 1, 200, *[1] * 12):
        _feed(model, cache, chunk)
        tokens += chunk
        expected = kv_bytes_for_tokens(info.kv, tokens)
        assert sum(c.nbytes for c in cache) == expected, tokens
        gc.collect()
        grown = mx.get_active_memory() - before
        # active memory holds the cache plus at most a few small leftover activations
        assert expected <= grown <= expected + 64 * KiB, (tokens, grown, expected)
    assert tokens == 513 and sum(c.nbytes for c in cache) == 768 * info.kv_bytes_per_token

    # An unaligned append (as after reusing a trimmed prompt cache) overshoots the block
    # rounding but stays within the aligned=False bound.
    _feed(model, cache, 300)
    tokens += 300
    measured = sum(c.nbytes for c in cache)
    assert measured == (513 + 512) * info.kv_bytes_per_token  # offset + ceil(300 / 256) * 256
    assert kv_bytes_for_tokens(info.kv, tokens) < measured <= kv_bytes_for_tokens(
        info.kv, tokens, aligned=False)


def test_quantized_layouts_count_what_the_quantized_cache_holds():
    """Over bfloat16, 64 elements of a row in groups of 32: at 8 bits 64 bytes of packed values and a
    2-byte scale and bias per group (72 bytes), at 4 bits 32 + 8, where 128 bytes were. q8 keeps keys and
    values at 8 bits, q4 keys at 8 and values at 4. And the reasons a cache cannot be quantized."""
    from provider.models.kv import KvAccuracy, KvLayout, at_dtype, kv_quantization_bits, quantization_refusal, quantized

    plain = KvLayout(dtype_bytes=2, full_layers=32, bytes_per_token=32 * 2 * 8 * 128 * 2, sliding=(),
                     recurrent_layers=0, accuracy=KvAccuracy.EXACT, head_dim=128)
    assert quantization_refusal(plain) is None
    q8, q4 = quantized(plain, kv_quantization_bits("q8")), quantized(plain, kv_quantization_bits("q4"))
    assert q8.bytes_per_token * 128 == plain.bytes_per_token * 72 and q8.kv_bits == kv_quantization_bits("q8")
    assert q4.bytes_per_token * 128 == plain.bytes_per_token * (72 + 40) / 2 and q4.kv_bits == kv_quantization_bits("q4")
    assert round(plain.bytes_per_token / q8.bytes_per_token, 2) == 1.78
    assert round(plain.bytes_per_token / q4.bytes_per_token, 2) == 2.29
    assert at_dtype(q4) == plain
    import dataclasses
    assert "head size (80)" in quantization_refusal(dataclasses.replace(plain, head_dim=80))
    assert quantization_refusal(dataclasses.replace(plain, head_dim=96)) is None  # a multiple of 32
    assert "recurrent" in quantization_refusal(dataclasses.replace(plain, recurrent_layers=2))
    assert "plain" in quantization_refusal(dataclasses.replace(plain, accuracy=KvAccuracy.APPROXIMATE))


def test_discovery_keeps_each_models_kv_as_its_setting_asks(tiny_model_path, tmp_path):
    from provider.config import load_settings
    from provider.models.discovery import discover_models
    from provider.models.kv import kv_quantization_bits

    toml = tmp_path / "p.toml"
    toml.write_text('kv_quantization = "q4"\nhf_cache_dir = "' + str(tmp_path / "hub") + '"\n'
                    '[model_aliases]\n"a" = "' + str(tiny_model_path) + '"\n"b" = "' + str(tiny_model_path) + '"\n'
                    '[kv_quantization_models]\n"b" = "none"\n')
    (tmp_path / "hub").mkdir()
    models = {m.id: m for m in discover_models(load_settings(config_path=toml, env={"HOME": str(tmp_path)})).models}
    assert models["a"].kv_bits == kv_quantization_bits("q4") and models["b"].kv_bits is None
    # float32: keys (8 bits) and values (4 bits) 0.75 bytes an element, a scale and a bias 8 bytes a group of 32
    assert models["a"].kv_bytes_per_token * 4 == models["b"].kv_bytes_per_token * (12 / 16 + 8 / 32)
