"""Where the provider looked for models.

`models` and `doctor` with no model said nothing about where they had looked, and `serve --local`
with no model started silently and answered 404 to everything. They now name every place searched
(the Hugging Face cache, each of `model_dirs`, each alias, the imported models, Ollama's store) and
whether it exists; `serve` and `serve
--local` warn at start (one log line; `serve --local` also in words on stderr).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from cli_runner import clean_env, run_cli
from provider.config import Settings
from provider.demo import free_port, wait_ready
from provider.runtime import Runtime
from provider.telemetry import capture_redacted_logs


def places(home: Path) -> tuple[list[str], dict[str, str]]:
    """Flags naming one place of each kind, existing or not, and the environment around them."""
    (home / "hub").mkdir(parents=True, exist_ok=True)
    (home / "models").mkdir()
    flags = ["--hf-cache-dir", str(home / "hub"), "--model-dirs", str(home / "models"),
             "--model-dirs", str(home / "nowhere"), "--model-aliases", f"org/mine={home / 'gone'}"]
    return flags, {"DARKBLOOM_STATE_DIR": str(home / "state")}


def expected(home: Path) -> list[dict[str, object]]:
    return [{"source": "alias", "id": "org/mine", "path": str(home / "gone"), "exists": False},
            {"source": "model_dir", "id": None, "path": str(home / "models"), "exists": True},
            {"source": "model_dir", "id": None, "path": str(home / "nowhere"), "exists": False},
            *generated(home),
            {"source": "hf_cache", "id": None, "path": str(home / "hub"), "exists": True}]


def generated(home: Path) -> list[dict[str, object]]:
    """Where `import` writes (state_dir/models) and Ollama's store (the suite's empty one: conftest.py)."""
    return [{"source": "imported", "id": None, "path": str(home / "state" / "models"), "exists": False},
            {"source": "ollama", "id": None, "path": os.environ["OLLAMA_MODELS"], "exists": False}]


def test_models_says_where_it_looked_when_it_finds_nothing(tmp_path):
    flags, env = places(tmp_path)
    out = run_cli("models", *flags, env=env, home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "no models found" in out.stdout
    shown = words(out.stdout)
    for line in (f"Hugging Face cache {tmp_path / 'hub'} (exists)", f"model_dirs {tmp_path / 'models'} (exists)",
                 f"model_dirs {tmp_path / 'nowhere'} (missing)", f"alias org/mine {tmp_path / 'gone'} (missing)"):
        assert line in shown, line
    doc = json.loads(run_cli("models", "--json", *flags, env=env, home=tmp_path).stdout)
    assert doc["models"] == [] and doc["searched"] == expected(tmp_path)


def words(text: str) -> str:
    """Each line with its runs of spaces (table padding) read as one."""
    return "\n".join(" ".join(line.split()) for line in text.splitlines())


def test_doctor_says_where_it_looked_in_text_and_json(tmp_path):
    flags, env = places(tmp_path)
    doc = json.loads(run_cli("doctor", "--json", "--no-coordinator", *flags, env=env, home=tmp_path).stdout)
    assert doc["searched"] == expected(tmp_path)
    [problem] = [p for p in doc["problems"] if p["code"] == "no_models"]
    assert str(tmp_path / "hub") in problem["detail"] and str(tmp_path / "nowhere") in problem["detail"]
    text = words(run_cli("doctor", "--no-coordinator", *flags, env=env, home=tmp_path).stdout)
    assert f"looked in:\nalias org/mine {tmp_path / 'gone'} (missing)" in text
    assert f"Hugging Face cache {tmp_path / 'hub'} (exists)" in text
    assert f"model_dirs {tmp_path / 'nowhere'} (missing)" in text


def test_the_default_hugging_face_cache_is_named_too(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf"), "DARKBLOOM_STATE_DIR": str(tmp_path / "state")}
    doc = json.loads(run_cli("models", "--json", env=env, home=tmp_path).stdout)
    assert doc["searched"] == [*generated(tmp_path), {"source": "hf_cache", "id": None,
                                                      "path": str(tmp_path / "hf" / "hub"), "exists": False}]


async def test_serve_warns_once_at_start_when_there_is_no_model(tmp_path):
    (tmp_path / "hub").mkdir()
    settings = Settings(state_dir=tmp_path / "state", hf_cache_dir=tmp_path / "hub",
                        model_dirs=(tmp_path / "nowhere",), memory_limit_gb=8.0, memory_reserve_gb=0.5)
    with capture_redacted_logs() as logs:
        runtime = await Runtime.start(settings)
    await runtime.aclose()
    [warning] = [e for e in logs if e["event"] == "no_models_found"]
    assert warning["level"] == "warning"
    assert warning["path"] == [f"model_dirs {tmp_path / 'nowhere'} (missing)",
                               f"imported models {tmp_path / 'state' / 'models'} (missing)",
                               f"Ollama store {os.environ['OLLAMA_MODELS']} (missing)",
                               f"Hugging Face cache {tmp_path / 'hub'} (exists)"]


def test_serve_local_without_a_model_says_so_on_stderr_in_words(tmp_path):
    flags, env = places(tmp_path)
    port = free_port()
    base = clean_env()
    base.update(HOME=str(tmp_path), DARKBLOOM_LOG_FORMAT="json", **env)
    proc = subprocess.Popen([sys.executable, "-m", "provider.cli", "serve", "--local", "--local-port", str(port),
                             *flags], env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout_s=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    logs = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert [e["level"] for e in logs if e["event"] == "no_models_found"] == ["warning"]
    said = words("\n".join(line for line in err.splitlines() if not line.startswith("{")))
    assert "no models found: every request will get 404" in said
    assert f"model_dirs {tmp_path / 'nowhere'} (missing)" in said
    assert "Pointing the provider at real MLX models" in said
