#!/bin/sh
# The CPU proxy of the GPU measurement: the server around the engine, on this machine's CPU.
# The tiny preset's decode steps take 1-2 ms here, so what `serve --local` does around its engine
# (parsing, templates, admission, the waves of prefill, delivery) shows as it does on a GPU.
# peer_bench on the tiny preset (EOS unreachable), w1 and w2 at c = 8, 32, 64, decode batch 64 on
# every side, one OpenBLAS thread (a second one only spins here, taking a core from the server),
# sides interleaved, 5 repeats, every cell warmed up; then the TTFT split of our server's log.
#
#     sh benchmarks/cpu_proxy.sh [OUT]        (OUT: a folder for the tables; default .cache/cpu-proxy)
#
# Environment: REPEATS (5), CONCURRENCY (8,32,64), WORKLOADS (w1,w2), PYTHON (.venv/bin/python).
set -eu
OUT=${1:-.cache/cpu-proxy}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
rm -rf "$OUT/work"
export OPENBLAS_NUM_THREADS=1
sh tools/with-blas.sh "$PY" benchmarks/peer_bench.py --preset tiny --no-eos \
  --workloads "${WORKLOADS:-w1,w2}" --concurrency "${CONCURRENCY:-8,32,64}" --repeats "${REPEATS:-5}" \
  --batch-size 64 --max-tokens 64 --warmup cells --ours-toml 'log_level = "info"' \
  --work-dir "$OUT/work" --json-out "$OUT/peer.json" | tee "$OUT/peer.md"
"$PY" benchmarks/ttft_split.py "$OUT/work/ours.log" --every 8 | tee "$OUT/ttft.md"
