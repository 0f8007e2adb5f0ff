"""A newcomer's run is quiet and leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from conftest import KEEP_MODELS_ENV

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_IMPORT = "from transformers import PreTrainedTokenizerFast"


def _stderr_of(code: str) -> str:
    # Both are set in this process by imports (ours; mlx-vlm's): the child starts without them.
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "TRANSFORMERS_VERBOSITY")}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stderr


def test_transformers_pytorch_advice_is_not_printed_once_the_provider_is_imported():
    assert "PyTorch was not found" in _stderr_of(TOKENIZER_IMPORT)  # what a bare import prints
    assert "PyTorch was not found" not in _stderr_of(f"import provider; {TOKENIZER_IMPORT}")


def test_the_tiny_models_are_built_outside_the_source_tree(tiny_models_dir):
    if os.environ.get(KEEP_MODELS_ENV):
        assert tiny_models_dir == Path(os.environ[KEEP_MODELS_ENV]).expanduser()  # the developer's choice
    else:
        # a session's own temporary folder, or in a parallel run the one its workers share
        assert tiny_models_dir.resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())
        assert not tiny_models_dir.resolve().is_relative_to(ROOT.resolve())


def test_a_session_removes_its_model_folder_when_it_ends(tmp_path):
    """A separate pytest session with the suite's conftest: the folder it was given is gone afterwards."""
    record = tmp_path / "where.txt"
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_where.py").write_text(textwrap.dedent(f"""
        def test_where(tiny_models_dir):
            (tiny_models_dir / "model-stand-in").write_bytes(b"x" * 1024)
            open({str(record)!r}, "w").write(str(tiny_models_dir))
    """))
    env = {k: v for k, v in os.environ.items() if k != KEEP_MODELS_ENV}
    # the conftest's plugins (pytest_plugins) are the helper modules beside it in tests/
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_where.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    used = Path(record.read_text())
    assert used.name.startswith("darkbloom-tiny-models-")
    assert not used.exists()
