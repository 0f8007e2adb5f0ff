"""The README demo (`make demo`): the provider's main job, end to end, on an embedded tiny model.

1. build the tiny demo model (random weights: its words are gibberish) into `.cache/demo-model`
   (or `--model-dir DIR`) unless it is already there;
2. start `darkbloom-provider serve --local` in a subprocess with a demo configuration file
   (alias `darkbloom/demo-tiny` -> that folder, a free loopback port);
3. wait for `/healthz`, send a streaming chat with the `openai` SDK and print the answer as it
   arrives;
4. print the `doctor` table and the `/status` JSON;
5. stop the server with SIGTERM and check it exited 0.

The demo's server sees none of the operator's `DARKBLOOM_*` variables, so what it shows does not
depend on the shell it runs in. Exit code 0 on success, 1 if any step failed.
"""

from __future__ import annotations

import argparse
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

from provider.tinymodel import build_tiny_model

MODEL_ID = "darkbloom/demo-tiny"
REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
PROMPT = "Write one sentence about unified memory on a Mac."


def demo_model_dir() -> Path:
    """`.cache/demo-model` in the source tree when writable, else the user's cache directory."""
    repo_cache = REPO_ROOT / ".cache"
    if os.access(REPO_ROOT, os.W_OK):
        return repo_cache / "demo-model"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "darkbloom" / "demo-model"


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
        temperature=0.8, seed=7, stream_options={"include_usage": True},
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
    heading("1. demo model")
    model_dir = build_tiny_model(model_dir or demo_model_dir(), preset="tiny")
    print(f"{model_dir} (tiny Llama, random weights: its words are gibberish)")

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
                heading("3. streaming chat with the openai SDK")
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
    return [("Next: serve the demo model yourself and point any OpenAI client at http://127.0.0.1:8484/v1 "
             "(a real model: `darkbloom-provider pull mlx-community/<model>`, see the README):"),
            f"  {exe} serve --local --model-aliases {MODEL_ID}={_shown(model_dir)}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m provider.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the demo model is built or reused (default: .cache/demo-model)")
    args = parser.parse_args(argv)
    try:
        return run(args.model_dir)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
