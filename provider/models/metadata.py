"""What a model directory's files say about the model: config fields, weight files, dtype.

Pure reading, no MLX: config.json for model_type, quantization and context length, the
safetensors headers (via the `safetensors` package, which also checks that each file is complete)
for the dtype the KV cache will have.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from memory.activation import ModelShape
from provider.models.kv import text_config

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
# mlx_lm.utils.load_model loads exactly the files matching this pattern; other *.safetensors in
# the directory (consolidated.safetensors, adapters) are not part of the served model.
WEIGHT_GLOB = "model*.safetensors"


class MetadataProblem(enum.Enum):
    BAD_CONFIG = "bad_config"
    CORRUPT_WEIGHTS = "corrupt_weights"


class MetadataError(Exception):
    """A model file exists but cannot be used. `kind` says which SkipReason it maps to."""

    def __init__(self, kind: MetadataProblem, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class DType(enum.Enum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"

    @property
    def nbytes(self) -> int:
        return 4 if self is DType.FLOAT32 else 2


_SAFETENSORS_DTYPES = {"F32": DType.FLOAT32, "F16": DType.FLOAT16, "BF16": DType.BFLOAT16}
_CONFIG_DTYPES = {
    "float32": DType.FLOAT32, "fp32": DType.FLOAT32,
    "float16": DType.FLOAT16, "fp16": DType.FLOAT16, "half": DType.FLOAT16,
    "bfloat16": DType.BFLOAT16, "bf16": DType.BFLOAT16,
}


class QuantMode(enum.Enum):
    AFFINE = "affine"
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"
    MXFP8 = "mxfp8"
    OTHER = "other"  # a scheme mlx-lm converts at load time (awq, gptq, ...) or does not know


@dataclass(frozen=True, slots=True)
class Quantization:
    bits: int
    group_size: int
    mode: QuantMode = QuantMode.AFFINE


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json as a dict; MetadataError(BAD_CONFIG) when it is not a JSON object with a model_type."""
    try:
        raw = (model_dir / CONFIG_FILE).read_bytes()
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MetadataError(MetadataProblem.BAD_CONFIG, "config.json is not valid JSON") from exc
    if not isinstance(config, dict):
        raise MetadataError(MetadataProblem.BAD_CONFIG, "config.json is not a JSON object")
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise MetadataError(MetadataProblem.BAD_CONFIG, "config.json has no model_type")
    return config


def quantization(config: Mapping[str, Any]) -> Quantization | None:
    """MLX writes `quantization`; HF-format checkpoints carry `quantization_config` (possibly nested
    in text_config, which mlx-lm also looks at)."""
    for candidate in (config.get("quantization"), config.get("quantization_config"),
                      text_config(config).get("quantization_config")):
        if not isinstance(candidate, Mapping):
            continue
        bits, group_size = candidate.get("bits"), candidate.get("group_size")
        if isinstance(bits, int) and isinstance(group_size, int):
            mode_name = candidate.get("mode", "affine")
            if "quant_method" in candidate and "mode" not in candidate:
                mode_name = "other"
            try:
                mode = QuantMode(mode_name)
            except ValueError:
                mode = QuantMode.OTHER
            return Quantization(bits=bits, group_size=group_size, mode=mode)
    return None


_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "max_seq_len", "seq_length",
                 "n_positions", "n_ctx")


def context_length(config: Mapping[str, Any]) -> int | None:
    """The trained context length, from the language-model part of the config; None if absent."""
    cfg = text_config(config)
    for key in _CONTEXT_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def config_dtype(config: Mapping[str, Any]) -> DType | None:
    cfg = text_config(config)
    for key in ("torch_dtype", "dtype"):
        value = cfg.get(key)
        if isinstance(value, str) and value.lower() in _CONFIG_DTYPES:
            return _CONFIG_DTYPES[value.lower()]
    return None


def activation_dtype(weight_files: Sequence[Path], config: Mapping[str, Any]) -> DType:
    """The dtype mlx-lm's activations, and so the KV cache, will have.

    Activations start at the token embedding: its `.weight` for a float model, its `.scales` for a
    quantized one (QuantizedEmbedding dequantizes to the scales' dtype). If no embedding tensor is
    recognisable, the float dtype holding the most bytes wins; the config's torch_dtype is the
    last resort. Raises MetadataError(CORRUPT_WEIGHTS) for an incomplete or unreadable file.
    """
    embed: DType | None = None
    float_bytes: dict[DType, int] = {}
    for path in weight_files:
        try:
            with safe_open(str(path), framework="numpy") as handle:
                for name in handle.keys():
                    tensor = handle.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(tensor.get_dtype())
                    if dtype is None:
                        continue
                    count = 1
                    for dim in tensor.get_shape():
                        count *= dim
                    float_bytes[dtype] = float_bytes.get(dtype, 0) + count * dtype.nbytes
                    if "embed" in name and name.endswith((".scales", ".weight")):
                        if embed is None or name.endswith(".scales"):
                            embed = dtype
        except SafetensorError as exc:
            raise MetadataError(
                MetadataProblem.CORRUPT_WEIGHTS,
                f"{path.name} is not a complete safetensors file",
            ) from exc
    if embed is not None:
        return embed
    if float_bytes:
        return max(float_bytes, key=float_bytes.__getitem__)
    return config_dtype(config) or DType.FLOAT32


def model_shape(config: Mapping[str, Any], dtype_bytes: int) -> ModelShape | None:
    """The text model's shape for the activation estimate (memory/activation.py), nesting handled; None
    when a field it needs is missing or not a positive integer."""
    cfg = text_config(config)
    fields: dict[str, int] = {}
    for name, key in (("hidden", "hidden_size"), ("intermediate", "intermediate_size"),
                      ("heads", "num_attention_heads"), ("vocab", "vocab_size")):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            return None
        fields[name] = value
    kv_heads = cfg.get("num_key_value_heads") or fields["heads"]
    head_dim = cfg.get("head_dim") or fields["hidden"] // fields["heads"]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (kv_heads, head_dim)):
        return None
    return ModelShape(kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=max(1, dtype_bytes), **fields)
