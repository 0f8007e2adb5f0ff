"""What a new user meets first, from the command line: `--help` and `--version` without the engine,
hints that name the project's own `pull`, a busy port in one sentence (exit 78), a closed pipe
without a traceback, `pull` failures in words, `service status` without a systemd user session, and a
README that says how to run the CLI from the clone."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cli_runner import clean_env, closed_port, run_cli
from hub_double import HubDouble

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_help_and_version_import_neither_the_engine_nor_mlx(flag):
    probe = ("import sys\nfrom provider.cli import main\ntry:\n    main([%r])\nexcept SystemExit:\n    pass\n"
             "heavy = ('mlx', 'mlx_lm', 'provider.engine', 'provider.session', 'protocol', 'structlog', 'uvicorn')\n"
             "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy))\n") % flag
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "LOADED []"


def test_the_no_models_hint_names_pull_and_the_hubs_cli(tmp_path):
    (tmp_path / "hub").mkdir()
    out = run_cli("models", "--hf-cache-dir", str(tmp_path / "hub"), home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "`darkbloom-provider pull mlx-community/<model>`" in out.stdout
    assert "`hf download mlx-community/<model>`" in out.stdout and "huggingface-cli" not in out.stdout
    doctor = run_cli("doctor", "--no-coordinator", "--hf-cache-dir", str(tmp_path / "hub"), home=tmp_path)
    assert "no_models" in doctor.stdout and "`darkbloom-provider pull mlx-community/<model>`" in doctor.stdout


def test_a_busy_port_exits_78_with_a_sentence_naming_the_setting(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        (tmp_path / "hub").mkdir()
        out = run_cli("serve", "--local", "--local-port", str(port), "--state-dir", str(tmp_path / "state"),
                      "--hf-cache-dir", str(tmp_path / "hub"), home=tmp_path)
    assert out.returncode == 78, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert f"127.0.0.1:{port}" in line and "in use" in line and "local_port" in line and "--local-port" in line
    assert "Errno" not in line and "Traceback" not in out.stderr


class _BigStatus(BaseHTTPRequestHandler):
    """A running agent's /status, larger than a pipe holds, so the writer blocks until its reader leaves."""

    def do_GET(self) -> None:  # noqa: N802
        body = json.dumps({"mode": "local", "models": [{"id": f"org/m{i}", "state": "loaded"}
                                                       for i in range(20_000)]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("as_json", [True, False])
def test_a_reader_that_leaves_early_is_no_error(tmp_path, as_json):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BigStatus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = clean_env()
    env.update(HOME=str(tmp_path))
    try:
        proc = subprocess.Popen([sys.executable, "-m", "provider.cli", "status", *(["--json"] if as_json else []),
                                 "--local-port", str(server.server_address[1]), "--state-dir", str(tmp_path / "s")],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = proc.stdout.readline()  # as `| head -1` does, then it goes away
        proc.stdout.close()
        _, err = proc.communicate(timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert first.strip()
    assert proc.returncode == 141, err  # what a shell reports for a command whose reader left
    assert b"uncaught_exception" not in err and b"Traceback" not in err and b"BrokenPipe" not in err


@pytest.fixture
def pull_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DARKBLOOM_", "HF_"))}
    return {**env, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "0"}


def _pull(repo: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "provider.cli", "pull", repo, "--hf-cache-dir", str(tmp_path / "hub")],
                          env=env, capture_output=True, text=True, timeout=120)


def test_pull_failures_are_sentences_that_say_what_to_do(tmp_path, tiny_model_path, pull_env):
    with HubDouble({"org/tiny": tiny_model_path}) as hub:
        missing = _pull("org/missing", {**pull_env, "HF_ENDPOINT": hub.url}, tmp_path)
        offline = _pull("org/tiny", {**pull_env, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "1"}, tmp_path)
    nobody = f"http://127.0.0.1:{closed_port()}"
    unreachable = _pull("org/tiny", {**pull_env, "HF_ENDPOINT": nobody}, tmp_path)
    bad = _pull("not-a-repo", pull_env, tmp_path)
    for out in (missing, offline, unreachable, bad):
        assert out.returncode == 1
        [line] = out.stderr.strip().splitlines()
        assert line.startswith("darkbloom-provider: ") and not re.search(r"\([a-z]+_[a-z_]+\)", line)  # no bare code
    assert f"org/missing was not found on {hub.url}" in missing.stderr and "hf auth login" in missing.stderr
    assert "HF_HUB_OFFLINE is set" in offline.stderr
    assert f"{nobody} did not answer" in unreachable.stderr and "HF_ENDPOINT" in unreachable.stderr
    assert "is not a model id" in bad.stderr and "ORG/NAME" in bad.stderr


@pytest.mark.skipif(sys.platform == "darwin", reason="systemd user services are Linux's")
def test_service_status_without_a_user_session_says_what_to_do(tmp_path):
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    systemctl = bin_dir / "systemctl"
    systemctl.write_text("#!/bin/sh\necho 'Failed to connect to bus: No medium found' >&2\nexit 1\n")
    systemctl.chmod(0o755)
    out = run_cli("service", "status", home=tmp_path, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert out.returncode == 69
    assert "no systemd user session" in out.stderr and "loginctl enable-linger" in out.stderr
    assert "darkbloom-provider status" in out.stderr and "Failed to connect to bus" not in out.stderr


def test_the_readme_says_how_to_run_the_cli_from_the_clone():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "```sh\nmake demo\n```" in readme and "```sh\nmake test\n```" in readme
    assert "`.venv/bin/darkbloom-provider`" in readme and "`make venv`" in readme
    assert "pip install 'darkbloom-provider" not in readme  # not on PyPI: that line could never work
    assert "huggingface-cli" not in readme and "`darkbloom-provider pull mlx-community/<model>`" in readme
    assert "provider.tinymodel" in readme and "--tools" in readme
