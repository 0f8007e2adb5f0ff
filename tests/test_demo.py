"""The README's first command: `python -m provider.demo` end to end (what `make demo` runs)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_answers_with_the_trained_model_and_stops_the_server_cleanly(trained_model_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DARKBLOOM_")}
    # The session's trained model is the demo's own import (same file, same options): found current, so
    # nothing is written into the source tree's .cache.
    out = subprocess.run([sys.executable, "-m", "provider.demo", "--model-dir", str(trained_model_path)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "SmolLM2-135M-Instruct by Hugging Face (Apache-2.0)" in text
    assert f"{trained_model_path} (float32, dequantized" in text and "already imported" in text
    answer = text.split("smollm2-135m-instruct> ", 1)[1].split("\n", 1)[0]
    assert "Paris" in answer, answer
    assert "completion" in text and "tokens)" in text
    assert "effective cap" in text and "smollm2-135m-instruct" in text and "fits_now" in text  # doctor table
    assert '"mode": "local"' in text and '"state": "loaded"' in text  # /status JSON
    assert "server exited with code 0" in text
    # The last line is what to run next: the CLI of this environment serving the demo model.
    exe, *command = text.strip().splitlines()[-1].split()
    assert os.access(exe, os.X_OK) and os.path.samefile(os.path.dirname(exe), os.path.dirname(sys.executable))
    assert command[:3] == ["serve", "--local", "--model-aliases"]
    alias, _, folder = command[3].partition("=")
    assert alias == "smollm2-135m-instruct" and os.path.samefile(folder, trained_model_path)
