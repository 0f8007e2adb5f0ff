"""GGUF files the suite writes itself, with llama.cpp's own writer (the `gguf` package).

`export_gguf(model_dir, out, qtype=...)` writes one of the suite's tiny MLX models as llama.cpp's
converter would: tensors renamed to `blk.N.*`, a Llama's Q and K rows reordered for llama.cpp's rotary
embedding, 2-D weights quantized to `qtype` (norms stay float32, as llama.cpp keeps them), the
hyperparameters as `llama.*` metadata and the byte-level BPE vocabulary as `tokenizer.ggml.*`.
`raw_blocks` makes random blocks of a type `gguf` can decode but not encode (the K types), with sane
scales, for the conversions that have no encoder here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

F32 = GGMLQuantizationType.F32
_PARTS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_PARTS[rest]}.{suffix}"


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of a Llama's Q/K rows (convert_hf_to_gguf's `permute`)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def raw_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of `qtype` (rows × bytes) whose float16 scales are small and finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    halves = (rng.random((len(raw), 2)) * 0.02).astype("<f2").view(np.uint8)
    if qtype in (GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q3_K):
        raw[:, -2:] = halves[:, :2]  # d is the block's last field
    elif qtype is GGMLQuantizationType.Q2_K:
        raw[:, -4:] = halves
    else:
        raw[:, :4] = halves
    return raw.reshape(rows, cols // block * size)


def _tokenizer_metadata(model_dir: Path) -> dict[str, Any]:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    special = {added["id"] for added in spec.get("added_tokens", []) if added.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"tokens": tokens, "merges": merges, "token_type": [3 if i in special else 1 for i in range(len(tokens))]}


def export_gguf(model_dir: Path, out: Path, *, qtype: GGMLQuantizationType = F32, arch: str = "llama",
                chat_template: bool = True, overrides: dict[str, tuple[GGMLQuantizationType, np.ndarray]] | None = None,
                metadata: dict[str, Any] | None = None, tokenizer: bool = True,
                extra: dict[str, np.ndarray] | None = None, drop: frozenset[str] = frozenset()) -> Path:
    """`model_dir` (a suite model, float weights) as a GGUF at `out`; `overrides` puts raw blocks of
    another type in place of named GGUF tensors, `extra` adds float32 tensors (biases, norms, a
    rope_freqs table), `drop` leaves tensors out."""
    config = json.loads((model_dir / "config.json").read_text())
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(model_dir / "model.safetensors")).items()}
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    writer = GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    for key, value in {
        "context_length": config["max_position_embeddings"], "embedding_length": config["hidden_size"],
        "block_count": config["num_hidden_layers"], "feed_forward_length": config["intermediate_size"],
        "attention.head_count": heads, "attention.head_count_kv": kv_heads,
        "rope.dimension_count": config["hidden_size"] // heads, "vocab_size": config["vocab_size"],
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", config.get("rope_theta", 10000.0))
    if tokenizer:
        vocab = _tokenizer_metadata(model_dir)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(vocab["tokens"])
        writer.add_token_merges(vocab["merges"])
        writer.add_token_types(vocab["token_type"])
        eos = config["eos_token_id"]
        writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
        writer.add_add_bos_token(False)
    if chat_template:
        template = (model_dir / "chat_template.jinja")
        text = template.read_text() if template.exists() else json.loads(
            (model_dir / "tokenizer_config.json").read_text())["chat_template"]
        writer.add_chat_template(text)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    for name, array in weights.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings", True):
            continue
        target = gguf_name(name)
        if target in drop:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = permute(array, heads if "q_proj" in name else kv_heads)
        if overrides and target in overrides:
            kind, raw = overrides[target]
            writer.add_tensor(target, raw, raw_dtype=kind)
        elif array.ndim == 2 and qtype is not F32:
            writer.add_tensor(target, quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, array.astype(np.float32))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


__all__ = ["export_gguf", "gguf_name", "permute", "raw_blocks"]
