#!/usr/bin/env bash
# Device window K2 (2026-12-06; carry a slim .gpu: bin/sieve and the kernels, runner, slide and
# lowbit_cols test executables of scripts/gpu-runner-bundle.sh). Window K1's three loose ends:
# the Balanced-CBC union test ran past its limit (its f64 references were recomputed for every
# token count), the long-prompt runner test's slide case overflowed its tiny config's 256
# positions, and racecheck on the unions timed out; then K1's lost slide crossover and the
# column-major 4-bit kernel's test. Everything goes to $OUT/window.log as well.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT"
exec > >(tee "$OUT/window.log") 2>&1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
source scripts/gpu-quick.sh
S=.gpu/bin/sieve
run_t kernels 120 union_matches
run_t runner 150 long_prompts_of_low_bit_models_match_cpu --test-threads 1
k=.gpu/tests/$(cut -f1 .gpu/tests.tsv | grep -m1 '^kernels-')
echo "racecheck from $(( $(date +%s) - start )) s"
(cd crates/sieve-cuda && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout 150 compute-sanitizer --tool racecheck "$OLDPWD/$k" union_matches --test-threads 1 > "$OUT/racecheck.log" 2>&1; echo "racecheck exit $?")
grep -E "RACECHECK SUMMARY|ERROR SUMMARY|^test |test result" "$OUT/racecheck.log" | head -6
echo "crossover from $(( $(date +%s) - start )) s"
timeout 90 $S bench gemm --shapes llama2-7b --precision f16,slide-f16,slide-f16-copy --pattern 6:8 --n 32,128,256,512,2048 --reps 20 2>&1 | grep -E "^\|" | cut -c1-120
run_t lowbit_cols 90
echo "end at $(( $(date +%s) - start )) s"
