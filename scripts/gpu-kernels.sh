#!/usr/bin/env bash
# GPU-machine driver for the sieve-cuda kernels. Build here first (`../shared/tools/gpu-bundle`
# from the repo root), then run on the GPU machine from the repo root, carrying .gpu:
#
#   scripts/gpu-kernels.sh tests            # sieve-cuda unit + kernel tests, GPU required
#   scripts/gpu-kernels.sh sanitize         # kernel tests under compute-sanitizer memcheck + racecheck
#   scripts/gpu-kernels.sh bench [ARGS...]  # sieve bench kernels ARGS (json/svg into $OUT)
#
# Several phases can be chained: scripts/gpu-kernels.sh tests bench --shapes llama2-7b
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# Bundle made by gpu-bundle (.gpu, with bin/sieve) or scripts/gpu-cuda-bundle.sh (.gpu-cuda).
BUNDLE=${BUNDLE:-.gpu}
case "$BUNDLE" in /*) ;; *) BUNDLE="$root/$BUNDLE" ;; esac
if [ -x "$BUNDLE/bin/sieve" ]; then BENCH=("$BUNDLE/bin/sieve" bench); else BENCH=("$BUNDLE/bin/bench_kernels"); fi
OUT=${OUT:-/tmp/sieve-out}
mkdir -p "$OUT"
export SIEVE_REQUIRE_GPU=1 SIEVE_HOME=${SIEVE_HOME:-/tmp/sieve-home} RUST_BACKTRACE=1
# CUDA libraries (driver, NVRTC, cuBLAS) are loaded at run time; make the toolkit's visible.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || true

test_exes() {
  while IFS=$'\t' read -r exe dir; do
    case "$dir" in */crates/sieve-cuda) echo "$BUNDLE/tests/$exe"$'\t'"$dir" ;; esac
  done < "$BUNDLE/tests.tsv"
}

status=0
while [ $# -gt 0 ]; do
  phase=$1; shift
  case "$phase" in
    tests)
      while IFS=$'\t' read -r t dir; do
        echo "== $(basename "$t")"
        (cd "$dir" && "$t" --test-threads=1 2>&1) | tee -a "$OUT/tests.log" | grep -E "^test |test result|panicked|error" || true
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      done < <(test_exes)
      ;;
    sanitize)
      for tool in memcheck racecheck; do
        while IFS=$'\t' read -r t dir; do
          case "$(basename "$t")" in kernels-*) ;; *) continue ;; esac
          echo "== compute-sanitizer --tool $tool $(basename "$t")"
          (cd "$dir" && SIEVE_SANITIZE_SMALL=1 compute-sanitizer --tool "$tool" --error-exitcode 9 "$t" --test-threads=1 2>&1) > "$OUT/sanitize-$tool.log"
          rc=$?
          grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" "$OUT/sanitize-$tool.log" | tail -3
          echo "exit $rc"
          [ $rc = 0 ] || status=1
        done < <(test_exes)
      done
      ;;
    bench)
      "${BENCH[@]}" kernels --json "$OUT/bench.json" --plot "$OUT/bench.svg" "$@" 2> "$OUT/bench.log" | tee "$OUT/bench.md"
      rc=${PIPESTATUS[0]}
      [ $rc = 0 ] || { status=1; tail -20 "$OUT/bench.log"; }
      shift $#
      ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
exit $status
