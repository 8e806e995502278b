#!/usr/bin/env bash
# Device window P1 (written 2026-12-07): issue 27's Tiled-CBC stages in the persistent step.
#   PART=t       the runner's persistent tests (dense, and Tiled-CBC with TEAL against the graph
#                step); PART=mem memcheck of the Tiled-CBC one
#   PART=bench1  `bench decode --step persistent,graph --trace` on the 7B shape and the SmolLM2
#                shape at 0.5 / 0.5 (after PART=t only if its tests passed); PART=bench2 the 7B
#                at 0.7 / 0.7 and dense, SmolLM2 dense
#   PART=san     racecheck and synccheck of the Tiled-CBC persistent test
# Carry .gpu from `KEEP="runner" bash scripts/gpu-runner-bundle.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT"
PART=${PART:-t}
exec > >(tee "$OUT/window-p1-${PART// /-}.log") 2>&1
. dev/window-lib.sh
has() { case " $PART " in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
pbench() {  # pbench LABEL SHAPE SP DP [ARGS...]: persistent and graph, one traced persistent step
  local label=$1 shape=$2 sp=$3 dp=$4; shift 4
  # A run must come back within its limit: no new bench after BUDGET_S seconds.
  if [ $(( $(date +%s) - start )) -gt "${BUDGET_S:-420}" ]; then echo "$label: skipped (time)"; return; fi
  local left=$(( ${END_S:-560} - $(date +%s) + start )); [ $left -gt 280 ] && left=280
  timeout $left $S bench decode --synthetic "$shape" --sp "$sp" --dp "$dp" --prompt 128 --tokens 256 \
    --step persistent,graph --trace "$OUT/trace-$label.svg" "$@" > "$OUT/pb-$label.log" 2>&1
  echo "$label: exit $?"
  grep -vE "^\s*$|^(loaded|upload)" "$OUT/pb-$label.log" | sed -E 's/\| eager split.*//' | cut -c1-300 | tail -22
}
tests_ok=1
if has t; then
  at tests
  t runner 240 persistent sieve-gpu
  grep -q "test result: ok" "$OUT/t-runner-persistent.log" || tests_ok=0
fi
if has mem; then
  at memcheck
  sanitize memcheck runner 240 persistent_tiled_cbc sieve-gpu
fi
if [ "$tests_ok" = 1 ] && has bench1; then
  at bench1
  pbench 7b-0.5 llama2-7b 0.5 0.5
  pbench smol-0.5 smollm2-135m 0.5 0.5
fi
if has bench2; then
  at bench2
  pbench 7b-0.7 llama2-7b 0.7 0.7
  pbench smol-0 smollm2-135m 0 0
  pbench 7b-0 llama2-7b 0 0
fi
at end
if has san; then
  sanitize racecheck runner 300 persistent_tiled_cbc sieve-gpu
  sanitize synccheck runner 300 persistent_tiled_cbc sieve-gpu
fi
(cd "$OUT" && tar czf logs.tgz --exclude logs.tgz *.log 2>/dev/null; rm -f t-*.log san-*.log pb-*.log)
