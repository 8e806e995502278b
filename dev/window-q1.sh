#!/usr/bin/env bash
# Device window Q1 (written 2026-12-07 for the next session): why the persistent step's Tiled-CBC
# tasks read at under a third of copy bandwidth (issue 27; docs/BENCHMARKS.md "Window P2",
# "Window P3": a deeper pipeline made them slower).
#   PART=ncu   one persistent step of the 7B shape at sp 0.5 / dp 0.5 under ncu: speed of light,
#              warp states (which stall dominates: barrier, long scoreboard, LG throttle...),
#              occupancy, memory workload, and the source counters' top stall lines
# Carry .gpu (KEEP="runner" scripts/gpu-runner-bundle.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT"
PART=${PART:-ncu}
exec > >(tee "$OUT/window-q1-$PART.log") 2>&1
. dev/window-lib.sh
has() { case " $PART " in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if has ncu; then
  # The persistent kernel is launched once per step; skip the warm-up and prompt steps.
  (cd /tmp && timeout 400 ncu --graph-profiling node --section SpeedOfLight --section WarpStateStats \
    --section Occupancy --section MemoryWorkloadAnalysis --section SourceCounters \
    -k regex:^persistent_step --launch-skip 8 --launch-count 1 \
    "$OLDPWD/$S" bench decode --synthetic llama2-7b --sp 0.5 --dp 0.5 --prompt 16 --tokens 16 \
    --step persistent > "$OUT/ncu-persistent-tcbc.txt" 2>&1)
  echo "ncu: exit $?"
  grep -E "Duration|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Achieved Occupancy|Warp Cycles Per Issued|Stall|Issue Slot|Executed Ipc" \
    "$OUT/ncu-persistent-tcbc.txt" | cut -c1-180 | head -40
  at end
fi
(cd "$OUT" && tar czf logs.tgz --exclude logs.tgz *.log *.txt 2>/dev/null)
