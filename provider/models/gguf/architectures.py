"""What a GGUF's architecture becomes in MLX: mlx-lm's `config.json` and the names of its tensors.

llama.cpp names tensors `token_embd`, `output_norm`, `output` and `blk.N.<part>`, and keeps the
hyperparameters as `<arch>.<key>` metadata. Imported here: `llama` (Llama, Mistral and their
fine-tunes: llama.cpp writes Mistral as `llama`), `qwen2` and `qwen3`, dense only.

llama.cpp's converter reorders the rows of a Llama's Q and K projections so that its rotary embedding
can rotate adjacent pairs; Hugging Face's (and mlx-lm's, with `rope_traditional` false) rotate the two
halves of each head. The import puts the rows back (`unpermute_rows`), so an imported folder is the
same as one converted from the Hugging Face checkpoint. Qwen files are written in Hugging Face's order.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from provider.models.gguf.reader import GgufError, GgufHeader

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_BLOCK_PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's rope scaling, as a table of factors (read, not written)


@dataclass(frozen=True, slots=True)
class Architecture:
    gguf: str  # general.architecture
    model_type: str  # mlx-lm's

    def mlx_name(self, name: str) -> str:
        """The mlx-lm parameter a GGUF tensor is; GgufError for one this import does not know."""
        base, _, suffix = name.rpartition(".")
        if base in _TOP and suffix in ("weight", "bias"):
            return f"{_TOP[base]}.{suffix}"
        found = _BLOCK.fullmatch(name)
        if found and found[2] in _BLOCK_PARTS:
            return f"model.layers.{found[1]}.{_BLOCK_PARTS[found[2]]}.{found[3]}"
        if found and found[2].endswith("_exps"):
            raise GgufError(f"a mixture-of-experts {self.gguf} model ({name}): only dense models are imported")
        raise GgufError(f"tensor {name} is not part of a {self.gguf} model this import knows")

    def row_heads(self, name: str, config: dict[str, Any]) -> int | None:
        """The head count whose rows llama.cpp reordered in this tensor (None: rows as they are)."""
        if self.model_type != "llama":
            return None
        if re.fullmatch(r"blk\.\d+\.attn_q\.(weight|bias)", name):
            return int(config["num_attention_heads"])
        if re.fullmatch(r"blk\.\d+\.attn_k\.(weight|bias)", name):
            return int(config["num_key_value_heads"])
        return None


def architecture(header: GgufHeader) -> Architecture:
    arch = header.architecture
    if arch not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise GgufError(f"{header.path.name}: architecture {arch!r} is not imported (known: {known})")
    return Architecture(arch, ARCHITECTURES[arch])


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's Q/K reordering: within each head, row 2i+j of the file
    (j = 0, 1 of the pair i) goes back to row i + j·half."""
    if rows % (2 * heads):
        raise GgufError(f"a Q/K projection of {rows} rows cannot hold {heads} heads")
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def _meta(header: GgufHeader, key: str, default: Any = None, *, required: bool = False) -> Any:
    value = header.get(f"{header.architecture}.{key}", default)
    if required and value is None:
        raise GgufError(f"{header.path.name}: no {header.architecture}.{key} in its metadata")
    return value


def _int(header: GgufHeader, key: str, default: int | None = None) -> int:
    value = _meta(header, key, default, required=default is None)
    if isinstance(value, list):  # per-layer values: only uniform ones are imported
        if len(set(value)) != 1:
            raise GgufError(f"{header.path.name}: {header.architecture}.{key} differs between layers")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise GgufError(f"{header.path.name}: {header.architecture}.{key} is {value!r}, not a positive integer")
    return value


def build_config(header: GgufHeader, arch: Architecture, tensor_names: set[str],
                 rope_factors: np.ndarray | None) -> dict[str, Any]:
    """mlx-lm's config.json for the file (no quantization or dtype yet: the plan adds them)."""
    heads = _int(header, "attention.head_count")
    hidden = _int(header, "embedding_length")
    vocab = _meta(header, "vocab_size") or len(header.get("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise GgufError(f"{header.path.name}: no vocabulary size (no {header.architecture}.vocab_size, no tokens)")
    head_dim = _meta(header, "attention.key_length") or hidden // heads
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "architectures": [_HF_CLASS[arch.model_type]],
        "hidden_size": hidden,
        "num_hidden_layers": _int(header, "block_count"),
        "intermediate_size": _int(header, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(header, "attention.head_count_kv", heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(_meta(header, "attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(vocab),
        "max_position_embeddings": _int(header, "context_length"),
        "rope_theta": float(_meta(header, "rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if arch.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    elif arch.model_type == "qwen2" and head_dim != hidden // heads:
        raise GgufError(f"{header.path.name}: a qwen2 head size of {head_dim}, which mlx-lm's qwen2 cannot hold")
    scaling = rope_scaling(header, config, rope_factors)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def rope_scaling(header: GgufHeader, config: dict[str, Any], factors: np.ndarray | None) -> dict[str, Any] | None:
    """The rope scaling the file states: `<arch>.rope.scaling.*` (linear, yarn) or Llama 3.1's table of
    per-frequency factors, matched to the parameters that produce it (GgufError when none do)."""
    kind = _meta(header, "rope.scaling.type")
    factor = _meta(header, "rope.scaling.factor")
    if factors is not None:
        return _llama3_scaling(header, config, factors)
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = _meta(header, "rope.scaling.original_context_length")
        if not original:
            raise GgufError(f"{header.path.name}: yarn rope scaling without its original context length")
        return {"type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    raise GgufError(f"{header.path.name}: rope scaling {kind!r} is not imported")


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """Llama 3.1's rope factors for these parameters, as llama.cpp writes them (`rope_freqs`)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def _llama3_scaling(header: GgufHeader, config: dict[str, Any], factors: np.ndarray) -> dict[str, Any]:
    factor = float(factors.max())
    for original in (8192, 4096, 16384, 32768, 131072):
        for low, high in ((1.0, 4.0), (1.0, 8.0), (2.0, 4.0)):
            want = llama3_factors(config["rope_theta"], config["head_dim"], factor, low, high, original)
            if want.shape == factors.shape and np.allclose(want, factors, rtol=1e-4, atol=1e-5):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": original}
    raise GgufError(f"{header.path.name}: its rope_freqs table matches no Llama 3 rope scaling this import knows")


__all__ = ["ARCHITECTURES", "Architecture", "ROPE_FREQS", "architecture", "build_config", "llama3_factors",
           "rope_scaling", "unpermute_rows"]
