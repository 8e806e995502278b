#!/usr/bin/env bash
# Device window Q2 (written 2026-12-07): the persistent step's Tiled-CBC tasks as one stream of
# batches a block (issue 27; docs/BENCHMARKS.md "Window P2", "Window P3": each task's latency
# chain ran alone, at 17-31% of copy bandwidth). Two builds: .gpu (the stream) and .gpu-old
# (802af34, a task at a time), same machine.
#   PART="t bench"  (default) the stream's persistent tests, then `bench decode --step
#                   persistent,graph --trace` on the 7B shape at 0.5 / 0.5 and 0.7 / 0.7 and the
#                   SmolLM2 shape at 0.5 / 0.5, the old build's persistent step at 7B 0.5 / 0.5,
#                   and Balanced-CBC (new in the persistent step) at 7B 0.5 / 0.5
#   PART=san        memcheck, racecheck, synccheck of the stream's Tiled-CBC test
#   PART=ncu        one persistent step of 7B 0.5 / 0.5 under ncu (warp states, memory)
# Carry .gpu and .gpu-old (scripts/gpu-runner-bundle.sh with KEEP="runner", once per build).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
# The Balanced-CBC persistent stage is behind this switch until its GPU test has passed.
export SIEVE_PERSISTENT_BCBC=1
mkdir -p "$OUT"
PART=${PART:-t bench}
exec > >(tee "$OUT/window-q2-${PART// /-}.log") 2>&1
. dev/window-lib.sh
has() { case " $PART " in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
runner_bin() { echo "$PWD/$1/tests/$(cut -f1 "$1/tests.tsv" | grep -m1 '^runner-')"; }
pbench() {  # pbench BINARY LABEL SHAPE SP DP STEPS [MORE ARGS]
  local bin=$1 label=$2 shape=$3 sp=$4 dp=$5 steps=$6; shift 6
  if [ $(( $(date +%s) - start )) -gt "${BUDGET_S:-480}" ]; then echo "$label: skipped (time)"; return; fi
  timeout 200 $bin bench decode --synthetic "$shape" --sp "$sp" --dp "$dp" --prompt 128 --tokens 256 \
    --step "$steps" --trace "$OUT/trace-$label.svg" "$@" > "$OUT/pb-$label.log" 2>&1
  echo "$label: exit $? at $(( $(date +%s) - start )) s"
  grep -vE "^\s*$|^(loaded|upload)" "$OUT/pb-$label.log" | sed -E 's/\| eager split.*//' | cut -c1-300 | tail -16
}
S=.gpu/bin/sieve
if has t; then
  at tests
  bin=$(runner_bin .gpu)  # before the cd: the bundle's paths are relative to the root
  (cd crates/sieve-gpu && SIEVE_REQUIRE_GPU=1 timeout 240 "$bin" persistent --test-threads 1 \
    --nocapture > "$OUT/t-persistent.log" 2>&1; echo "tests: exit $?")
  grep -E "^test |test result|panicked|max logit|step:" "$OUT/t-persistent.log" | cut -c1-300 | head -20
fi
if has bench; then
  at bench
  pbench $S 7b-0.5 llama2-7b 0.5 0.5 persistent,graph
  pbench .gpu-old/bin/sieve 7b-0.5-old llama2-7b 0.5 0.5 persistent
  pbench $S bcbc-7b-0.5 llama2-7b 0.5 0.5 persistent,graph --format balanced-cbc
  pbench $S 7b-0.7 llama2-7b 0.7 0.7 persistent,graph
  pbench $S smol-0.5 smollm2-135m 0.5 0.5 persistent,graph
fi
if has mini; then
  # A short window (little device time left): both sparse formats' persistent tests, then the
  # 7B shape at 0.5 / 0.5, Tiled-CBC (the stream, the graph step, the old build) and
  # Balanced-CBC, 64 tokens each.
  at mini
  bin=$(runner_bin .gpu)
  for f in persistent_tiled_cbc persistent_balanced_cbc; do
    (cd crates/sieve-gpu && SIEVE_REQUIRE_GPU=1 timeout ${T_S:-70} "$bin" $f --test-threads 1 --nocapture \
      > "$OUT/t-$f.log" 2>&1; echo "$f: exit $?")
    grep -E "^test |test result|panicked|max logit" "$OUT/t-$f.log" | cut -c1-300 | head -8
  done
  mb() {  # mb BINARY LABEL STEPS [MORE ARGS]
    local bin=$1 label=$2 steps=$3; shift 3
    timeout 60 $bin bench decode --synthetic llama2-7b --sp 0.5 --dp 0.5 --prompt 128 --tokens 64 \
      --step "$steps" "$@" > "$OUT/pb-$label.log" 2>&1
    echo "$label: exit $? at $(( $(date +%s) - start )) s"
    grep -E "TPOT|rror" "$OUT/pb-$label.log" | sed -E 's/\| TTFT.*graph step/| step/' | cut -c1-220
  }
  mb $S tcbc persistent,graph
  [ -x .gpu-old/bin/sieve ] && mb .gpu-old/bin/sieve tcbc-old persistent
  mb $S bcbc persistent,graph --format balanced-cbc
fi
if has san; then
  at san
  bin=$(runner_bin .gpu)
  for tool in memcheck racecheck synccheck; do
    (cd crates/sieve-gpu && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout 170 compute-sanitizer --tool $tool \
      "$bin" "${SAN_FILTER:-persistent_tiled_cbc}" --test-threads 1 > "$OUT/san-$tool.log" 2>&1; echo "$tool: exit $?")
    grep -E "ERROR SUMMARY|test result|RACECHECK SUMMARY|Error|panicked" "$OUT/san-$tool.log" | head -5
  done
fi
if has ncu; then
  at ncu
  (cd /tmp && timeout 300 ncu --graph-profiling node --section SpeedOfLight --section WarpStateStats \
    --section Occupancy --section MemoryWorkloadAnalysis -k regex:^persistent_step --launch-skip 8 --launch-count 1 \
    "$OLDPWD/$S" bench decode --synthetic llama2-7b --sp 0.5 --dp 0.5 --prompt 16 --tokens 16 \
    --step persistent > "$OUT/ncu-persistent-tcbc.txt" 2>&1)
  echo "ncu: exit $?"
  grep -E "Duration|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Achieved Occupancy|Warp Cycles Per Issued|Stall|Issue Slot|Executed Ipc" \
    "$OUT/ncu-persistent-tcbc.txt" | cut -c1-180 | head -40
fi
at end
(cd "$OUT" && tar czf logs.tgz --exclude logs.tgz *.log *.txt 2>/dev/null; rm -f t-*.log san-*.log pb-*.log)
