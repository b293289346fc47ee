#!/usr/bin/env bash
# specjax on one accelerator, offline, in under 8 minutes on a GPU: specjax-bench on the embedded SmolLM2-135M with
# its shipped drafts (bfloat16 on accelerators), modes ar, ngram, eagle3-chain (5 and 2), eagle3-tree and dflash:8
# at batch 1 and 8 (the breakdown's drafter ms: DFlash K = 8 against EAGLE-3 K = 2);
# then a random Llama-3-8B-shaped target (decode/device_bench.py): one-step latency, verification cost by tokens,
# autoregressive tokens/s against the bandwidth roofline, on one device and split over every device present; the
# embedded model's EAGLE-3 tree decoding on a mesh of every device (greedy output checked against plain decoding);
# and a short EAGLE-3 training run (configs/smoke.yaml) on the same devices. JSON and Markdown tables go to OUT
# (default device_bench_out). SHRINK=1 shrinks the 8B-shaped target so that the script also runs on a CPU.
#
# Usage: decode/device_bench.sh [OUT]      (PYTHON=path/to/python to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-device_bench_out}
PYTHON=${PYTHON:-python}
TINY=""
if [[ "${SHRINK:-0}" == 1 ]]; then TINY=--tiny; fi
mkdir -p "$OUT"

bench() {  # bench BATCH PROMPTS
  "$PYTHON" -m specjax.cli.bench --model smollm2-135m --modes ar,ngram,eagle3-chain,eagle3-chain:2,eagle3-tree,dflash:8 \
    --eagle3 smollm2-135m --dflash smollm2-135m --batch-size "$1" --num-prompts "$2" --max-new-tokens 128 \
    --out-dir "$OUT/smollm2-b$1"
}
bench 1 6
bench 8 16
"$PYTHON" decode/device_bench.py --out-dir "$OUT/llama3-8b" $TINY
DEVICES=$("$PYTHON" -c "import jax; print(jax.device_count())")
if (( DEVICES > 1 )); then
  "$PYTHON" decode/device_bench.py --out-dir "$OUT/llama3-8b-mesh" --mesh auto $TINY
fi
PROMPTS=()
for i in 1 2 3 4 5 6 7 8; do PROMPTS+=(--prompt "Write a Python function number $i of a small library for dates."); done
"$PYTHON" -m specjax.cli.generate --mesh auto --drafter eagle3:smollm2-135m --tree 5,3,10 --compare-ar \
  --batch-size 8 --max-new-tokens 64 "${PROMPTS[@]}" --json "$OUT/generate-mesh.json" > /dev/null
"$PYTHON" -m specjax.cli.train --config configs/smoke.yaml output_dir="$OUT/train" \
  training.batch_size=$((2 * DEVICES)) training.steps=8 checkpoint.every=8 logging.every=1
echo "wrote $OUT/smollm2-b1, $OUT/smollm2-b8, $OUT/llama3-8b, $OUT/llama3-8b-mesh, $OUT/generate-mesh.json, $OUT/train" >&2
