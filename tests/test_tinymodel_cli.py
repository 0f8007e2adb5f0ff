"""The tiny-model builders' command lines and output folders: a folder the builder did not make is
never replaced, bad options are usage errors (no traceback), quantization that quantizes nothing is
an error, and `--help` lists the presets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from provider import tinymodel, tinyvlm
from provider.tinymodel import (
    MARKER_FILE,
    PRESETS,
    Shape,
    _model_config,
    _save_weights,
    build_tiny_model,
    parameter_count,
)
from provider.tinyvlm import build_tiny_vlm
from provider.units import human_bytes

REPO = Path(__file__).resolve().parents[1]


def run_main(main, argv: list[str], capsys) -> tuple[int, str, str]:
    """`main(argv)`'s exit status, stdout and stderr, whether it returns or exits."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def precious_folder(root: Path) -> Path:
    folder = root / "X"
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "thesis.txt").write_text("precious\n")
    return folder


def assert_untouched(folder: Path) -> None:
    assert (folder / "src" / "thesis.txt").read_text() == "precious\n"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == ["src", "src/thesis.txt"]


def assert_one_error_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("python -m provider.tiny"), err
    for needle in needles:
        assert needle in lines[0], (needle, err)


# -- the output folder ------------------------------------------------------------------------------

@pytest.mark.parametrize("builder", [tinymodel, tinyvlm], ids=["tinymodel", "tinyvlm"])
@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_a_non_empty_folder_it_did_not_build_is_refused_and_untouched(tmp_path, capsys, builder, force):
    folder = precious_folder(tmp_path)
    code, out, err = run_main(builder.main, [str(folder)] + (["--force"] if force else []), capsys)
    assert code == 2
    assert_one_error_line(err, str(folder))
    assert_untouched(folder)
    assert [p.name for p in tmp_path.iterdir()] == ["X"]  # no temporary sibling left behind


@pytest.mark.parametrize("builder", [tinymodel, tinyvlm], ids=["tinymodel", "tinyvlm"])
def test_a_file_at_the_output_path_is_refused_and_untouched(tmp_path, capsys, builder):
    path = tmp_path / "notes.txt"
    path.write_text("keep me\n")
    code, _, err = run_main(builder.main, [str(path)], capsys)
    assert code == 2
    assert_one_error_line(err, str(path))
    assert path.read_text() == "keep me\n"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_folder_built_by_the_other_builder_is_not_ours(tmp_path, capsys):
    folder = tmp_path / "vlm"
    folder.mkdir()
    (folder / tinyvlm.MARKER_FILE).write_text("{}\n")
    (folder / "model.safetensors").write_bytes(b"weights")
    code, _, err = run_main(tinymodel.main, [str(folder)], capsys)
    assert code == 2
    assert_one_error_line(err, str(folder))
    assert (folder / "model.safetensors").read_bytes() == b"weights"


def test_the_programmatic_builders_refuse_too(tmp_path):
    folder = precious_folder(tmp_path)
    with pytest.raises(FileExistsError, match="X"):
        build_tiny_model(folder, preset="tiny")
    with pytest.raises(FileExistsError, match="X"):
        build_tiny_model(folder, preset="tiny", force=True)
    with pytest.raises(FileExistsError, match="X"):
        build_tiny_vlm(folder)
    assert_untouched(folder)


def test_the_command_line_refuses_a_precious_folder_without_a_traceback(tmp_path):
    folder = precious_folder(tmp_path)
    done = subprocess.run([sys.executable, "-m", "provider.tinymodel", str(folder)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert_one_error_line(done.stderr, str(folder))
    assert done.stdout == ""
    assert_untouched(folder)


def test_an_empty_folder_is_built_into(tmp_path, capsys):
    folder = tmp_path / "empty"
    folder.mkdir()
    code, out, _ = run_main(tinymodel.main, [str(folder)], capsys)
    assert code == 0
    assert (folder / MARKER_FILE).is_file() and (folder / "model.safetensors").is_file()
    assert str(folder) in out
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]


def test_its_own_folder_with_extra_files_is_rebuilt_for_another_spec(tmp_path, tiny_model_path):
    folder = build_tiny_model(tmp_path / "m", preset="tiny", seed=1)
    (folder / "stale.txt").write_text("from an older build\n")
    assert build_tiny_model(folder, preset="tiny") == folder
    assert (folder / "model.safetensors").read_bytes() == (tiny_model_path / "model.safetensors").read_bytes()
    assert not (folder / "stale.txt").exists()
    assert json.loads((folder / MARKER_FILE).read_text())["seed"] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


@pytest.mark.parametrize("builder", [tinymodel, tinyvlm], ids=["tinymodel", "tinyvlm"])
def test_an_output_path_that_cannot_be_written_is_a_sentence_not_a_traceback(tmp_path, capsys, builder):
    (tmp_path / "a-file").write_text("")
    out_dir = tmp_path / "a-file" / "model"  # its parent is a file
    code, out, err = run_main(builder.main, [str(out_dir)], capsys)
    assert code in (1, 2)
    assert_one_error_line(err, str(out_dir))
    assert out == ""


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux's /proc")
def test_proc_is_refused_with_a_sentence(capsys):
    code, _, err = run_main(tinymodel.main, ["/proc/nope"], capsys)
    assert code in (1, 2)
    assert_one_error_line(err, "/proc/nope")


# -- options ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["--q-bits", "7"],
    ["--q-bits", "16"],
    ["--q-bits", "four"],
    ["--q-bits", "4", "--q-group-size", "5"],
    ["--q-bits", "4", "--q-group-size", "256"],
    ["--q-group-size", "32"],  # a group size without --q-bits would quantize nothing
    ["--seed", "-1"],
    ["--seed", "one"],
    ["--preset", "huge"],
])
def test_bad_options_are_usage_errors_before_any_work(tmp_path, capsys, argv):
    out_dir = tmp_path / "m"
    code, out, err = run_main(tinymodel.main, [str(out_dir), *argv], capsys)
    assert code == 2
    assert "Traceback" not in err and "error:" in err
    assert not out_dir.exists() and list(tmp_path.iterdir()) == []


def test_a_negative_seed_is_a_usage_error_for_the_vlm_too(tmp_path, capsys):
    code, _, err = run_main(tinyvlm.main, [str(tmp_path / "v"), "--seed", "-1"], capsys)
    assert code == 2 and "error:" in err
    assert list(tmp_path.iterdir()) == []


def test_the_q_bits_choices_are_what_mlx_quantizes():
    import mlx.core as mx

    w = mx.ones((4, 128))
    for bits in tinymodel.Q_BITS:
        for group_size in tinymodel.Q_GROUP_SIZES:
            mx.eval(mx.quantize(w, group_size, bits))
    for bits in (0, 7, 9, 16):
        assert bits not in tinymodel.Q_BITS
        with pytest.raises(ValueError):
            mx.eval(mx.quantize(w, 64, bits))
    for group_size in (5, 16, 256):
        assert group_size not in tinymodel.Q_GROUP_SIZES
        with pytest.raises(ValueError):
            mx.eval(mx.quantize(w, group_size, 4))


@pytest.mark.parametrize("kwargs", [
    {"q_bits": 7}, {"q_bits": 4, "q_group_size": 5}, {"q_bits": 4, "q_group_size": 256}, {"seed": -1},
])
def test_the_programmatic_builder_validates_before_any_work(tmp_path, kwargs):
    with pytest.raises(ValueError):
        build_tiny_model(tmp_path / "m", preset="tiny", **kwargs)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("shape", [
    Shape(96, 1, 96, 2, 1, 256, 256),   # no layer's input is a multiple of 64: nothing quantized
    Shape(128, 1, 96, 2, 1, 256, 256),  # down_proj's input (96) is not: one layer left in float32
], ids=["none", "some"])
def test_quantization_that_leaves_weights_unquantized_is_an_error(tmp_path, shape):
    with pytest.raises(ValueError, match="not quantized"):
        _save_weights(tmp_path, _model_config(shape), "float32", 4, 64, 0, False)


def test_a_quantized_preset_quantizes_every_layer(quantized_model_path):
    config = json.loads((quantized_model_path / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64


# -- --help -----------------------------------------------------------------------------------------

def test_help_describes_every_preset_from_the_preset_table(capsys):
    code, out, _ = run_main(tinymodel.main, ["--help"], capsys)
    assert code == 0
    lines = out.splitlines()
    header = next(ln.split() for ln in lines if ln.split()[:1] == ["preset"])
    for name, shape in PRESETS.items():
        cells = next((ln.split() for ln in lines if ln.split()[:1] == [name]), None)
        assert cells is not None, (name, out)
        row = dict(zip(header, cells, strict=False))
        assert row["hidden"] == str(shape.hidden_size)
        assert row["layers"] == str(shape.num_hidden_layers)
        size = human_bytes(parameter_count(shape) * {"float32": 4, "bfloat16": 2, "float16": 2}[shape.dtype])
        assert " ".join(cells[len(header) - 1:]) == f"~{size} {shape.dtype}"
    assert "{1,2,3,4,5,6,8}" in out and "{32,64,128}" in out  # the quantization choices
