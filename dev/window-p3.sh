#!/usr/bin/env bash
# Device window P3 (written 2026-12-07): how deep the persistent step's Tiled-CBC pipeline
# should be. The Tiled-CBC persistent test with 8 stage buffers, then the 7B shape at
# sp 0.5 / dp 0.5 with SIEVE_PERSISTENT_TCBC_STAGES=8 (and the graph step, same process), 6
# and 2, and the SmolLM2 shape with 8. Carry .gpu (KEEP="runner" scripts/gpu-runner-bundle.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT"
exec > >(tee "$OUT/window-p3.log") 2>&1
. dev/window-lib.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
bin="$PWD/.gpu/tests/$(cut -f1 .gpu/tests.tsv | grep -m1 '^runner-')"
(cd crates/sieve-gpu && SIEVE_PERSISTENT_TCBC_STAGES=8 SIEVE_REQUIRE_GPU=1 timeout 120 "$bin" persistent_tiled_cbc \
  --test-threads 1 --nocapture > "$OUT/t-stages8.log" 2>&1; echo "tiled-cbc test, 8 stages: exit $?")
grep -E "test result|panicked|max logit" "$OUT/t-stages8.log" | cut -c1-200
sb() {  # sb STAGES SHAPE STEPS
  if [ $(( $(date +%s) - start )) -gt "${BUDGET_S:-260}" ]; then echo "$1 $2: skipped (time)"; return; fi
  SIEVE_PERSISTENT_TCBC_STAGES=$1 timeout 100 $S bench decode --synthetic "$2" --sp 0.5 --dp 0.5 --prompt 128 \
    --tokens 128 --step "$3" --trace "$OUT/trace-$2-s$1.svg" > "$OUT/sb-$2-$1.log" 2>&1
  echo "stages $1 $2: exit $? at $(( $(date +%s) - start )) s"
  grep -E "TPOT|step \(barriers|qkv|gate.up|down |  o  " "$OUT/sb-$2-$1.log" | sed -E 's/\| eager split.*//' | cut -c1-230
}
sb 8 llama2-7b persistent,graph
sb 8 smollm2-135m persistent
sb 2 llama2-7b persistent
sb 6 llama2-7b persistent
at end
(cd "$OUT" && tar czf logs.tgz --exclude logs.tgz *.log 2>/dev/null; rm -f t-*.log sb-*.log)
