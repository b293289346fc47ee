#!/usr/bin/env bash
# Llama-3.1-8B-Instruct with the published EAGLE-3 head on one NVIDIA GPU (80 GB), bfloat16, after
# `pip install -e '.[cuda13]'` (or `.[cuda]` for CUDA 12) and `huggingface-cli login` (the Llama weights are gated).
#
# Usage: decode/speculate_gpu.sh [generate|serve]
set -euo pipefail
TARGET=meta-llama/Llama-3.1-8B-Instruct
HEAD=eagle3:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
case "${1:-generate}" in
  generate)  # one prompt, an EAGLE-2-style tree, plain decoding of the same prompt after it for the speedup
    specjax-generate --model "$TARGET" --drafter "$HEAD" --tree 5,8,32 --compare-ar --max-new-tokens 256 \
      --prompt "Write a Python function that merges two sorted lists, with tests." ;;
  serve)  # an OpenAI-compatible server with 8 slots that refill
    specjax-serve --model "$TARGET" --drafter "$HEAD" --num-draft-tokens auto --batch-size 8 --max-context 4096 \
      --host 127.0.0.1 --port 8000 ;;
  *) echo "usage: $0 [generate|serve]" >&2; exit 2 ;;
esac
