"""The README's first command: `python -m provider.demo` end to end (what `make demo` runs)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_end_to_end_and_stops_the_server_cleanly(tiny_model_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DARKBLOOM_")}
    # The session's tiny model is the demo's model (same builder arguments): reused, nothing is
    # written into the source tree's .cache.
    out = subprocess.run([sys.executable, "-m", "provider.demo", "--model-dir", str(tiny_model_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    answer = text.split("darkbloom/demo-tiny> ", 1)[1].split("\n", 1)[0]
    assert answer.strip()  # the streamed answer was printed
    assert "completion" in text and "tokens)" in text
    assert "effective cap" in text and "darkbloom/demo-tiny" in text and "fits_now" in text  # doctor table
    assert '"mode": "local"' in text and '"state": "loaded"' in text  # /status JSON
    assert "server exited with code 0" in text
    assert f"{tiny_model_path} (tiny Llama" in text
    # The last line is what to run next: the CLI of this environment serving the demo model.
    exe, *command = text.strip().splitlines()[-1].split()
    assert os.access(exe, os.X_OK) and os.path.samefile(os.path.dirname(exe), os.path.dirname(sys.executable))
    assert command[:3] == ["serve", "--local", "--model-aliases"]
    alias, _, folder = command[3].partition("=")
    assert alias == "darkbloom/demo-tiny" and os.path.samefile(folder, tiny_model_path)
