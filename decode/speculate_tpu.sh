#!/usr/bin/env bash
# Llama-3.1-8B-Instruct with the published EAGLE-3 head on a Cloud TPU VM (v5e-8 or v6e-8), bfloat16, the model split
# over every chip, after `pip install -e '.[tpu]'` and `huggingface-cli login` (the Llama weights are gated).
# The Pallas attention kernel is checked against the pure-JAX block loop on its first use and falls back to the loop
# with one warning if it fails to compile or disagrees; pass ATTENTION=blocks to skip it, ATTENTION=pallas to insist.
#
# Usage: decode/speculate_tpu.sh [generate|serve]
set -euo pipefail
TARGET=meta-llama/Llama-3.1-8B-Instruct
HEAD=eagle3:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
ATTENTION=${ATTENTION:-auto}
PROMPTS=()
for i in 1 2 3 4 5 6 7 8; do PROMPTS+=(--prompt "Write a Python function number $i of a small library for dates."); done
case "${1:-generate}" in
  generate)  # 8 prompts as one batch, heads and KV heads over the chips
    specjax-generate --model "$TARGET" --drafter "$HEAD" --tree 5,8,32 --mesh auto --attention "$ATTENTION" \
      --batch-size 8 --compare-ar --max-new-tokens 256 "${PROMPTS[@]}" ;;
  serve)
    specjax-serve --model "$TARGET" --drafter "$HEAD" --num-draft-tokens auto --mesh auto --attention "$ATTENTION" \
      --batch-size 8 --max-context 4096 --host 127.0.0.1 --port 8000 ;;
  *) echo "usage: $0 [generate|serve]" >&2; exit 2 ;;
esac
