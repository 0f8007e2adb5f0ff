"""The trained model through `serve --local`: greedy answers against mlx-lm's own, and a start-up timed.

* ``greedy``: the 20 prompts of tests/trained_reference.py, all sent at once (one batch; rows end at
  EOS at their own steps), temperature 0, against `mlx_lm.generate` (`stream_generate`, one sequence)
  on the same folder in this process. A prompt is *identical* when the texts are equal; where mlx-lm's
  own choice had a near-tie (the top token led the next by under 1e-3 nats) only the text up to it must
  match, since a batch's padding or another kernel may pick the other token there honestly.
* ``startup``: `serve --local` started; the time until it listens, the `model_loaded` event's figures
  (load_s and its parts: weights, measure, warm), and the latency of the first request (sent as soon as
  the server listens, so it waits for the load) and of the second.

    python benchmarks/trained_bench.py [--form f32|f16|bf16|q4] [--model-dir DIR] [--parts greedy,startup]
                                       [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from local_server import MODEL, start_server  # noqa: E402
from trained import trained_model  # noqa: E402
from trained_reference import PROMPTS, greedy  # noqa: E402


def greedy_part(path: Path, max_tokens: int) -> list[str]:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(path))
    with tempfile.TemporaryDirectory(prefix="trained-bench-") as tmp:
        server = start_server(Path(tmp), path)
        try:
            client = server.client()

            def ask(prompt: str):
                return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                      temperature=0, max_tokens=max_tokens, timeout=600)

            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                sent = [pool.submit(ask, p) for p in PROMPTS]
                wanted = [greedy(model, tokenizer, [{"role": "user", "content": p}], max_tokens) for p in PROMPTS]
                answers = [f.result() for f in sent]
        finally:
            server.stop()
    identical = tie_identical = differ = eos = compared = 0
    rows = []
    for prompt, answer, want in zip(PROMPTS, answers, wanted):
        text = answer.choices[0].message.content
        whole = tokenizer.decode(want.tokens)
        upto = tokenizer.decode(want.tokens[:want.comparable()])
        compared += want.comparable()
        eos += answer.choices[0].finish_reason == "stop"
        if text == whole:
            identical += 1
        elif want.comparable() < len(want.tokens) and text.startswith(upto):
            tie_identical += 1
        else:
            differ += 1
            rows.append(f"  differs: {prompt!r}: ours {text!r}, mlx-lm {whole!r}")
    return [f"greedy, {len(PROMPTS)} prompts in one batch, {max_tokens} tokens at most, against mlx_lm.generate:",
            "",
            "| prompts | identical | identical up to mlx-lm's near-tie | differ | ended at EOS | tokens compared |",
            "|---|---|---|---|---|---|",
            f"| {len(PROMPTS)} | {identical} | {tie_identical} | {differ} | {eos} | {compared} |", *rows, ""]


def startup_part(path: Path) -> list[str]:
    import openai

    from provider.demo import free_port, wait_ready

    with tempfile.TemporaryDirectory(prefix="trained-bench-") as tmp:
        port = free_port()
        log_path = Path(tmp) / "server.log"
        started = time.monotonic()
        env = {k: v for k, v in os.environ.items() if not k.startswith("DARKBLOOM_")}
        env.update(HOME=tmp, DARKBLOOM_LOG_FORMAT="json", DARKBLOOM_HF_CACHE_DIR=str(Path(tmp) / "hub"))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "provider.cli", "serve", "--local", "--local-port",
                                     str(port), "--model-aliases", f"{MODEL}={path}"], env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base, proc, timeout_s=300)
            listening = time.monotonic() - started
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
            latencies = []
            for _ in range(2):
                t = time.monotonic()
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                               max_tokens=8, temperature=0)
                latencies.append(time.monotonic() - t)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        loaded = next((json.loads(line) for line in log_path.read_text().splitlines()
                       if '"model_loaded"' in line), {})
    figures = " / ".join(f"{loaded.get(k, '-')}" for k in ("load_s", "weights_s", "measure_s", "warm_s"))
    return ["start-up: serve --local, the first request sent once it listens (it waits for the load):", "",
            "| listening s | load_s / weights / measure / warm | first request s | second s |", "|---|---|---|---|",
            f"| {listening:.1f} | {figures} | {latencies[0]:.2f} | {latencies[1]:.2f} |", ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--form", default="f32", help="f32, f16, bf16 or q4 (benchmarks/trained.py)")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--parts", default="greedy,startup")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    path = args.model_dir or trained_model(args.form)
    print(f"model {path}\n")
    parts = args.parts.split(",")
    if "startup" in parts:
        print("\n".join(startup_part(path)))
    if "greedy" in parts:
        print("\n".join(greedy_part(path, args.max_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
