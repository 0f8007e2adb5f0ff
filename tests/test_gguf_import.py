"""`darkbloom-provider import`: GGUF files the suite writes from its tiny models, imported and checked
against the model they came from, against llama.cpp's own decoding (the `gguf` package) and MLX's own
GGUF reader; and every way a file can be refused, with nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from cli_runner import run_cli
from gguf_files import export_gguf, permute, raw_blocks
from provider import cli
from provider.importing import ImportFailed, Source, resolve, run
from provider.models import discover
from provider.models.gguf import MARKER, read_header
from provider.models.gguf.architectures import llama3_factors
from provider.models.hashing import weight_hash_sync

TEXT = "Hello there, how are you? <|im_start|>user\nfine"


def _cli(capsys, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """The `import` command in this process (as `main` runs it, without its process-wide set-up)."""
    parsed = cli.build_parser().parse_args(["import", *args, "--state-dir", str(tmp_path / "state")])
    code = cli.cmd_import(parsed, cli.settings_from(parsed))
    out = capsys.readouterr()
    return code, out.out, out.err


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def f32_gguf(gguf_dir: Path, tiny_model_path: Path) -> Path:
    return export_gguf(tiny_model_path, gguf_dir / "tiny-f32.gguf")


def _logits(path: Path, text: str = TEXT) -> tuple[mx.array, list[int]]:
    model, tokenizer = mlx_lm.load(str(path))
    ids = tokenizer.encode(text)
    return model(mx.array([ids])), ids


# --- what an import is


def test_a_float_file_imports_as_the_model_it_came_from(tmp_path, f32_gguf, tiny_model_path):
    done = run(Source(f32_gguf, "tiny"), tmp_path / "tiny", "tiny")
    original, original_ids = _logits(tiny_model_path)
    imported, imported_ids = _logits(done.folder)
    assert imported_ids == original_ids  # the same tokenizer, rebuilt from the GGUF's vocabulary
    assert mx.array_equal(imported, original).item()  # Q/K rows back in Hugging Face's order, bit for bit
    config = json.loads((done.folder / "config.json").read_text())
    assert config["model_type"] == "llama" and not config.get("rope_traditional", False)
    assert config["torch_dtype"] == "float32" and config["eos_token_id"] == 2
    assert "quantization" not in config
    assert (done.folder / "chat_template.jinja").read_text() == (tiny_model_path / "chat_template.jinja").read_text()


def test_the_same_file_imports_to_the_same_weight_hash(tmp_path, f32_gguf):
    first = run(Source(f32_gguf, "a"), tmp_path / "a", "a")
    second = run(Source(f32_gguf, "b"), tmp_path / "b", "b")
    assert weight_hash_sync(first.folder) == weight_hash_sync(second.folder)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
def test_quantized_types_keep_their_codes(tmp_path, tiny_model_path, qtype):
    gguf = export_gguf(tiny_model_path, tmp_path / f"tiny-{qtype.name}.gguf", qtype=qtype)
    done = run(Source(gguf, "q"), tmp_path / "q", "q", dtype="float32")
    config = json.loads((done.folder / "config.json").read_text())
    bits = {T.Q8_0: 8, T.Q5_0: 5, T.Q5_1: 5}.get(qtype, 4)
    assert config["quantization"]["bits"] == bits and config["quantization"]["group_size"] == 32
    weights = mx.load(str(done.folder / "model.safetensors"))
    header = read_header(gguf)
    heads = config["num_attention_heads"]
    for tensor in header.tensors:
        if tensor.type is not qtype:
            continue
        name = {"token_embd.weight": "model.embed_tokens.weight"}.get(tensor.name)
        if name is None:
            layer, part = tensor.name.split(".")[1:3]
            name = next(k for k in weights if k.startswith(f"model.layers.{layer}.") and k.endswith(
                {"attn_q": "q_proj.weight", "attn_k": "k_proj.weight", "attn_v": "v_proj.weight",
                 "attn_output": "o_proj.weight", "ffn_gate": "gate_proj.weight", "ffn_up": "up_proj.weight",
                 "ffn_down": "down_proj.weight"}[part]))
        base = name.removesuffix(".weight")
        ours = np.array(mx.dequantize(weights[name], weights[f"{base}.scales"], weights[f"{base}.biases"],
                                      group_size=32, bits=bits))
        with open(gguf, "rb") as f:
            f.seek(tensor.offset)
            raw = np.frombuffer(f.read(tensor.nbytes), dtype=np.uint8)
        ggml = quants.dequantize(raw.reshape(tensor.shape[0], -1), qtype)  # llama.cpp's own decoding
        if "q_proj" in name or "k_proj" in name:  # ours are in Hugging Face's row order, the file's are not
            ours = permute(ours, heads if "q_proj" in name else config["num_key_value_heads"])
        np.testing.assert_allclose(ours, ggml, rtol=1e-6, atol=1e-7)


def test_the_codes_are_mlx_s_own_reading_of_the_file(tmp_path, tiny_model_path):
    """MLX reads Q4_0/Q4_1/Q8_0 GGUFs itself; ours are the same words, scales and biases, bit for bit."""
    for qtype in (T.Q4_1, T.Q8_0):
        gguf = export_gguf(tiny_model_path, tmp_path / f"tiny-{qtype.name}.gguf", qtype=qtype)
        done = run(Source(gguf, qtype.name), tmp_path / qtype.name, qtype.name)
        ours = mx.load(str(done.folder / "model.safetensors"))
        theirs = mx.load(str(gguf))
        for name, ggml in (("model.layers.0.mlp.down_proj", "blk.0.ffn_down"),
                           ("model.layers.1.self_attn.v_proj", "blk.1.attn_v")):
            for suffix in ("weight", "scales", "biases"):
                assert mx.array_equal(ours[f"{name}.{suffix}"], theirs[f"{ggml}.{suffix}"]).item(), (qtype, name)


def test_k_types_keep_their_codes_and_the_rest_are_requantized_with_a_note(tmp_path, tiny_model_path, capsys):
    rows, cols = 256, 256  # the tiny model's projections: the K types' 256-value blocks fit
    overrides = {"blk.0.ffn_down.weight": (T.Q4_K, raw_blocks(T.Q4_K, rows, cols, 1)),
                 "blk.0.ffn_up.weight": (T.Q5_K, raw_blocks(T.Q5_K, rows, cols, 2)),
                 "blk.1.ffn_up.weight": (T.Q6_K, raw_blocks(T.Q6_K, rows, cols, 3))}
    gguf = export_gguf(tiny_model_path, tmp_path / "k.gguf", qtype=T.Q8_0, overrides=overrides)
    code, out, err = _cli(capsys, tmp_path, str(gguf), "--out", str(tmp_path / "k"))
    assert code == 0, err
    assert "Q6_K → MLX 8-bit affine (group 32), requantized: 1 tensor" in out
    assert "Q4_K" not in out and "Q5_K" not in out  # kept: nothing to say
    config = json.loads((tmp_path / "k" / "config.json").read_text())
    assert config["quantization"]["model.layers.0.mlp.down_proj"]["bits"] == 4
    assert config["quantization"]["model.layers.0.mlp.up_proj"]["bits"] == 5
    assert config["quantization"]["bits"] == 8
    weights = mx.load(str(tmp_path / "k" / "model.safetensors"))
    for part, (qtype, raw), bits in (("0.mlp.down_proj", overrides["blk.0.ffn_down.weight"], 4),
                                     ("0.mlp.up_proj", overrides["blk.0.ffn_up.weight"], 5),
                                     ("1.mlp.up_proj", overrides["blk.1.ffn_up.weight"], 8)):
        name = f"model.layers.{part}"
        ours = np.array(mx.dequantize(weights[f"{name}.weight"], weights[f"{name}.scales"].astype(mx.float32),
                                      weights[f"{name}.biases"].astype(mx.float32), group_size=32, bits=bits))
        ggml = quants.dequantize(raw, qtype)
        span = float(np.abs(ggml).max())
        # K codes kept: only the float16 rounding of d·sc and dmin·m; Q6_K requantized to 8 bits
        bound = 2e-3 if qtype is not T.Q6_K else 2 / 255
        assert float(np.abs(ours - ggml).max()) <= bound * span, (qtype, float(np.abs(ours - ggml).max()) / span)
    mlx_lm.load(str(tmp_path / "k"))  # and the model builds


def test_float32_norms_beside_float16_scales_become_one_dtype(tmp_path, tiny_model_path, capsys):
    gguf = export_gguf(tiny_model_path, tmp_path / "q.gguf", qtype=T.Q4_0)
    code, out, _ = _cli(capsys, tmp_path, str(gguf), "--out", str(tmp_path / "q"), "--dtype", "float16")
    assert code == 0
    assert "F32 → float16 (one float dtype for the model)" in out
    assert "float16 on MLX's CPU backend (this machine) is emulated" in out  # this suite runs on the CPU
    weights = mx.load(str(tmp_path / "q" / "model.safetensors"))
    assert {str(w.dtype) for k, w in weights.items() if not k.endswith(".weight") or w.dtype != mx.uint32} == {
        "mlx.core.float16"}
    assert json.loads((tmp_path / "q" / "config.json").read_text())["torch_dtype"] == "float16"


def test_on_the_cpu_a_quantized_model_s_floats_default_to_float32(tmp_path, tiny_model_path, capsys):
    """MLX's CPU backend emulates float16: the 4-bit SmolLM2 answered ~30x slower with float16 scales."""
    gguf = export_gguf(tiny_model_path, tmp_path / "q.gguf", qtype=T.Q4_1)
    code, out, _ = _cli(capsys, tmp_path, str(gguf), "--out", str(tmp_path / "q"))
    assert code == 0 and "scales and norms as float32: MLX runs on this machine's CPU" in out
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["quantization"]["bits"] == 4
    assert mx.load(str(tmp_path / "q" / "model.safetensors"))["model.layers.0.mlp.up_proj.scales"].dtype == mx.float32


def test_dequantize_gives_llama_cpp_s_values_as_floats(tmp_path, tiny_model_path, capsys):
    gguf = export_gguf(tiny_model_path, tmp_path / "q.gguf", qtype=T.Q8_0)
    code, out, _ = _cli(capsys, tmp_path, str(gguf), "--dequantize", "--dtype", "float32")
    assert code == 0
    assert "as q-float32" in out and "Q8_0 → float32, dequantized" in out
    folder = tmp_path / "state" / "models" / "q-float32"
    weights = mx.load(str(folder / "model.safetensors"))
    assert all(w.dtype == mx.float32 for w in weights.values())
    header = read_header(gguf)
    down = next(t for t in header.tensors if t.name == "blk.0.ffn_down.weight")
    with open(gguf, "rb") as f:
        f.seek(down.offset)
        raw = np.frombuffer(f.read(down.nbytes), dtype=np.uint8).reshape(down.shape[0], -1)
    np.testing.assert_array_equal(np.array(weights["model.layers.0.mlp.down_proj.weight"]), quants.dequantize(raw, T.Q8_0))


def test_llama3_rope_scaling_is_read_from_its_table(tmp_path, tiny_model_path):
    factors = llama3_factors(10000.0, 64, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    gguf = export_gguf(tiny_model_path, tmp_path / "r.gguf", extra={"rope_freqs.weight": factors})
    done = run(Source(gguf, "r"), tmp_path / "r", "r")
    scaling = json.loads((done.folder / "config.json").read_text())["rope_scaling"]
    assert scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in mx.load(str(done.folder / "model.safetensors"))
    bad = export_gguf(tiny_model_path, tmp_path / "bad.gguf", extra={"rope_freqs.weight": factors[::-1].copy()})
    with pytest.raises(ImportFailed, match="rope_freqs table matches no Llama 3 rope scaling"):
        run(Source(bad, "bad"), tmp_path / "bad", "bad")
    assert not (tmp_path / "bad").exists()


def test_qwen2_and_qwen3_files_import(tmp_path, tiny_model_path):
    biases = {f"blk.{i}.attn_{p}.bias": np.zeros(n, np.float32) for i in range(2)
              for p, n in (("q", 256), ("k", 128), ("v", 128))}
    norms = {f"blk.{i}.attn_{p}_norm.weight": np.ones(64, np.float32) for i in range(2) for p in ("q", "k")}
    for arch, extra in (("qwen2", biases), ("qwen3", norms)):
        gguf = export_gguf(tiny_model_path, tmp_path / f"{arch}.gguf", arch=arch, extra=extra)
        done = run(Source(gguf, arch), tmp_path / arch, arch)
        config = json.loads((done.folder / "config.json").read_text())
        assert config["model_type"] == arch and config["head_dim"] == 64
        if arch == "qwen2":  # zero biases: the llama it came from (Qwen files keep Hugging Face's row order)
            assert mx.allclose(_logits(done.folder)[0], _logits(tiny_model_path)[0], atol=1e-5).item()
        else:
            _logits(done.folder)  # builds and runs


# --- refusals: one line, exit 1, nothing left behind


def _refused(capsys, tmp_path: Path, source: Path | str, *extra: str) -> str:
    out = tmp_path / "out"
    code, stdout, err = _cli(capsys, tmp_path, str(source), "--out", str(out), *extra)
    assert code == 1, (stdout, err)
    assert err.count("\n") == 1 and err.startswith("darkbloom-provider: import: "), err
    assert not out.exists() and _leftovers(tmp_path) == sorted(
        p.name for p in tmp_path.iterdir() if p.name != "out"), "a half-written folder was left"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    return err


def test_not_a_gguf(tmp_path, capsys):
    (tmp_path / "notes.gguf").write_text("just some text, not a model\n")
    assert "not a GGUF file" in _refused(capsys, tmp_path, tmp_path / "notes.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "not a GGUF file (it is empty)" in _refused(capsys, tmp_path, tmp_path / "empty.gguf")


def test_no_such_file(tmp_path, capsys):
    assert "no such file" in _refused(capsys, tmp_path, tmp_path / "missing.gguf")


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.001])
def test_a_truncated_file(tmp_path, capsys, f32_gguf, keep):
    data = f32_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:max(24, int(len(data) * keep))])
    assert "truncated" in _refused(capsys, tmp_path, cut)


def test_an_unknown_architecture(tmp_path, capsys, tiny_model_path):
    gguf = export_gguf(tiny_model_path, tmp_path / "x.gguf", arch="gptneox")
    assert "architecture 'gptneox' is not imported (known: llama, mistral, qwen2, qwen3)" in _refused(
        capsys, tmp_path, gguf)


def test_no_tokenizer_and_no_chat_template(tmp_path, capsys, tiny_model_path):
    gguf = export_gguf(tiny_model_path, tmp_path / "notok.gguf", tokenizer=False)
    assert "no tokenizer" in _refused(capsys, tmp_path, gguf)
    gguf = export_gguf(tiny_model_path, tmp_path / "notemplate.gguf", chat_template=False)
    assert "no chat template" in _refused(capsys, tmp_path, gguf)
    template = tmp_path / "t.jinja"
    template.write_text((tiny_model_path / "chat_template.jinja").read_text())
    code, _, err = _cli(capsys, tmp_path, str(gguf), "--out", str(tmp_path / "given"), "--chat-template",
                        str(template))
    assert code == 0, err


def test_a_type_it_cannot_convert_is_named(tmp_path, capsys, tiny_model_path):
    overrides = {"blk.0.ffn_down.weight": (T.I32, np.zeros((256, 256), np.int32))}
    gguf = export_gguf(tiny_model_path, tmp_path / "i.gguf", overrides=overrides)
    assert "tensor blk.0.ffn_down.weight is I32, a type this import cannot convert" in _refused(capsys, tmp_path, gguf)


def test_a_file_missing_a_tensor_never_becomes_a_folder(tmp_path, capsys, tiny_model_path):
    gguf = export_gguf(tiny_model_path, tmp_path / "m.gguf", drop=frozenset({"blk.1.ffn_gate.weight"}))
    assert "does not load in mlx-lm" in _refused(capsys, tmp_path, gguf)


def test_a_folder_it_did_not_make_is_never_replaced(tmp_path, capsys, f32_gguf):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    code, _, err = _cli(capsys, tmp_path, str(f32_gguf), "--out", str(theirs))
    assert code == 1 and "is not a folder this command imported" in err
    assert _leftovers(theirs) == ["notes.txt"]


def test_an_import_is_skipped_when_current_and_redone_when_the_file_changes(tmp_path, capsys, f32_gguf):
    source = tmp_path / "tiny.gguf"
    shutil.copy(f32_gguf, source)
    code, out, _ = _cli(capsys, tmp_path, str(source))
    assert code == 0 and "importing tiny.gguf" in out
    folder = tmp_path / "state" / "models" / "tiny"
    assert json.loads((folder / MARKER).read_text())["model_id"] == "tiny"
    code, out, _ = _cli(capsys, tmp_path, str(source))
    assert code == 0 and "already imported" in out and "importing" not in out
    code, out, _ = _cli(capsys, tmp_path, str(source), "--dtype", "float16")  # other options: imported again
    assert code == 0 and "importing" in out
    os.utime(source, ns=(1, 1))
    code, out, _ = _cli(capsys, tmp_path, str(source), "--dtype", "float16")
    assert code == 0 and "importing" in out
    assert [p.name for p in folder.parent.iterdir()] == ["tiny"]  # replaced in place, nothing beside it


def test_imported_folders_are_discovered_under_their_id(tmp_path, f32_gguf):
    models = tmp_path / "state" / "models"
    run(Source(f32_gguf, "x"), models / "llama3.2:1b", "llama3.2:1b")
    (models / "not-ours").mkdir()
    inventory = discover(hf_cache=None, imported=models)
    assert [m.id for m in inventory.models] == ["llama3.2:1b"]
    assert inventory.models[0].weight_bytes == sum(p.stat().st_size for p in (models / "llama3.2:1b").glob(
        "model*.safetensors"))


def test_resolve_names_the_file_or_the_ollama_model(tmp_path, f32_gguf):
    assert resolve(str(f32_gguf)).model_id == "tiny-f32"
    with pytest.raises(ImportFailed, match="not a file"):
        resolve(str(tmp_path))


def test_the_command_line_says_one_line_and_exits_1(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + b"\xff" * 20)
    out = run_cli("import", str(tmp_path / "x.gguf"), home=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "darkbloom-provider: import: x.gguf: GGUF version 4294967295; versions 2 and 3 are read"], out.stderr
    (tmp_path / "big.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "big") + b"\0" * 16)
    out = run_cli("import", str(tmp_path / "big.gguf"), home=tmp_path)
    assert out.returncode == 1 and "a big-endian GGUF, which MLX cannot use" in out.stderr
    assert not (tmp_path / ".local" / "share" / "darkbloom" / "models").exists() or not any(
        (tmp_path / ".local" / "share" / "darkbloom" / "models").iterdir())
