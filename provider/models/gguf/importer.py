"""A GGUF file into a normal MLX model folder: plan from the header, then write, all or nothing.

`plan_import(header, view)` decides everything from the header before a tensor is converted: the
architecture and config.json, each tensor's MLX name and what it becomes (kept as it is, its codes kept,
requantized, or dequantized), the model's one float dtype, the folder's size, and the notes the command
prints. A file the import cannot use fails here, with one line (`GgufError`).

`write_folder(plan, view, out)` builds the folder beside `out` under a hidden temporary name
(config.json, the safetensors shards and their index, the tokenizer files, `darkbloom-import.json`),
loads it once through mlx-lm without reading the weights (every parameter present, every shape right),
and only then renames it into place. Whatever fails, no folder appears at `out` and nothing is left
beside it.

One float dtype: a GGUF often keeps norms in float32 beside float16 quantization scales, and MLX would
then run the activations, and so the KV cache, in float32: twice the KV bytes per token a float16 model
needs. The import casts every float tensor to one dtype: `--dtype`, else for a quantized model float16
(ggml's scales) where MLX computes on a GPU (Metal, CUDA) and float32 where it computes on the CPU (which
emulates float16), and for a float model the weights' own.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf.constants import GGMLQuantizationType

from provider.models.gguf import codes, tokenizer
from provider.models.gguf.architectures import ROPE_FREQS, Architecture, architecture, build_config, unpermute_rows
from provider.models.gguf.reader import GgufError, GgufHeader, GgufTensor, tensor_data
from provider.units import human_bytes

MARKER = "darkbloom-import.json"
MARKER_FORMAT = 1
SHARD_BYTES = 2 << 30  # a shard is built in memory before it is written: this bounds the import's memory
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_SOURCE_DTYPE = {GGMLQuantizationType.F32: "float32", GGMLQuantizationType.F16: "float16",
                 GGMLQuantizationType.BF16: "bfloat16", GGMLQuantizationType.F64: "float32"}


class Kind:
    FLOAT = "float"  # floats in the file, cast to the model's dtype
    EXACT = "exact"  # the file's codes kept as MLX affine
    REQUANT = "requantized"  # decoded and quantized again by MLX
    DEQUANT = "dequantized"  # decoded to floats


@dataclass(frozen=True, slots=True)
class TensorPlan:
    source: GgufTensor
    name: str  # the MLX parameter (…weight / …bias)
    kind: str
    bits: int | None  # MLX affine bits (EXACT, REQUANT)
    heads: int | None  # rows to put back in Hugging Face's order (llama Q/K), with this head count
    nbytes: int  # what it takes in the folder


@dataclass(frozen=True, slots=True)
class ImportPlan:
    header: GgufHeader
    arch: Architecture
    config: dict[str, Any]  # config.json, complete
    tensors: tuple[TensorPlan, ...]
    dtype: str
    template: str
    options: dict[str, Any]  # what was asked (recorded in the marker: the cache key beside the source)

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def quantization(self) -> dict[str, Any] | None:
        return self.config.get("quantization")

    def notes(self) -> list[str]:
        """What the import does beyond renaming, one line per source type that changes form."""
        lines = []
        by_type: dict[tuple[str, str, int | None], list[TensorPlan]] = {}
        for t in self.tensors:
            by_type.setdefault((t.source.type.name, t.kind, t.bits), []).append(t)
        for (type_name, kind, bits), group in sorted(by_type.items()):
            source = human_bytes(sum(t.source.nbytes for t in group))
            out = human_bytes(sum(t.nbytes for t in group))
            count = f"{len(group)} tensor{'s' if len(group) != 1 else ''}"
            if kind == Kind.REQUANT:
                lines.append(f"{type_name} → MLX {bits}-bit affine (group {codes.GROUP}), requantized: {count}, "
                             f"{source} → {out}")
            elif kind == Kind.DEQUANT:
                lines.append(f"{type_name} → {self.dtype}, dequantized: {count}, {source} → {out}")
            elif kind == Kind.FLOAT and _SOURCE_DTYPE[group[0].source.type] != self.dtype:
                lines.append(f"{type_name} → {self.dtype} (one float dtype for the model): {count}, {source} → {out}")
        if self.dtype != "float32" and on_cpu():
            lines.append(f"{self.dtype} on MLX's CPU backend (this machine) is emulated and many times slower than "
                         "float32: --dtype float32 for a model served here")
        elif self.dtype == "float32" and self.quantization is not None and not self.options.get("asked_dtype"):
            lines.append("scales and norms as float32: MLX runs on this machine's CPU, where float16 is emulated "
                         "(--dtype float16 for a copy meant for a Mac's GPU)")
        return lines


def _float_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * _DTYPE_BYTES[dtype]


def on_cpu() -> bool:
    """MLX computes on the CPU here (no Metal, no CUDA): float16 there is emulated."""
    return mx.default_device().type != mx.DeviceType.gpu


def _default_dtype(tensors: tuple[GgufTensor, ...], quantized: bool) -> str:
    if quantized:
        # ggml's scales are float16, a GPU's own dtype. MLX's CPU backend emulates float16: the same 4-bit
        # model with float32 scales answered about 30x faster there (SmolLM2-135M, 0.18 → 5.8 tok/s).
        return "float32" if on_cpu() else "float16"
    weights = Counter()
    for t in tensors:
        if len(t.shape) == 2 and codes.is_float(t.type):
            weights[_SOURCE_DTYPE[t.type]] += t.nbytes
    return weights.most_common(1)[0][0] if weights else "float16"


def _check_type(header: GgufHeader, tensor: GgufTensor) -> None:
    if codes.is_float(tensor.type) or tensor.type in codes.EXACT_BITS:
        return
    if tensor.type.name.startswith(("I8", "I16", "I32", "I64")) or not codes.can_requantize(tensor.type):
        raise GgufError(f"{header.path.name}: tensor {tensor.name} is {tensor.type.name}, a type this import "
                        "cannot convert")


def plan_import(header: GgufHeader, view: memoryview | None, *, dtype: str | None = None, dequantize: bool = False,
                chat_template: str | None = None) -> ImportPlan:
    """Everything the import will do, from the header (and the rope_freqs table, when there is one)."""
    arch = architecture(header)
    tokenizer.check(header)
    template = tokenizer.chat_template(header, chat_template)
    if dtype is not None and dtype not in DTYPES:
        raise GgufError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    names = {t.name for t in header.tensors}
    rope = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    factors = None
    if rope is not None:
        if view is None or rope.type is not GGMLQuantizationType.F32:
            raise GgufError(f"{header.path.name}: a rope_freqs table this import cannot read")
        factors = tensor_data(view, rope).view("<f4").astype(np.float64)
    config = build_config(header, arch, names, factors)
    weights = [t for t in header.tensors if t.name != ROPE_FREQS]
    if not weights:
        raise GgufError(f"{header.path.name}: no tensors")
    for t in weights:
        _check_type(header, t)
    keeps_quantized = not dequantize and any(not codes.is_float(t.type) and len(t.shape) == 2 for t in weights)
    asked = dtype is not None
    dtype = dtype or _default_dtype(header.tensors, keeps_quantized)
    scale_bytes = _DTYPE_BYTES[dtype]
    plans = []
    for t in weights:
        name = arch.mlx_name(t.name)
        heads = arch.row_heads(t.name, config)
        if codes.is_float(t.type):
            plans.append(TensorPlan(t, name, Kind.FLOAT, None, heads, _float_nbytes(t.shape, dtype)))
        elif dequantize or len(t.shape) != 2:
            plans.append(TensorPlan(t, name, Kind.DEQUANT, None, heads, _float_nbytes(t.shape, dtype)))
        else:
            kind = Kind.EXACT if t.type in codes.EXACT_BITS else Kind.REQUANT
            bits = codes.EXACT_BITS.get(t.type) or codes.requant_bits(t.type)
            plans.append(TensorPlan(t, name, kind, bits, heads,
                                    codes.quantized_bytes(t.type, (t.shape[0], t.shape[1]), scale_bytes)))
    config["torch_dtype"] = dtype
    eos = tokenizer.eos_ids(header)
    config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if isinstance(bos := header.get("tokenizer.ggml.bos_token_id"), int):
        config["bos_token_id"] = bos
    quant = _quantization(plans)
    if quant is not None:
        config["quantization"] = quant
        config["quantization_config"] = quant
    options = {"dtype": dtype, "dequantize": dequantize, "chat_template": chat_template is not None,
               "asked_dtype": asked}
    return ImportPlan(header, arch, dict(sorted(config.items())), tuple(plans), dtype, template, options)


def _quantization(plans: list[TensorPlan]) -> dict[str, Any] | None:
    """mlx-lm's quantization block: the most common width, and each module of another width by name."""
    widths = Counter(t.bits for t in plans if t.bits is not None)
    if not widths:
        return None
    common = widths.most_common(1)[0][0]
    block: dict[str, Any] = {"group_size": codes.GROUP, "bits": common, "mode": "affine"}
    for t in plans:
        if t.bits is not None and t.bits != common:
            block[t.name.removesuffix(".weight")] = {"group_size": codes.GROUP, "bits": t.bits, "mode": "affine"}
    return block


# --- writing


def _convert(plan: TensorPlan, view: memoryview, dtype: mx.Dtype) -> dict[str, mx.array]:
    t = plan.source
    raw = tensor_data(view, t)
    if plan.kind == Kind.FLOAT:
        arrays = {plan.name: codes.floats(t.type, raw, t.shape).astype(dtype)}
    elif plan.kind == Kind.DEQUANT:
        arrays = {plan.name: mx.array(codes.decoded(t.type, raw, t.shape)).astype(dtype)}
    else:
        weight, scales, biases, _ = codes.quantized(t.type, raw, (t.shape[0], t.shape[1]), dtype)
        base = plan.name.removesuffix(".weight")
        arrays = {plan.name: weight, f"{base}.scales": scales, f"{base}.biases": biases}
    if plan.heads is not None:
        order = mx.array(unpermute_rows(t.shape[0], plan.heads))
        arrays = {name: array[order] for name, array in arrays.items()}
    mx.eval(arrays)
    return arrays


def _shards(plans: tuple[TensorPlan, ...]) -> list[list[TensorPlan]]:
    shards: list[list[TensorPlan]] = []
    size = 0
    for t in plans:
        if not shards or size + t.nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _write_weights(plan: ImportPlan, view: memoryview, folder: Path, progress=None) -> None:
    dtype = DTYPES[plan.dtype]
    shards = _shards(plan.tensors)
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    weight_map: dict[str, str] = {}
    done = 0
    for name, shard in zip(names, shards):
        arrays: dict[str, mx.array] = {}
        for t in shard:
            arrays.update(_convert(t, view, dtype))
            done += t.nbytes
            if progress is not None:
                progress(done, plan.output_bytes)
        mx.save_safetensors(str(folder / name), arrays, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(arrays, name))
        del arrays
    if len(shards) > 1:
        index = {"metadata": {"total_size": plan.output_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def source_fingerprint(path: Path, digest: str | None = None) -> dict[str, Any]:
    """What names the source in the marker: a changed file is imported again."""
    stat = path.stat()
    found: dict[str, Any] = {"file": path.name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if digest is not None:
        found["sha256"] = digest
    return found


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The import's record in `folder`, or None (no record: not a folder this command made)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT else None


def is_current(folder: Path, source: dict[str, Any], options: dict[str, Any]) -> bool:
    """`folder` already holds this source imported with these options (the import can be skipped)."""
    marker = read_marker(folder)
    return marker is not None and marker.get("source") == source and marker.get("options") == options


def _verify(folder: Path) -> None:
    """mlx-lm builds the model from the folder, every parameter's name and shape checked (strict), the
    weights mapped, not read."""
    import mlx_lm

    try:
        mlx_lm.load(str(folder), lazy=True)
    except Exception as exc:  # mlx-lm's messages name parameters, never prompt text
        raise GgufError(f"the imported folder does not load in mlx-lm: {str(exc).splitlines()[0][:200]}") from None


def write_folder(plan: ImportPlan, view: memoryview, out: Path, *, model_id: str, source: dict[str, Any],
                 progress=None) -> None:
    """Build the folder beside `out` and rename it into place (replacing an earlier import of ours)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".importing", dir=out.parent))
    try:
        (work / "config.json").write_text(json.dumps(plan.config, indent=4) + "\n")
        tokenizer.write_tokenizer(plan.header, work, plan.template)
        _write_weights(plan, view, work, progress)
        _verify(work)
        marker = {"format": MARKER_FORMAT, "model_id": model_id, "source": source, "options": plan.options,
                  "architecture": plan.header.architecture, "notes": plan.notes()}
        (work / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        os.chmod(work, 0o755)
        _replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def write_tokenizer_folder(plan: ImportPlan, out: Path) -> None:
    """Only the tokenizer files and config.json (no weights), beside `out` and renamed into place: what a
    request needs to be counted and templated before the model it names is imported."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".importing", dir=out.parent))
    try:
        (work / "config.json").write_text(json.dumps(plan.config, indent=4) + "\n")
        tokenizer.write_tokenizer(plan.header, work, plan.template)
        os.chmod(work, 0o755)
        _replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _replace(work: Path, out: Path) -> None:
    if not out.exists():
        os.rename(work, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".replaced", dir=out.parent))
    os.rename(out, old / "folder")
    try:
        os.rename(work, out)
    except BaseException:
        os.rename(old / "folder", out)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


__all__ = ["DTYPES", "MARKER", "ImportPlan", "Kind", "TensorPlan", "is_current", "plan_import", "read_marker",
           "source_fingerprint", "write_folder", "write_tokenizer_folder"]
