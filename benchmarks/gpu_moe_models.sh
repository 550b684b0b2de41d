#!/usr/bin/env bash
# GPU runs for the MoE shapes, from the repo root on one H200 (~15 min), with the README's
# install and its test extras (`bash scripts/install.sh test`, then `source .venv/bin/activate`;
# on a GPU machine install a CUDA build of torch first):
#   1. the MLA kernels' CUDA tests (kernel vs float64 reference, model wiring, DeepSeek on CUDA
#      vs CPU float32) and their timing against the PyTorch path (+ a launch-config sweep);
#   2. `batchgen bench` on deepseek-v3-4l (37 B, 69 GiB bf16): batch 64 512in/128out with the
#      HF peer, batch 256, 30 % of the routed experts offloaded, FP8 block weights, fp8 KV;
#   3. gpt-oss-20b: MXFP4 experts dequantized on the fly (+ HF peer) vs --pre-dequantize-weights.
# Each bench run is one process (one model in memory) capped at 170 s; the table at the end
# reads their JSON reports from $OUT.
set -u
OUT=${OUT:-/tmp/moe_bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv

echo "== MLA kernels on CUDA (tests)"
timeout 400 python3 -m pytest -q -x -p no:cacheprovider -k cuda \
    tests/kernels/test_kernel_mla_decode.py tests/kernels/test_kernel_mla_kv_store.py \
    tests/test_deepseek.py 2>&1 | tail -6
echo "== MLA decode kernel timing (bf16 and fp8 cache; --sweep: launch configurations)"
timeout 240 python3 benchmarks/mla_decode_bench.py --sweep 2>&1 | tail -60

bench() {  # bench NAME FLAGS...: one run, its table, its JSON report in $OUT/NAME.json
    local name=$1
    shift
    echo "== $name: batchgen bench $*"
    timeout 170 python3 -m batchgen.cli bench "$@" --json "$OUT/$name.json" 2>&1 \
        | grep -v -i warn | tail -6
}

DS="--shape deepseek-v3-4l --input-len 512 --output-len 128 --gpu-kv-cache-size 8 --host-kv-cache-size 4"
bench ds_b64_hf $DS --requests 64 --max-decode-batch 64 --peer hf --peer-batch 64
bench ds_b256 $DS --requests 256 --max-decode-batch 256
bench ds_b64_offload30 $DS --requests 64 --max-decode-batch 64 \
    --enable-ep-with-offloading --ep-offloading-ratio 0.3
bench ds_b64_fp8w $DS --requests 64 --max-decode-batch 64 --fp8-weights
bench ds_b64_kv8 $DS --requests 64 --max-decode-batch 64 --kv-dtype fp8

GO="--shape gpt-oss-20b --input-len 512 --output-len 128 --requests 64 --max-decode-batch 64 --gpu-kv-cache-size 16 --host-kv-cache-size 4"
bench oss_mxfp4_hf $GO --peer hf --peer-batch 64
bench oss_predequant $GO --pre-dequantize-weights

echo "== summary"
python3 - "$OUT" <<'PY'
import json, pathlib, sys

print(f"{'run':<18}{'params':>8}{'GiB dev':>9}{'ours tok/s':>12}{'HF tok/s':>10}{'ratio':>7}"
      f"{'roofline':>10}{'seconds':>9}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    w, res = r["weights"], r["results"]
    ours, hf = res["batchgen"], res.get("hf_generate")
    print(f"{path.stem:<18}{w['params'] / 1e9:>7.1f}B{w['device_bytes'] / 2**30:>9.1f}"
          f"{ours['output_tok_s']:>12,.0f}{hf['output_tok_s'] if hf else 0:>10,.0f}"
          f"{res.get('ratio', 0):>7.2f}{ours['roofline_fraction']:>10.0%}{ours['seconds']:>9.1f}")
PY
