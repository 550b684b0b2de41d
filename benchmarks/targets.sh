#!/usr/bin/env bash
# The target workloads of docs/performance.md on one CUDA GPU, each one `batchgen bench` (or
# `batchgen run`) command; the last lines of each report are printed, the whole reports are
# kept as JSON under $RESULTS (default ./bench-results).
#
#   bash benchmarks/targets.sh prefix       W3 and W4, prefix caching on vs off (or one: w3, w4)
#   bash benchmarks/targets.sh w1           W1 bf16 (caching on vs off) and W1 FP8 (or one:
#                                           w1bf16, w1fp8)
#   bash benchmarks/targets.sh startup      SmolLM2-135M shape through `batchgen run`: seconds
#                                           to the first result line (needs MODEL=folder)
#   bash benchmarks/targets.sh embeddings   Qwen3-Embedding-0.6B shape vs transformers
#   bash benchmarks/targets.sh all
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-bench-results}
mkdir -p "$RESULTS"
BG=${BATCHGEN:-python3 -m batchgen}
W1="--shape llama3-8b --requests 1024 --input-len 1000 --output-len 1000"

bench() {  # name, then bench flags
  local name=$1; shift
  echo "=== $name: batchgen bench $*"
  $BG bench "$@" --json "$RESULTS/$name.json" 2>"$RESULTS/$name.log" | tail -n 12
  tail -n 3 "$RESULTS/$name.log" | grep -i "error\|traceback" || true
}

w3() {
  bench w3 --shape llama3-8b --requests 1024 --input-len 2200 --shared-prefix-len 2000 \
    --num-prefixes 4 --output-len 500 --max-decode-batch 512 --cuda-graph-num-buckets 12 \
    --compare-prefix-caching
}

w4() {
  bench w4 --shape llama3-8b --requests 128 --input-len 1000 --n 8 --output-len 500 \
    --max-decode-batch 384 --cuda-graph-num-buckets 12 --compare-prefix-caching
}

w1bf16() {
  bench w1-bf16 $W1 --max-decode-batch 384 --cuda-graph-num-buckets 12 --compare-prefix-caching
}

w1fp8() {
  bench w1-fp8 $W1 --max-decode-batch 512 --cuda-graph-num-buckets 6 --fp8-weights \
    --fp8-scales tensor --kv-dtype fp8
}

startup() {
  echo "=== startup: batchgen run, ${MODEL:?set MODEL to a model folder}"
  python3 benchmarks/embedded_run.py --requests 256 --max-tokens 128 --keep "$RESULTS/run" \
    -- --model "$MODEL" 2>&1 | tail -n 6
}

embeddings() {
  bench embeddings --mode embeddings --shape qwen3-embedding-0.6b --requests 1024 \
    --input-len 512
}

case "${1:-all}" in
  prefix) w3; w4 ;;
  w3) w3 ;;
  w4) w4 ;;
  w1) w1bf16; w1fp8 ;;
  w1bf16) w1bf16 ;;
  w1fp8) w1fp8 ;;
  startup) startup ;;
  embeddings) embeddings ;;
  all) w3; w4; w1bf16; w1fp8; startup; embeddings ;;
  *) echo "usage: $0 prefix|w3|w4|w1|w1bf16|w1fp8|startup|embeddings|all" >&2; exit 2 ;;
esac
