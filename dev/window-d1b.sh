#!/usr/bin/env bash
# Device window D, a call between window-d1.sh and window-d2.sh (same warm machine):
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
date -u +%T
# compute-sanitizer memcheck on the batched products (issue 28: tensor-core Tiled-CBC SpMM,
# the low-bit kernels at N = 1..32, SlideSparse, IE-BME), SIEVE_SANITIZE_SMALL shapes.
for spec in "kernels tiled_cbc_spmm" "lowbit gpu_lowbit_kernels_match_reference" "slide gpu_slide_matches" "ie_bme matches"; do
  set -- $spec
  exe=$(cut -f1 .gpu/tests.tsv | grep -m1 "^$1-")
  (cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout 120 compute-sanitizer --tool memcheck "../../.gpu/tests/$exe" "$2" > "$OUT/memcheck-$1.log" 2>&1; echo "memcheck $1 $2 exit $?")
  grep -E "ERROR SUMMARY|test result" "$OUT/memcheck-$1.log" | head -3
done
date -u +%T
