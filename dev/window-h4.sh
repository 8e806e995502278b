#!/usr/bin/env bash
# Device window H4 (after H1 on the same warm machine, .gpu there; or carry .gpu): issue 29's
# prompt-sized products. sieve's SlideSparse 2:4 and 6:8 f16 kernels against cuBLAS f16 at
# N = 8 .. 8192 (`bench gemm` takes N up to 16384 for these rows since 2026-12-06, each product
# checked on a spread of its rows first), then what PyTorch reaches on this GPU with NVIDIA's
# libraries, dense against cuSPARSELt 2:4 in f16, INT8 and FP8 e4m3 (dev/cusparselt/bench.py),
# in the same call.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 .gpu/bin/sieve bench gemm --shapes llama2-7b --precision f16,slide-f16 --pattern 2:4,6:8 \
  --n 8,32,128,512,2048,4096,8192 --reps 20 --json "$OUT/gemm-slide-7b.json" > "$OUT/gemm-slide-7b.txt" 2>&1
echo "bench gemm exit $?"; grep -E "slide-f16|^f16" "$OUT/gemm-slide-7b.txt" | cut -c1-150 | tail -70
timeout 280 python3 dev/cusparselt/bench.py --shapes 7b --n 8,32,128,512,2048,4096,8192 --json "$OUT/cusparselt-7b.json" 2>&1 | tee "$OUT/cusparselt-7b.md" | tail -90
