#!/usr/bin/env bash
# Issue 5's figures in one run, one system at a time, each script's JSON kept under OUT:
#   machine peaks (bench_kernels --only probe), fantai and HF transformers at bf16 and f32
#   (bench_offline.py; fantai's bf16 again with matmul_precision=bfloat16), fantai (both matmul
#   precisions) vs llama.cpp on the Q4_1 GGUF and its bf16 copy with start-up and roofline tables
#   (compare_llamacpp.py), and the engine's per-step overhead at batch 64.
# Usage: bench/run_issue5.sh [OUT_DIR (default out/issue5_<UTC time>)] [LLAMA_CPP_PYTHON]
#   LLAMA_CPP_PYTHON: a venv's python with llama-cpp-python (default /tmp/lcpp-venv/bin/python;
#   the llama.cpp rows are skipped when it is missing). Takes ~35 min on 2 cores; run it on a quiet
#   machine (check `uptime` first: other tenants' load makes two-thread figures meaningless).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/issue5_$(date -u +%Y-%m-%dT%H%MZ)}  # out/ is git-ignored: run output stays out of the tree
lcpp=${2:-/tmp/lcpp-venv/bin/python}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
log() { echo "[run_issue5 $(date -u +%H:%M:%S)] $* (loadavg $(cut -d' ' -f1-3 /proc/loadavg))" >&2; }

if [ -x build/wheel/bench/bench_kernels ]; then
  log "probe"
  build/wheel/bench/bench_kernels --only probe --threads 2 | tee "$out/probe.txt"
fi
log "bench_offline: fantai and HF transformers, bf16 and f32 weights (the GGUF dequantized by both)"
"$py" bench/bench_offline.py --dequantize --json "$out/offline.json" | tee "$out/offline.md"
log "bench_offline: fantai, bf16 weights with bf16 matmuls (activations rounded on AMX)"
"$py" bench/bench_offline.py --dequantize --dtype bfloat16 --skip-hf --matmul-precision bfloat16 \
  --json "$out/offline_bf16_matmuls.json" | tee "$out/offline_bf16_matmuls.md"
lc=()
[ -x "$lcpp" ] && lc=(--llama-cpp-python "$lcpp")
log "compare_llamacpp: Q4_1 GGUF and its bf16 copy"
"$py" bench/compare_llamacpp.py "${lc[@]}" --json "$out/compare_llamacpp.json" | tee "$out/compare_llamacpp.md"
log "bench_overhead: batch 64"
"$py" bench/bench_overhead.py --dtype bfloat16 --json "$out/overhead.json" | tee "$out/overhead.md"
log "done: $out"
