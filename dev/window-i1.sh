#!/usr/bin/env bash
# Device window I1 (written 2026-12-06 without a device; needs nothing carried but the tree):
# issue 29's library baseline done right. Window H4 measured cuSPARSELt through PyTorch with a
# fixed ~400 us a call (torch builds the plan every call) and INT8 refused (the activations were
# handed over N-contiguous). dev/cusparselt/direct.py calls the library with ctypes, plans and
# searches once, and times cusparseLtMatmul alone, f16 / INT8 / FP8 e4m3, against torch's dense
# products of the same precision; bench.py now hands X over K-contiguous. Both in one call.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 280 python3 dev/cusparselt/direct.py --shapes 7b --n 8,128,512,2048,4096,8192 --json "$OUT/direct-7b.json" 2>&1 | tee "$OUT/direct-7b.md" | tail -80
timeout 200 python3 dev/cusparselt/bench.py --shapes 7b --n 512,4096,8192 --precision int8 --json "$OUT/torch-int8-7b.json" 2>&1 | tail -15
