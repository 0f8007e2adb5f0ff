"""Text decode rate while a vision request is prefilled, against the same text request alone.

One engine holds the ~50 MB text model and a ~50 MB Gemma-3 style VLM (224² images, 256 soft
tokens each, built offline by `provider.tinyvlm`). A greedy text request decodes (EOS off); after
a steady stretch a vision request with --images images arrives (2 × 256 soft tokens + text ≈ 560 prompt tokens
by default). Measured from the engine's step trace, in the same run:

* ``text alone``: text tokens per second over the 3 s of decoding just before the vision request
  and the 3 s just after its first token (both sides, so a change in machine load cancels out);
* ``text during vision prefill``: text tokens per second from the vision request's first step
  (template + processor) to its first sampled token (vision encoder + prefill chunks);
* ``vision prefill alone`` / ``beside text``: that window's length with no text running, and with.

Each repeat runs both back to back; the table shows medians and the median of per-repeat ratios.
The text rate should stay within 20 % (ratio ≥ 0.80): pre-token vision work is held to a
1/8 share of the worker while text decodes (provider/engine/vision.py, `DutyCycle`).

The price is the vision request's time to first token beside busy text (up to about 8× its time
alone); with no text running it runs flat out.

    python benchmarks/vision_bench.py [--repeats 3] [--images 2] [--prefill-step 256]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from PIL import Image  # noqa: E402

from provider.engine import ChatRequest, Engine, Finished, SamplingParams  # noqa: E402
from provider.engine.vlm import DEFAULT_PREFILL_STEP  # noqa: E402
from provider.request.body import IMAGE_MARKER  # noqa: E402
from provider.request.media import decode_images, inspect_images  # noqa: E402
from provider.tinymodel import build_tiny_model, weights_bytes  # noqa: E402
from provider.tinyvlm import VlmShape, build_tiny_vlm  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NO_EOS = frozenset({10**9})
BENCH_VLM = VlmShape(hidden_size=512, num_hidden_layers=4, intermediate_size=1024, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=64, vocab_size=6144, max_position_embeddings=8192,
                     sliding_window=512, vision_hidden_size=256, vision_layers=4, vision_intermediate_size=512,
                     vision_heads=4, image_size=224, patch_size=14, mm_tokens_per_image=256)


class Trace:
    """(time, model, request, phase) of every engine step, recorded on the worker thread."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, str, str | None, str]] = []

    def __call__(self, model_id: str, request_id: str | None, phase: str) -> None:
        self.steps.append((time.perf_counter(), model_id, request_id, phase))

    def text_steps(self, start: float, end: float) -> int:
        return sum(1 for t, m, r, _ in self.steps if m == "text" and r is None and start <= t < end)

    def vision_window(self, rid: str) -> tuple[float, float]:
        """From the request's first step to the step that sampled its first token."""
        mine = [(t, p) for t, _, r, p in self.steps if r == rid]
        first_decode = next(i for i, (_, p) in enumerate(mine) if p == "decode")
        # the last prefill step samples the first token; the first decode step comes after it
        return mine[0][0], mine[first_decode][0]


def images(n: int) -> list:
    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.linear_gradient("L").resize((640, 480)).convert("RGB").rotate(30 * i).save(buf, format="JPEG")
        out.append("data:image/jpeg;base64," + __import__("base64").b64encode(buf.getvalue()).decode())
    return decode_images(inspect_images(out))


def vision_messages(n: int) -> list[dict]:
    return [{"role": "user", "content": ({"type": "text", "text": "describe these"},) + (IMAGE_MARKER,) * n}]


async def one_repeat(engine: Engine, trace: Trace, n_images: int, rep: int) -> dict[str, float]:
    # Vision prefill alone (no text running).
    alone = engine.submit("vlm", ChatRequest(f"va{rep}", vision_messages(n_images),
                                             SamplingParams(max_tokens=2, temperature=0), images=tuple(images(n_images))))
    await alone.collect()
    a0, a1 = trace.vision_window(f"va{rep}")
    # Text decoding, then the same vision request beside it.
    text = engine.submit("text", ChatRequest(f"t{rep}", [{"role": "user", "content": "tell me about the river"}],
                                             SamplingParams(max_tokens=3000, temperature=0)))
    first = time.perf_counter()
    seen = 0
    async for _ in text:
        seen += 1
        if seen == 1:
            first = time.perf_counter()
        if time.perf_counter() - first > 3.0:  # a steady stretch of decoding first (the baseline)
            break
    submitted = time.perf_counter()
    beside = engine.submit("vlm", ChatRequest(f"vb{rep}", vision_messages(n_images),
                                              SamplingParams(max_tokens=2, temperature=0), images=tuple(images(n_images))))
    _, done = await beside.collect()
    assert isinstance(done, Finished)
    b0, b1 = trace.vision_window(f"vb{rep}")
    async for _ in text:
        if time.perf_counter() - b1 > 3.0:  # 3 s more of text alone after the prefill
            break
    after = time.perf_counter()
    await text.aclose()
    steady = trace.text_steps(first, submitted) + trace.text_steps(b1, after)
    before = steady / ((submitted - first) + (after - b1))
    during = trace.text_steps(b0, b1) / (b1 - b0)
    return {"text_alone": before, "text_during": during, "vision_alone": a1 - a0, "vision_beside": b1 - b0,
            "prompt_tokens": done.usage.prompt_tokens}


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--prefill-step", type=int, default=DEFAULT_PREFILL_STEP)
    args = ap.parse_args(argv)

    text_path = build_tiny_model(REPO / ".cache" / "tiny-models" / "small-f32", preset="small")
    vlm_path = build_tiny_vlm(REPO / ".cache" / "tiny-models" / "bench-vlm-f32", shape=BENCH_VLM)
    trace = Trace()
    engine = Engine(vision_prefill_step=args.prefill_step, trace=trace)
    await engine.load("text", text_path, eos_token_ids=NO_EOS)
    await engine.load("vlm", vlm_path, vision=True, eos_token_ids=NO_EOS)
    blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else "reference BLAS"
    print(f"text {text_path.name}: {weights_bytes(text_path) / 1e6:.0f} MB; vlm {vlm_path.name}: "
          f"{weights_bytes(vlm_path) / 1e6:.0f} MB; {args.images} images; prefill step {args.prefill_step}; "
          f"{blas}; median of {args.repeats}")
    await one_repeat(engine, trace, 1, -1)  # warm-up: kernels, allocator caches, processor
    runs = [await one_repeat(engine, trace, args.images, rep) for rep in range(args.repeats)]
    await engine.aclose()

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    ratio = statistics.median(r["text_during"] / r["text_alone"] for r in runs)
    slow = statistics.median(r["vision_beside"] / r["vision_alone"] for r in runs)
    print()
    print(f"vision prompt: {int(med('prompt_tokens'))} tokens")
    print("| measurement                      | median    | ratio |")
    print("| -------------------------------- | --------- | ----- |")
    print(f"| text alone, tok/s                | {med('text_alone'):9.1f} | 1.000 |")
    print(f"| text during vision prefill, tok/s | {med('text_during'):8.1f} | {ratio:5.3f} |")
    print(f"| vision prefill alone, s          | {med('vision_alone'):9.3f} | 1.000 |")
    print(f"| vision prefill beside text, s    | {med('vision_beside'):9.3f} | {slow:5.2f} |")
    verdict = "OK" if ratio >= 0.80 else "TEXT SLOWED BY MORE THAN 20 %"
    print(f"text decode rate during vision prefill / alone: {ratio:.3f} ({verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
