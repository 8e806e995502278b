#!/usr/bin/env bash
# Device window I1 (written 2026-12-06 without a device; the tree, then .gpu for its second part):
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
# `window-i1.sh kernels` runs only the second part (two device calls of under 10 minutes each).
part=${1:-all}
[ "$part" = kernels ] || timeout 280 python3 dev/cusparselt/direct.py --shapes 7b --n 8,128,512,2048,4096,8192 --json "$OUT/direct-7b.json" 2>&1 | tee "$OUT/direct-7b.md" | tail -80
[ "$part" = kernels ] || timeout 200 python3 dev/cusparselt/bench.py --shapes 7b --n 512,4096,8192 --precision int8 --json "$OUT/torch-int8-7b.json" 2>&1 | tail -15
# Then (carry .gpu from `scripts/gpu-runner-bundle.sh`, same warm machine): the SlideSparse
# prompt path's f16 copy past 256 tokens (built 2026-12-06 without a device). Its kernel test
# against the format's decode and the long-prompt runner test, then the 7B 6:8 prompt of 2,048
# tokens through the copy (default) against mma.sp throughout (SIEVE_LOWBIT_PREFILL=kernel),
# and dense f16 beside them; first `bench gemm` of both paths at 32..2,048 tokens, which sets
# `slide::DECODE_MIN_TOKENS` (256 is an estimate).
if [ -x .gpu/bin/sieve ] && [ "$part" != library ]; then
  source scripts/gpu-quick.sh
  # The column-major 4-bit kernel after its variants' removal (not run on a GPU since).
  run_t lowbit_cols 90
  run_t slide 120 --test-threads 1
  run_t runner 200 long_prompts_of_low_bit_models_match_cpu tiny_slide_models_match_cpu --test-threads 1
  S=.gpu/bin/sieve
  timeout 150 $S bench gemm --shapes llama2-7b --precision f16,slide-f16,slide-f16-copy --pattern 6:8,2:4 --n 32,64,128,256,512,2048 --reps 20 2>&1 | grep -E "slide" | cut -c1-110
  for cfg in "--sp 0 --dp 0" "--format slide --pattern 6:8 --sp 0.25 --dp 0"; do
    for mode in copy kernel; do
      [ "$mode" = kernel ] && [ "$cfg" = "--sp 0 --dp 0" ] && continue
      ( [ "$mode" = kernel ] && export SIEVE_LOWBIT_PREFILL=kernel
        timeout 120 $S bench decode --synthetic llama2-7b $cfg --prompt 2048 --tokens 16 2>&1 | grep -E "TPOT" | cut -c1-170 | sed "s/^/$mode: /" )
    done
  done
fi
