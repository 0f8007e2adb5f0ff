"""What the bounded template renderer costs a short prompt, alone and in a burst.

Run: `HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/template_bench.py [--n 2000] [--bursts 20] [--only burst]
[--against REF] [--contend N]`

The tiny model's tokenizer and ChatML template (built offline into .cache/tiny-models/). Each row is
the prompt ids of one chat, as admission counts it; the baseline is mlx-lm's in-process
`tokenizer.apply_chat_template` (what the agent did before, on the event loop), measured in the same
run. The rows: the render in the renderer process then tokenizing here, from a thread (`render`, the
engine thread and the bulk lane) and awaited on the event loop (`arender`, a short prompt's path:
the loop reads the answer itself). Prints µs per prompt (p50, p99) and p50 / baseline.

The burst table: 32 renders awaited at once on the event loop, each one's latency from the call to
its text (ms, over every render of `--bursts` bursts), and the burst's span (the first call to the last
text, median). Two loops: an idle one (the 32 calls made together), and a busy one shaped like a
burst of requests at the local server (arrivals 1.1 ms apart, each request spending 1 ms of the
loop's CPU before its render and 1 ms after: reading, parsing, admission). The floors: mlx-lm's
render in-process on the loop (unbounded), and two turns of the loop (what an off-loop render that
cost nothing would wait for the loop); `--against REF` adds the renderer as it was at a git ref;
`--contend N` keeps N processes spinning on the CPU during the bursts, as MLX's compute and the
client take the cores during a real burst on a small machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
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

        assert await asyncio.to_thread(from_thread) == expected and await on_loop() == expected
        base = measure(in_process, n)
        rows = [("baseline: mlx-lm apply_chat_template, in-process", base),
                ("bounded render (from a thread) + tokenize here", await asyncio.to_thread(measure, from_thread, n)),
                ("bounded render awaited on the event loop + tokenize", await measure_async(on_loop, n))]
        for label, (p50, p99) in rows:
            print(f"{name + ': ' + label:74} {p50:8.1f} {p99:8.1f} {p50 / base[0]:15.2f}")


BURST = 32
LOOPS = {"idle loop, 32 at once": (0.0, 0.0), "busy loop, 1.1 ms apart, 2 ms of loop CPU each": (1.1, 2.0)}
REPO = Path(__file__).resolve().parent.parent


_DEVNULL = os.open(os.devnull, os.O_WRONLY)


def _spin(ms: float) -> None:
    """The loop's own CPU for a request: pure Python (it holds the GIL, as parsing and admission do)
    in slices of 0.1 ms, each followed by a write (which lets the GIL go, as the loop's socket reads
    and writes do)."""
    end = time.perf_counter() + ms / 1e3
    while (now := time.perf_counter()) < end:
        stop = min(end, now + 1e-4)
        while time.perf_counter() < stop:
            pass
        os.write(_DEVNULL, b"x")


async def one_burst(render, *, spread_ms: float, busy_ms: float) -> tuple[list[float], float]:
    """Each render's latency (ms) in one burst of `BURST` requests, and the burst's span (ms)."""
    latencies: list[float] = []
    ends: list[float] = []

    async def request(i: int) -> None:
        if spread_ms:
            await asyncio.sleep(i * spread_ms / 1e3)  # the client's sends, spread as a real burst's
        _spin(busy_ms / 2)
        t0 = time.perf_counter()
        await render()
        ends.append(time.perf_counter())
        latencies.append((ends[-1] - t0) * 1e3)
        _spin(busy_ms / 2)

    start = time.perf_counter()
    await asyncio.gather(*(request(i) for i in range(BURST)))
    return latencies, (max(ends) - start) * 1e3


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[int(q * (len(ordered) - 1))]


def renderer_at(ref: str):
    """The interactive renderer as it was at git `ref`: its module (`provider/models/renderer.py`, or
    `template.py` before that held it) loaded from a scratch folder with the child script beside it."""
    import importlib.util
    import tempfile

    def show(name: str) -> bytes | None:
        shown = subprocess.run(["git", "show", f"{ref}:provider/models/{name}"], cwd=REPO, capture_output=True,
                               check=False)
        return shown.stdout if shown.returncode == 0 else None

    folder = Path(tempfile.mkdtemp(prefix="template-at-"))
    (folder / "_template_child.py").write_bytes(show("_template_child.py"))
    name = "renderer.py" if show("renderer.py") is not None else "template.py"
    (folder / name).write_bytes(show(name))
    spec = importlib.util.spec_from_file_location(f"renderer_at_{ref}", folder / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.TemplateRenderer(processes=2)  # as the interactive renderer


async def run_burst(bursts: int, against: str | None, contend: int) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(build_tiny_model(CACHE / "tiny-f32", preset="tiny"))
    template = ChatTemplate.of(tokenizer)
    messages = CHATS["1 message"]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    async def in_process() -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    async def two_turns() -> None:
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    def bounded(which):
        async def on_loop() -> str:
            return await which.arender(template, messages, add_generation_prompt=True)
        return on_loop

    sides = {"in-process, unbounded": in_process, "two loop turns (a free off-loop render)": two_turns}
    if against is not None:
        sides[f"bounded arender at {against}"] = bounded(renderer_at(against))
    sides["bounded arender (this tree)"] = bounded(renderer(Lane.INTERACTIVE))
    for label, render in sides.items():
        if label.startswith("bounded"):
            assert await render() == expected
            for _ in range(2):
                await one_burst(render, spread_ms=0, busy_ms=0)  # warm
    await _burst_table(sides, bursts, contend)


async def _burst_table(sides: dict, bursts: int, contend: int) -> None:
    print(f"\na burst of {BURST} renders awaited on the event loop, {bursts} bursts per row, the rows' bursts "
          "interleaved (ms per render; span: first call to last text, median)"
          + (f"; {contend} processes spinning on the CPU meanwhile" if contend else ""))
    print(f"{'loop / path':90} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7} {'span':>7}")
    for name, (spread, busy) in LOOPS.items():
        latencies: dict[str, list[float]] = {label: [] for label in sides}
        spans: dict[str, list[float]] = {label: [] for label in sides}
        labels = list(sides)
        for b in range(bursts):
            for label in labels[b % len(labels):] + labels[:b % len(labels)]:  # a rotating order
                lat, span = await one_burst(sides[label], spread_ms=spread, busy_ms=busy)
                latencies[label] += lat
                spans[label].append(span)
        for label in sides:
            lat = latencies[label]
            print(f"{name + ': ' + label:90} {_pct(lat, 0.5):7.2f} {_pct(lat, 0.9):7.2f} {_pct(lat, 0.99):7.2f} "
                  f"{max(lat):7.2f} {statistics.median(spans[label]):7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--bursts", type=int, default=20)
    parser.add_argument("--only", choices=("all", "serial", "burst"), default="all")
    parser.add_argument("--against", metavar="REF", help="also the renderer at this git ref, interleaved")
    parser.add_argument("--contend", type=int, default=0, metavar="N",
                        help="N processes spinning on the CPU during the bursts (as MLX's compute and a client take "
                             "the cores in a real burst)")
    args = parser.parse_args()
    if args.only in ("all", "serial"):
        asyncio.run(run(args.n))
    if args.only in ("all", "burst"):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.contend)]
        try:
            asyncio.run(run_burst(args.bursts, args.against, args.contend))
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()


if __name__ == "__main__":
    main()
