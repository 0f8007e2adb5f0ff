"""What the bounded template renderer costs a short prompt (issue 29, item 2).

Run: `HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/template_bench.py [--n 2000]`

The tiny model's tokenizer and ChatML template (built offline into .cache/tiny-models/). Each row is
the prompt ids of one chat, as admission counts it; the baseline is mlx-lm's in-process
`tokenizer.apply_chat_template` (what the agent did before, on the event loop), measured in the same
run. The rows: the render in the renderer process then tokenizing here, from a thread (`render`, the
engine thread and the bulk lane) and awaited on the event loop (`arender`, a short prompt's path:
the wait runs on the renderer's thread). Prints µs per prompt (p50, p99) and p50 / baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from provider.models.template import ChatTemplate, Lane, encode, renderer
from provider.tinymodel import build_tiny_model
from timing import measure

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tiny-models"
CHATS = {
    "1 message": [{"role": "user", "content": "hello there"}],
    "8 messages, 2 KB": [{"role": ("user", "assistant")[i % 2], "content": "some words of a chat turn " * 10}
                         for i in range(8)],
}


async def measure_async(fn, n: int) -> tuple[float, float]:
    for _ in range(min(200, n)):
        await fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await fn()
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return statistics.median(samples) / 1e3, samples[int(0.99 * (len(samples) - 1))] / 1e3


async def run(n: int) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(build_tiny_model(CACHE / "tiny-f32", preset="tiny"))
    template = ChatTemplate.of(tokenizer)
    bounded = renderer(Lane.INTERACTIVE)
    print(f"prompt ids of one chat, tiny model's ChatML, n={n} per row (µs per prompt)")
    print(f"{'chat / path':74} {'p50':>8} {'p99':>8} {'p50 / baseline':>15}")
    for name, messages in CHATS.items():
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True)

        def in_process(messages=messages):
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

        def from_thread(messages=messages):
            return encode(tokenizer, bounded.render(template, messages, add_generation_prompt=True))

        async def on_loop(messages=messages):
            return encode(tokenizer, await bounded.arender(template, messages, add_generation_prompt=True))

        assert from_thread() == expected and await on_loop() == expected
        base = measure(in_process, n)
        rows = [("baseline: mlx-lm apply_chat_template, in-process", base),
                ("bounded render (from a thread) + tokenize here", measure(from_thread, n)),
                ("bounded render awaited on the event loop + tokenize", await measure_async(on_loop, n))]
        for label, (p50, p99) in rows:
            print(f"{name + ': ' + label:74} {p50:8.1f} {p99:8.1f} {p50 / base[0]:15.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2000)
    asyncio.run(run(parser.parse_args().n))


if __name__ == "__main__":
    main()
