"""Where a decode step's time goes on the host: the engine's decode batch stepped alone, per step.

For batch sizes 1 and 32 (distinct random 128-token prompts, greedy, no stop tokens), after 30
steps to the steady state, the median over 80 steps of:

* ``step``: one `EngineBatchGenerator.next()` (pipelined: the next step is scheduled before this
  one's tokens are read);
* ``async_eval call``: the host time inside `mx.async_eval` (on MLX's CUDA backend: recording and
  launching the step's kernels; when it is most of ``step``, the host is the critical path);
* ``serial step``: `next()` between two `mx.synchronize()` calls (no overlap at all);

and first, one 2,048-token prefill pass: its time and the peak memory above the weights. Run it
once per MLX setting to compare them (e.g. `MLX_USE_CUDA_GRAPHS=0`, `MLX_MAX_OPS_PER_BUFFER`): MLX
reads them when the process first uses the device.

    python benchmarks/step_probe.py MODEL_DIR [LABEL]
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from provider.engine.decode import EngineBatchGenerator


def main() -> None:
    path, label = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "default")
    model, tok = mlx_lm.load(path)
    mx.eval(model.parameters())
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    started = time.perf_counter()
    cache = make_prompt_cache(model)
    y = model(mx.array([[5] * 2048]), cache=cache)
    mx.eval(y, [c.state for c in cache])
    print(f"{label} prefill 2048: {1000 * (time.perf_counter() - started):.1f} ms, "
          f"peak above weights {(mx.get_peak_memory() - base) / 2**30:.2f} GiB", flush=True)
    del cache, y
    for batch in (1, 32):
        gen = EngineBatchGenerator(model, stop_tokens=None, completion_batch_size=batch,
                                   prefill_batch_size=min(8, batch))
        vocab = min(30000, len(tok))
        gen.insert([[random.randrange(100, vocab) for _ in range(128)] for _ in range(batch)], max_tokens=[400] * batch)
        for _ in range(30):
            gen.next()
        steps, calls = [], []
        real = mx.async_eval

        def timed(*arrays):
            t = time.perf_counter()
            real(*arrays)
            calls.append(time.perf_counter() - t)

        mx.async_eval = timed  # the decode batch calls it through the module
        try:
            for _ in range(80):
                t = time.perf_counter()
                gen.next()
                steps.append(time.perf_counter() - t)
        finally:
            mx.async_eval = real
        serial = []
        for _ in range(30):
            mx.synchronize()
            t = time.perf_counter()
            gen.next()
            mx.synchronize()
            serial.append(time.perf_counter() - t)
        ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
        print(f"{label} B={batch}: step {ms(steps):.2f} ms, async_eval call {ms(calls):.2f} ms, "
              f"serial step {ms(serial):.2f} ms", flush=True)
        del gen


if __name__ == "__main__":
    main()
