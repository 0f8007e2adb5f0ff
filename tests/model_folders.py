"""Synthetic model folders and Hugging Face hub caches: small but well-formed MLX model files, written
as a plain folder or as huggingface_hub lays out a cached repo."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx

CONFIG = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}


def model_files(dtype: mx.Dtype = mx.bfloat16, *, config: dict | None = None,
                quantized: bool = False, shards: int = 1) -> dict[str, bytes]:
    """The files of a small but well-formed MLX model directory, as name -> bytes."""
    import tempfile

    files: dict[str, bytes] = {}
    cfg = dict(config or CONFIG)
    tensors: list[dict[str, mx.array]] = []
    if quantized:
        cfg["quantization"] = {"group_size": 64, "bits": 4}
        tensors.append({"model.embed_tokens.weight": mx.zeros((16, 8), mx.uint32),
                        "model.embed_tokens.scales": mx.zeros((16, 1), dtype),
                        "model.embed_tokens.biases": mx.zeros((16, 1), dtype)})
    else:
        tensors.append({"model.embed_tokens.weight": mx.zeros((16, 64), dtype)})
    for i in range(shards - 1):
        tensors.append({f"model.layers.{i}.input_layernorm.weight": mx.ones((64,), dtype)})
    names = (["model.safetensors"] if shards == 1 else
             [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)])
    with tempfile.TemporaryDirectory() as tmp:
        for name, group in zip(names, tensors, strict=True):
            mx.save_safetensors(str(Path(tmp, name)), group)
            files[name] = Path(tmp, name).read_bytes()
    weight_map = {k: name for name, group in zip(names, tensors, strict=True) for k in group}
    files["model.safetensors.index.json"] = json.dumps({"weight_map": weight_map}).encode()
    files["config.json"] = json.dumps(cfg).encode()
    files["tokenizer.json"] = b'{"model": {"type": "BPE"}}'
    files["chat_template.jinja"] = b"{{ messages }}"
    return files


def write_dir(path: Path, files: dict[str, bytes]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def write_hf_repo(cache: Path, repo_id: str, revisions: dict[str, dict[str, bytes]], *,
                  main: str | None = None, mtimes: dict[str, int] | None = None) -> Path:
    """A hub-cache repo laid out as huggingface_hub does: blobs by content hash, snapshot files
    as relative symlinks into blobs/, refs/main holding a revision."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for rev, files in revisions.items():
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True)
        for name, data in files.items():
            blob = hashlib.sha256(data).hexdigest()
            (repo / "blobs" / blob).write_bytes(data)
            (snap / name).symlink_to(Path("..", "..", "blobs", blob))
        if mtimes and rev in mtimes:
            os.utime(snap, ns=(mtimes[rev], mtimes[rev]))
    if main is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(main)
    return repo


REV_OLD, REV_NEW = "a" * 40, "b" * 40
