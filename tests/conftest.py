"""Shared fixtures: tiny MLX models built offline by `provider.tinymodel`.

Models are built once per test session, on first use, into a temporary folder that is removed when
the session ends: `make test` leaves nothing behind (the models are ~430 MB together, and building them
takes a few seconds). To keep them between runs while you iterate, point
``DARKBLOOM_TINY_MODELS_DIR`` at a folder of your choice: models there are reused while the
builder version marker matches, and never deleted by the tests. Fixture names are stable; other
test modules may use them freely:

* ``tiny_model_path`` (session): ~5 MB float32 Llama, context 2048, vocab 2048. Fast; use it
  for almost everything.
* ``small_model_path`` (session): ~50 MB float32 Llama, context 4096, vocab 6144.
* ``quantized_model_path`` (session): the tiny shape quantized to 4 bits (fp32 scales),
  ~0.8 MB. Use it for load tests only.
* ``medium_model_path`` (session): ~394 MB float32 Llama. Slow to build and load; only for a
  test that really needs a big model.
* ``tiny_vlm_path`` (session): ~3.7 MB float32 Gemma-3 style vision-language model
  (`provider.tinyvlm`): 64×64 images, 16 soft tokens per image, context 4096. Loads with
  `mlx_vlm.load` (the `vision` extra).
* ``tiny_tools_model_path`` (session): the tiny shape with a tool-calling chat template
  (`provider.tinymodel`, ``tools=True``: Qwen2.5 style, `<tool_call>` = 3 and `</tool_call>` = 4,
  mlx-lm's `json_tools` parser). Its random weights call no tool by themselves.
* ``tiny_models_dir`` (session): the folder they are built in.

All tiny models use ChatML with `<|endoftext|>` = 0, `<|im_start|>` = 1 and `<|im_end|>` = 2;
`config.json` sets `eos_token_id: [2, 0]`.

`HF_HUB_OFFLINE=1` is set here so a model name that is not a local path fails at once instead
of trying the network.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from provider.tinymodel import build_tiny_model  # noqa: E402
from provider.tinyvlm import build_tiny_vlm  # noqa: E402

KEEP_MODELS_ENV = "DARKBLOOM_TINY_MODELS_DIR"


@pytest.fixture(scope="session")
def tiny_models_dir() -> Iterator[Path]:
    kept = os.environ.get(KEEP_MODELS_ENV)
    if kept:
        path = Path(kept).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="darkbloom-tiny-models-") as tmp:
        yield Path(tmp)


@pytest.fixture(scope="session")
def tiny_model_path(tiny_models_dir: Path) -> Path:
    return build_tiny_model(tiny_models_dir / "tiny-f32", preset="tiny")


@pytest.fixture(scope="session")
def tiny_tools_model_path(tiny_models_dir: Path) -> Path:
    return build_tiny_model(tiny_models_dir / "tiny-tools-f32", preset="tiny", tools=True)


@pytest.fixture(scope="session")
def small_model_path(tiny_models_dir: Path) -> Path:
    return build_tiny_model(tiny_models_dir / "small-f32", preset="small")


@pytest.fixture(scope="session")
def quantized_model_path(tiny_models_dir: Path) -> Path:
    return build_tiny_model(tiny_models_dir / "tiny-q4", preset="tiny", q_bits=4)


@pytest.fixture(scope="session")
def medium_model_path(tiny_models_dir: Path) -> Path:
    return build_tiny_model(tiny_models_dir / "medium-f32", preset="medium")


@pytest.fixture(scope="session")
def tiny_vlm_path(tiny_models_dir: Path) -> Path:
    return build_tiny_vlm(tiny_models_dir / "tiny-vlm-f32")
