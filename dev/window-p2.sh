#!/usr/bin/env bash
# Device window P2 (written 2026-12-07): issue 27's Tiled-CBC persistent stages, two builds in
# one window: .gpu (main: a rope+kv stage after each sparse q|k|v) and .gpu-fold (attention
# does that epilogue itself, one barrier a layer fewer). Each build's persistent tests, then
# `bench decode --step persistent,graph --trace` with the fold's binary where its tests passed
# (else main's), on the 7B shape at 0.5 / 0.5 and 0.7 / 0.7, the SmolLM2 shape at 0.5 / 0.5, and
# main's persistent step at 7B 0.5 / 0.5 for the fold's gain.
#   PART="t bench"   (default)   PART=san   memcheck, racecheck, synccheck of the fold's test
# Carry .gpu and .gpu-fold (scripts/gpu-runner-bundle.sh with KEEP="runner", once per build).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT"
PART=${PART:-t bench}
exec > >(tee "$OUT/window-p2-${PART// /-}.log") 2>&1
. dev/window-lib.sh
has() { case " $PART " in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# bt BUNDLE FILTER SECONDS: the runner tests of one build, verdict lines; 0 when they passed.
bt() {
  local b=$1 bin; bin="$PWD/$b/tests/$(cut -f1 "$b/tests.tsv" | grep -m1 '^runner-')"
  (cd crates/sieve-gpu && SIEVE_REQUIRE_GPU=1 timeout "$3" "$bin" "$2" --test-threads 1 --nocapture \
    > "$OUT/t-$b-$2.log" 2>&1; echo "$b $2: exit $?")
  grep -E "^test |test result|panicked|max logit|step:" "$OUT/t-$b-$2.log" | cut -c1-300 | head -20
  grep -q "test result: ok" "$OUT/t-$b-$2.log"
}
pbench() {  # pbench BINARY LABEL SHAPE SP DP STEPS
  local bin=$1 label=$2 shape=$3 sp=$4 dp=$5 steps=$6
  if [ $(( $(date +%s) - start )) -gt "${BUDGET_S:-420}" ]; then echo "$label: skipped (time)"; return; fi
  local left=$(( ${END_S:-560} - $(date +%s) + start )); [ $left -gt 240 ] && left=240
  timeout $left $bin bench decode --synthetic "$shape" --sp "$sp" --dp "$dp" --prompt 128 --tokens 256 \
    --step "$steps" --trace "$OUT/trace-$label.svg" > "$OUT/pb-$label.log" 2>&1
  echo "$label: exit $? at $(( $(date +%s) - start )) s"
  grep -vE "^\s*$|^(loaded|upload)" "$OUT/pb-$label.log" | sed -E 's/\| eager split.*//' | cut -c1-300 | tail -16
}
S=.gpu/bin/sieve
if has t; then
  at tests
  main_ok=0; fold_ok=0
  bt .gpu persistent 200 && main_ok=1
  bt .gpu-fold persistent_tiled_cbc 150 && fold_ok=1
  [ "$fold_ok" = 1 ] && S=.gpu-fold/bin/sieve
  echo "main $main_ok fold $fold_ok: benches with $S"
fi
if has bench; then
  at bench
  pbench $S 7b-0.5 llama2-7b 0.5 0.5 persistent,graph
  pbench $S smol-0.5 smollm2-135m 0.5 0.5 persistent,graph
  pbench $S 7b-0.7 llama2-7b 0.7 0.7 persistent,graph
  [ "$S" != .gpu/bin/sieve ] && pbench .gpu/bin/sieve 7b-0.5-rope-stage llama2-7b 0.5 0.5 persistent
fi
at end
if has san; then
  b=.gpu-fold; bin="$PWD/$b/tests/$(cut -f1 "$b/tests.tsv" | grep -m1 '^runner-')"
  for tool in memcheck racecheck synccheck; do
    (cd crates/sieve-gpu && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout 170 compute-sanitizer --tool $tool \
      "$bin" persistent_tiled_cbc --test-threads 1 > "$OUT/san-$tool.log" 2>&1; echo "$tool: exit $?")
    grep -E "ERROR SUMMARY|test result|RACECHECK SUMMARY|Error|panicked" "$OUT/san-$tool.log" | head -5
  done
fi
(cd "$OUT" && tar czf logs.tgz --exclude logs.tgz *.log 2>/dev/null; rm -f t-*.log san-*.log pb-*.log)
