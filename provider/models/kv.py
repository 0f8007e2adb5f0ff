"""KV-cache size of a model, computed from its config the way mlx-lm 0.32 allocates it.

mlx-lm builds one cache object per layer (`Model.make_cache()`, `mlx_lm/models/cache.py`):

* `KVCache` (full attention) holds K and V of shape `(B, kv_heads, n, head_dim)` and grows in
  steps of `ALLOC_STEP` = 256 tokens, so `n = ceil(tokens / 256) * 256` when tokens arrive in
  256-aligned chunks (see `kv_bytes_for_tokens` for the unaligned case). Measured exactly
  (tests/test_models_kv.py).
* `RotatingKVCache(max_size=window)` (sliding-window attention) stops growing at `window` tokens
  once decoding. Before that it holds at most `tokens + 255`: a prefill chunk is stored unpadded,
  and the next one-token step pads by up to 256. During a chunked prefill past the window it holds
  `window - 1 + chunk` for a moment, which `kv_bytes_for_tokens(prefill_step=...)` can include.
* Recurrent layers (`ArraysCache`: Mamba, gated delta nets, ...) keep a constant-size state that
  this module does not compute; layouts that have them are marked `KvAccuracy.APPROXIMATE`.
* KV-shared layers (gemma3n, gemma4: `num_kv_shared_layers`) have no cache of their own.

How layers are classified, first rule that applies:
1. `layer_types` (llama, ministral3, gpt_oss, olmo3, gemma3n, gemma4): "full_attention" is full,
   "sliding_attention" is a rotating window, "chunked_attention" is counted as full (an upper
   bound: mlx-lm's ChunkedKVCache keeps only the current chunk), anything else is recurrent.
2. `full_attention_interval` (qwen3_next, qwen3_5): layer i is full when (i+1) % interval == 0,
   recurrent otherwise.
3. `sliding_window_pattern`: an int p (gemma3, cohere2) makes layer i full when i % p == p-1 and
   sliding otherwise; a string such as "LLLG" (exaone4) makes "L" layers sliding.
4. Otherwise every layer is full attention. That includes Mistral-style configs that carry a
   `sliding_window` but no `layer_types`: mlx-lm maps them to llama, which allocates a plain
   KVCache for every layer, so counting them as full is what actually happens.

Multi-head latent attention (`kv_lora_rank`, DeepSeek-V3 and relatives) caches one latent vector
and one rope key per token and layer instead of per-head K and V.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcache.bits import GROUP_SIZE, KvBits

ALLOC_STEP = 256  # KVCache.step and RotatingKVCache.step in mlx_lm.models.cache
# The setting -> the form its KV is kept in (None: the model's dtype), groups of 32. q4 keeps the values
# at 4 bits and the keys at 8: a trained model's keys have outlier channels that 4 bits a group cannot
# hold (kvcache/bits.py). Teacher-forced top-1 agreement with none on the trained demo model
# (benchmarks/kv_quant_bench.py, 2,112 positions): q8 0.998 (0.989 in groups of 64), q4 0.980, values
# and keys at 4 bits 0.930; tests/test_kv_quantization_agreement.py holds q8 >= 0.99, q4 >= 0.95.
KV_QUANTIZATION_BITS: dict[str, KvBits | None] = {"none": None, "q8": KvBits(8, 8), "q4": KvBits(8, 4)}

# Families whose mlx-lm implementation keeps recurrent state in some layers but whose configs do not
# follow the rules above. We count every layer as full attention (an upper bound on the per-token
# cost) and say so.
_UNMODELLED_HYBRIDS = frozenset({
    "baichuan_m1", "bailing_hybrid", "bailing_moe_linear", "falcon_h1", "granitemoehybrid", "jamba",
    "kimi_linear", "lfm2", "lfm2_moe", "lfm2-vl", "mamba", "mamba2", "falcon_mamba", "nemotron_h",
    "olmo_hybrid", "plamo2", "recurrent_gemma", "rwkv7",
})

# MLA families whose mlx-lm code caches the compressed latent (kv_lora_rank + rope dims, one "head").
_LATENT_MLA = frozenset({
    "deepseek_v3", "deepseek_v32", "kimi_k2", "joyai_llm_flash", "glm4_moe_lite", "kimi_k3",
    "longcat_flash", "longcat_flash_ngram", "mistral4", "bailing_moe_v3", "kimi_linear",
})
# MLA families whose mlx-lm code caches the expanded per-head keys and values.
_EXPANDED_MLA = frozenset({"deepseek_v2", "minicpm3", "youtu_llm"})

# Defaults mlx-lm applies when a gemma config leaves a field out (the ModelArgs dataclasses of
# gemma3.py, gemma3_text.py, gemma4.py, gemma4_text.py); published configs rely on them.
_GEMMA4_DEFAULTS: Mapping[str, Any] = {
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
    "num_kv_shared_layers": 20, "sliding_window": 512, "sliding_window_pattern": 5,
}
_FAMILY_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "gemma3": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "sliding_window": 512, "sliding_window_pattern": 6},
    "gemma3_text": {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                    "sliding_window": 512, "sliding_window_pattern": 6},
    "gemma4": _GEMMA4_DEFAULTS,
    "gemma4_text": _GEMMA4_DEFAULTS,
}


class KvConfigError(ValueError):
    """The config lacks a field the KV layout needs, or has one of the wrong type."""


class LayerKind(enum.Enum):
    FULL = "full"
    SLIDING = "sliding"
    RECURRENT = "recurrent"
    SHARED = "shared"  # reuses another layer's cache


class KvAccuracy(enum.Enum):
    EXACT = "exact"  # derived as mlx-lm's make_cache builds the caches
    APPROXIMATE = "approximate"  # an upper bound on attention bytes; see KvLayout.note


@dataclass(frozen=True, slots=True)
class SlidingGroup:
    """Rotating-window layers that share one window size."""

    window: int
    layers: int
    bytes_per_token: int  # summed over the group's layers


@dataclass(frozen=True, slots=True)
class KvLayout:
    dtype_bytes: int
    full_layers: int
    bytes_per_token: int  # all full-attention layers together; this part grows without bound
    sliding: tuple[SlidingGroup, ...]
    recurrent_layers: int  # constant-size state, not counted in any byte figure here
    accuracy: KvAccuracy
    note: str = ""
    head_dim: int = 0  # a full layer's key and value size per head (0: not plain attention heads)
    kv_bits: KvBits | None = None  # the form the KV is kept quantized in (`quantized`); None: the dtype
    dtype_bytes_per_token: int = 0  # quantized: `bytes_per_token` at the model's dtype (`at_dtype`)

    @property
    def max_bytes_per_token(self) -> int:
        """Growth rate while every window is still filling."""
        return self.bytes_per_token + sum(g.bytes_per_token for g in self.sliding)


def round_up_to_step(tokens: int) -> int:
    return math.ceil(tokens / ALLOC_STEP) * ALLOC_STEP


def kv_bytes_for_tokens(
    layout: KvLayout, tokens: int, *, prefill_step: int | None = None, aligned: bool = True
) -> int:
    """Bytes mlx-lm allocates for one sequence's KV cache holding `tokens` tokens.

    Full-attention layers: `ceil(tokens / 256) * 256` slots, exact when every chunk appended to
    the cache but the last was a multiple of 256 tokens, which is what generate_step and
    BatchGenerator do for a fresh sequence (prefill chunks of 2048, then single tokens). A chunk
    appended at an unaligned offset (reusing a trimmed prompt cache) grows the buffer to
    `offset + ceil(chunk / 256) * 256`; pass `aligned=False` for that bound, `tokens + 255`.
    A trimmed cache keeps its buffer: this counts a cache grown to `tokens`, not trimmed back.

    Sliding layers: an upper bound, `min(tokens + 255, window)` per layer, or
    `min(tokens + 255, window - 1 + prefill_step)` to cover the moment a chunked prefill of
    `prefill_step` tokens is appended past the window.
    Recurrent state is not included (see `KvLayout.recurrent_layers`).
    """
    if tokens < 0:
        raise ValueError("tokens must be >= 0")
    if tokens == 0:
        return 0
    full_slots = round_up_to_step(tokens) if aligned else tokens + ALLOC_STEP - 1
    total = full_slots * layout.bytes_per_token
    for group in layout.sliding:
        cap = group.window if prefill_step is None else group.window - 1 + prefill_step
        total += min(tokens + ALLOC_STEP - 1, cap) * group.bytes_per_token
    return total


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language-model part of a config: multimodal configs nest it under `text_config`."""
    merged = dict(config)
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        merged.update(nested)
        merged["model_type"] = config.get("model_type", nested.get("model_type"))
    for family in (config.get("model_type"), merged.get("model_type"),
                   nested.get("model_type") if isinstance(nested, Mapping) else None):
        for key, value in _FAMILY_DEFAULTS.get(family or "", {}).items():
            merged.setdefault(key, value)
    return merged



def kv_layout(config: Mapping[str, Any], dtype_bytes: int) -> KvLayout:
    """The per-layer KV layout of a model config (top-level config.json, nesting handled here)."""
    cfg = text_config(config)
    model_type = str(config.get("model_type", ""))
    types = {model_type, str(cfg.get("model_type", ""))}
    n_layers = _int(cfg, "num_hidden_layers")
    kinds = _layer_kinds(cfg, n_layers)
    notes: list[str] = []
    accuracy = KvAccuracy.EXACT

    if types & _UNMODELLED_HYBRIDS:
        accuracy = KvAccuracy.APPROXIMATE
        notes.append("hybrid architecture not modelled: every layer counted as full attention, "
                     "recurrent state not counted")
        kinds = [LayerKind.FULL] * n_layers
    if LayerKind.RECURRENT in kinds:
        accuracy = KvAccuracy.APPROXIMATE
        notes.append("recurrent-state layers not counted")
    if "chunked_attention" in (cfg.get("layer_types") or ()):
        accuracy = KvAccuracy.APPROXIMATE
        notes.append("chunked-attention layers counted as full attention")

    full_bytes, sliding_bytes, mla_note = _per_layer_token_bytes(cfg, types, dtype_bytes)
    if mla_note:
        accuracy = KvAccuracy.APPROXIMATE
        notes.append(mla_note)
    if full_bytes == 0 and LayerKind.FULL in kinds:
        accuracy = KvAccuracy.APPROXIMATE
        notes.append("no attention heads in config")

    n_full = kinds.count(LayerKind.FULL)
    n_sliding = kinds.count(LayerKind.SLIDING)
    sliding: tuple[SlidingGroup, ...] = ()
    if n_sliding:
        window = cfg.get("sliding_window")
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise KvConfigError("sliding layers without a positive integer sliding_window")
        sliding = (SlidingGroup(window=window, layers=n_sliding,
                                bytes_per_token=n_sliding * sliding_bytes),)
    return KvLayout(
        dtype_bytes=dtype_bytes,
        full_layers=n_full,
        bytes_per_token=n_full * full_bytes,
        sliding=sliding,
        recurrent_layers=kinds.count(LayerKind.RECURRENT),
        accuracy=accuracy,
        note="; ".join(notes),
        head_dim=_head_dim(cfg),
    )


def _head_dim(cfg: Mapping[str, Any]) -> int:
    """A full layer's head size when the model has plain attention heads, else 0."""
    if cfg.get("kv_lora_rank") or not cfg.get("num_attention_heads"):
        return 0
    head_dim = cfg.get("global_head_dim") or cfg.get("head_dim") or _int(cfg, "hidden_size") // _int(
        cfg, "num_attention_heads")
    return head_dim if isinstance(head_dim, int) else 0


def quantization_refusal(layout: KvLayout, group_size: int = GROUP_SIZE) -> str | None:
    """Why the model's KV cannot be kept quantized in the batch (`kvcache.quantized`), or None."""
    if layout.sliding or layout.recurrent_layers:
        return "its cache has sliding-window or recurrent layers, kept as the model's dtype"
    if layout.accuracy is not KvAccuracy.EXACT or not layout.head_dim:
        return "its cache is not plain per-head keys and values"
    if layout.head_dim % group_size:
        return f"its head size ({layout.head_dim}) is not a multiple of the quantization group ({group_size})"
    return None


def kv_quantization_bits(setting: str) -> KvBits | None:
    """The form a `kv_quantization` setting keeps KV in (None: the model's dtype)."""
    if setting not in KV_QUANTIZATION_BITS:
        raise ValueError(f"kv_quantization must be one of {', '.join(KV_QUANTIZATION_BITS)}")
    return KV_QUANTIZATION_BITS[setting]


def kv_quantization_setting(kv_bits: KvBits | None) -> str:
    """The `kv_quantization` setting that keeps KV in this form (the form itself when no setting does)."""
    return next((s for s, b in KV_QUANTIZATION_BITS.items() if b == kv_bits), str(kv_bits))


def quantized_bytes_per_element(kv_bits: KvBits, dtype_bytes: int) -> float:
    """Bytes one KV element takes quantized, keys and values taken together: its bits, plus a scale and
    a bias (the dtype's size) per group."""
    return (kv_bits.keys + kv_bits.values) / 16 + 2 * dtype_bytes / kv_bits.group_size


def quantized(layout: KvLayout, kv_bits: KvBits) -> KvLayout:
    """`layout` with its KV kept quantized: each group of `group_size` elements of a key (value) as
    `keys`-bit (`values`-bit) integers plus a scale and a bias of the model's dtype (`mx.quantize`'s
    layout: `quantization_refusal` first). Keys and values are the same size in a layout it takes."""
    per_element = quantized_bytes_per_element(kv_bits, layout.dtype_bytes)
    per_token = math.ceil(layout.bytes_per_token * per_element / layout.dtype_bytes)
    note = "; ".join(filter(None, (layout.note, f"KV kept quantized ({kv_bits})")))
    return dataclasses.replace(layout, bytes_per_token=per_token, kv_bits=kv_bits, note=note,
                               dtype_bytes_per_token=layout.bytes_per_token)


def at_dtype(layout: KvLayout) -> KvLayout:
    """`layout` with its KV at the model's dtype (undoes `quantized`)."""
    if layout.kv_bits is None:
        return layout
    return dataclasses.replace(layout, bytes_per_token=layout.dtype_bytes_per_token, kv_bits=None,
                               dtype_bytes_per_token=0, note=layout.note.removesuffix(
                                   f"KV kept quantized ({layout.kv_bits})").rstrip("; "))


def _layer_kinds(cfg: Mapping[str, Any], n_layers: int) -> list[LayerKind]:
    layer_types = cfg.get("layer_types")
    interval = cfg.get("full_attention_interval")
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(layer_types, list) and layer_types:
        if len(layer_types) < n_layers:
            raise KvConfigError("layer_types is shorter than num_hidden_layers")
        kinds = [_kind_of_type(str(t)) for t in layer_types[:n_layers]]
    elif isinstance(interval, int) and not isinstance(interval, bool) and interval > 0:
        kinds = [LayerKind.FULL if (i + 1) % interval == 0 else LayerKind.RECURRENT
                 for i in range(n_layers)]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        kinds = [LayerKind.FULL if i % pattern == pattern - 1 else LayerKind.SLIDING
                 for i in range(n_layers)]
    elif isinstance(pattern, str) and pattern:
        kinds = [LayerKind.SLIDING if pattern[i % len(pattern)] == "L" else LayerKind.FULL
                 for i in range(n_layers)]
    else:
        kinds = [LayerKind.FULL] * n_layers
    shared = cfg.get("num_kv_shared_layers")
    if isinstance(shared, int) and not isinstance(shared, bool) and 0 < shared <= n_layers:
        kinds[n_layers - shared:] = [LayerKind.SHARED] * shared
    return kinds


def _kind_of_type(layer_type: str) -> LayerKind:
    if layer_type in ("full_attention", "attention", "chunked_attention"):
        return LayerKind.FULL
    if "sliding" in layer_type:
        return LayerKind.SLIDING
    return LayerKind.RECURRENT


def _per_layer_token_bytes(
    cfg: Mapping[str, Any], types: set[str], dtype_bytes: int
) -> tuple[int, int, str]:
    """(full-layer bytes/token, sliding-layer bytes/token, approximation note) for one layer."""
    if cfg.get("kv_lora_rank"):
        rank = _int(cfg, "kv_lora_rank")
        rope = _int(cfg, "qk_rope_head_dim")
        if types & _LATENT_MLA:
            per = (rank + rope) * dtype_bytes
            return per, per, ""
        heads = _int(cfg, "num_attention_heads")
        per = heads * (_int(cfg, "qk_nope_head_dim") + rope + _int(cfg, "v_head_dim")) * dtype_bytes
        note = "" if types & _EXPANDED_MLA else "MLA cache layout assumed expanded (upper bound)"
        return per, per, note

    heads = cfg.get("num_attention_heads")
    if not heads:
        return 0, 0, ""
    heads = _int(cfg, "num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or _int(cfg, "hidden_size") // heads
    if not isinstance(kv_heads, int) or not isinstance(head_dim, int):
        raise KvConfigError("num_key_value_heads and head_dim must be integers")
    sliding = 2 * kv_heads * head_dim * dtype_bytes
    # gemma4: global (full) layers may use their own head size and kv-head count.
    full_head_dim = cfg.get("global_head_dim") or head_dim
    full_kv_heads = kv_heads
    if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):
        full_kv_heads = _int(cfg, "num_global_key_value_heads")
    if not isinstance(full_head_dim, int):
        raise KvConfigError("global_head_dim must be an integer")
    return 2 * full_kv_heads * full_head_dim * dtype_bytes, sliding, ""


def _int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise KvConfigError(f"config field {key!r} missing or not a non-negative integer")
    return value
