#!/usr/bin/env bash
# Device window H4 (any warm machine; nothing to carry but the tree): issue 29's baselines that
# PyTorch reaches with NVIDIA's libraries on this GPU, dense against cuSPARSELt 2:4 in f16,
# INT8 and FP8 e4m3 at N = 8 .. 8192 on the 7B projections (dev/cusparselt/bench.py), for
# sieve's slide rows (`sieve bench gemm --precision f16,slide-f16 --pattern 2:4,6:8`) to be
# read against.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 400 python3 dev/cusparselt/bench.py --shapes 7b --n 8,32,128,512,2048,4096,8192 --json "$OUT/cusparselt-7b.json" 2>&1 | tee "$OUT/cusparselt-7b.md" | tail -90
