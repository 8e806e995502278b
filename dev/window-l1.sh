#!/usr/bin/env bash
# Device window L1 (written 2026-12-06 without a device; for the next session). The named checks
# of issues 26, 28 and 29 that only a device run is missing, in the order of what closes most:
#   1. issue 28: the union tests as fixed after window K1 (each token's reference once per
#      threshold), compute-sanitizer racecheck on the union kernels, the long-prompt runner test
#      (its slide case had too few positions) -- window K2, which never got a machine;
#   2. issue 26: memcheck and racecheck on the IE-BME product kernel and the column-major 4-bit
#      kernel (never sanitized), and the decode runner against the CPU on int4 packs of the cut
#      default model (models_from_env_match_cpu takes low-bit packs since 2026-12-06): greedy
#      tokens compared on the dp 0 pack, logits within the CPU's own threshold sensitivity on
#      the dp 0.3 one (with TEAL, greedy paths may rightly part);
#   3. issue 29: cuSPARSELt called directly (dev/cusparselt/direct.py, planned once per product)
#      and the slide f16-copy crossover that sets slide::DECODE_MIN_TOKENS.
# Carry: a slim .gpu, `KEEP="kernels runner slide ie_bme lowbit_cols" bash
# scripts/gpu-runner-bundle.sh` (bin/sieve and those test executables: 28 MB, 38 MB with the tree). The cut model does not fit beside it (40 MB):
# `bash dev/window-l1.sh model` in a first call carrying only .gpu-model/ (scripts/cut-gguf.py
# ... --layers 4 into .gpu-model/smol-cut4.gguf) copies it to /tmp, then, back to back on the
# warm machine, `bash dev/window-l1.sh` carrying .gpu. Everything is also in $OUT/window.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT" /tmp/sieve-cut
if [ "${1:-}" = model ]; then
  cp .gpu-model/*.gguf /tmp/sieve-cut/ && ls -la /tmp/sieve-cut
  exit 0
fi
exec > >(tee "$OUT/window.log") 2>&1
start=$(date +%s)
at() { echo "--- $1 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
source scripts/gpu-quick.sh
S=.gpu/bin/sieve
# Absolute path of a staged test executable (resolved here, before any cd).
exe() { echo "$PWD/.gpu/tests/$(cut -f1 .gpu/tests.tsv | grep -m1 "^$1-")"; }
sanitize() {  # sanitize TOOL TEST-EXE-NAME SECONDS FILTER
  local bin; bin=$(exe "$2")
  (cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout "$3" compute-sanitizer --tool "$1" \
    "$bin" "$4" --test-threads 1 > "$OUT/san-$1-$2.log" 2>&1; echo "$1 $2 $4: exit $?")
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" "$OUT/san-$1-$2.log" | head -3
}
at "issue 28"
run_t kernels 120 union_matches
run_t runner 150 long_prompts_of_low_bit_models_match_cpu --test-threads 1
sanitize racecheck kernels 150 union_matches
at "issue 26"
# Every IE-BME test (the product kernel, its TEAL chunks and accumulation, strided rows, the
# f16 copy) shrinks to small shapes under SIEVE_SANITIZE_SMALL.
sanitize memcheck ie_bme 150 gpu_ie_bme
sanitize racecheck ie_bme 180 gpu_ie_bme
sanitize memcheck lowbit_cols 90 ""
sanitize racecheck lowbit_cols 120 ""
if ls /tmp/sieve-cut/*.gguf > /dev/null 2>&1; then
  cut=$(ls /tmp/sieve-cut/*.gguf | head -1)
  models=""
  for dp in 0 0.3; do
    p="/tmp/sieve-cut/cut-int4-sp0.5-dp$dp.sieve"
    $S pack --model "$cut" --out "$p" --method sparsegpt --sp 0.5 --dp "$dp" --format dense --values int4:128 \
      --calib-samples 4 --calib-len 256 > "$OUT/pack-dp$dp.log" 2>&1 && models="$models:$p" || tail -3 "$OUT/pack-dp$dp.log"
  done
  runner=$(exe runner)
  if [ -z "$models" ]; then
    echo "packs: FAILED, no pack was written"
  else
    (cd crates/sieve-gpu && SIEVE_REQUIRE_GPU=1 SIEVE_GPU_CHECK_MODELS="$models" timeout 200 "$runner" \
      models_from_env_match_cpu --nocapture > "$OUT/packs.log" 2>&1; echo "packs: exit $?")
  fi
  grep -E "kernels|logit error|against itself|panicked|test result" "$OUT/packs.log" | cut -c1-200 | head -12
else
  echo "no cut model in /tmp/sieve-cut: run 'bash dev/window-l1.sh model' first (carry .gpu-model)"
fi
at "issue 29"
timeout 90 $S bench gemm --shapes llama2-7b --precision f16,slide-f16,slide-f16-copy --pattern 6:8 --n 32,128,256,512,2048 --reps 20 2>&1 | grep -E "^\|" | cut -c1-120
# The column-format SpMM on issue 29's other shapes (only the 7B's were ever measured).
timeout 90 $S bench gemm --shapes llama2-13b,llama3-8b --precision f16,tcbc-spmm --n 16,32,64 --sp 0.5 --reps 20 2>&1 | grep -E "^\|" | cut -c1-120
timeout 200 python3 dev/cusparselt/direct.py --shapes 7b --n 8,128,512,4096,8192 --json "$OUT/direct-7b.json" > "$OUT/direct-7b.md" 2>&1; echo "direct.py: exit $?"
tail -40 "$OUT/direct-7b.md"
at end
