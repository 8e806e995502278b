#!/usr/bin/env bash
# Device window O2 (written 2026-12-07): tensor parallelism's first runs (issue 31), then what
# window O1 left (issue 27's ncu sections and int4 leave-out, the prefetch on prompts and
# batches, the warp attention kernel on grouped-query shapes).
#   PART=tp1     any one-GPU kind: NCCL found and linked (libnccl.so for cudarc), the collective
#                test at world size 1 (NCCL communicators, eager and in graph replays), the
#                runner's tensor-parallel test (world 1: the one-GPU tokens exactly), `bench
#                decode --tensor-parallel 1` against the plain step on the SmolLM2 shape, and
#                a split SmolLM2 served (one completion), memcheck of the dense 8-bit baseline
#                on cuSPARSELt with the compressed-buffer slack (the over-read of window O1)
#   PART=tp      a multi-GPU kind: the same tests at world size 2 (SIEVE_TP_WORLD=2), then
#                issue 31's table: 7B dense f16 on 1 and 2 GPUs, 70B dense f16 on 2 and 4
#   PART=gqa     the warp split kernel against the block one on grouped-query shapes (smollm2,
#                G = 3 -> 4; llama3-8b, G = 4) at 128 and 4,096 positions
#   PART=leave   `--leave-out` of the int4 0.5 / 0.5 7B step; the 2 MB prefetch on TTFT (128 and
#                2,048 tokens) and on the 32-sequence batched step
#   PART=ncu     window O1's PART=ncu (`PART=ncu bash dev/window-o1.sh`), then ncu26
#   PART=ncu26   issue 26's two ncu questions: is the f16 Tiled-CBC TEAL product bound by bytes
#                or by instructions (what a 4-bit Tiled-CBC would gain), and what the dense W4A16
#                products of one layer wait on
# Carry .gpu from `KEEP="runner slide_lt collective kv_cache" bash scripts/gpu-runner-bundle.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT"
PART=${PART:-tp1}
exec > >(tee "$OUT/window-o2-${PART// /-}.log") 2>&1
. dev/window-lib.sh
has() { case " $PART " in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# cudarc opens NCCL by its unversioned names; the wheels ship libnccl.so.2 only.
nccl_setup() {
  local lib; lib=$(find /opt /usr /lib -name 'libnccl.so*' 2>/dev/null | head -1)
  if [ -z "$lib" ]; then echo "no libnccl on this machine"; return 1; fi
  mkdir -p /tmp/nccl && ln -sf "$lib" /tmp/nccl/libnccl.so
  export LD_LIBRARY_PATH=/tmp/nccl:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
  echo "NCCL: $lib"
}
export SIEVE_CUSPARSELT=${SIEVE_CUSPARSELT:-$(find /opt -name 'libcusparseLt.so.0' 2>/dev/null | head -1)}
tp_bench() {  # tp_bench LABEL WORLD ARGS...: one bench decode --tensor-parallel row
  local label=$1 world=$2; shift 2
  timeout 300 $S bench decode --tensor-parallel "$world" "$@" > "$OUT/tp-$label.log" 2>&1
  echo "$label: exit $?"
  grep -E "TPOT|rror" "$OUT/tp-$label.log" | cut -c1-330
}
serve_smoke() {  # serve_smoke WORLD: a split synthetic SmolLM2 served, one completion asked
  local world=$1 port=$((18000 + $1))
  $S serve --synthetic smollm2-135m --sp 0 --dp 0 --tensor-parallel "$world" --port $port \
    --max-batch 4 --ctx 512 > "$OUT/serve-tp$world.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do grep -q listening "$OUT/serve-tp$world.log" && break; sleep 1; done
  curl -s -m 60 http://127.0.0.1:$port/v1/completions -H 'content-type: application/json' \
    -d '{"prompt":"hello","max_tokens":16,"temperature":0}' | cut -c1-300; echo
  kill $pid; wait $pid 2>/dev/null
  grep -E "tensor parallel|listening|rror" "$OUT/serve-tp$world.log" | cut -c1-250
}
if has tp1; then
  nccl_setup
  at tests
  t collective 60 "" sieve-cuda
  t runner 120 tensor_parallel sieve-gpu
  at bench
  tp_bench smollm2-tp1 1 --synthetic smollm2-135m --sp 0 --dp 0 --prompt 128 --tokens 128
  timeout 120 $S bench decode --synthetic smollm2-135m --sp 0 --dp 0 --prompt 128 --tokens 128 \
    > "$OUT/plain-smollm2.log" 2>&1; echo "plain smollm2: exit $?"
  grep -E "TPOT|rror" "$OUT/plain-smollm2.log" | sed -E 's/\| eager split.*//' | cut -c1-250
  serve_smoke 1
  if [ "${NO_SAN:-0}" != 1 ]; then  # passed in window O2's first call
    at sanitizers
    SIEVE_LT_PRECISIONS=int8 sanitize memcheck slide_lt 150 gpu_dense_eight_bit_baseline sieve-cuda
  fi
  at end
fi
if has tp; then
  nccl_setup
  at tests
  SIEVE_TP_WORLD=2 t collective 60 "" sieve-cuda
  SIEVE_TP_WORLD=2 t runner 180 tensor_parallel sieve-gpu
  at bench
  timeout 200 $S bench decode --synthetic llama2-7b --sp 0 --dp 0 --prompt 128 --tokens 256 \
    > "$OUT/plain-7b.log" 2>&1; echo "plain 7b: exit $?"
  grep -E "TPOT|rror" "$OUT/plain-7b.log" | sed -E 's/\| eager split.*//' | cut -c1-250
  serve_smoke 2
  tp_bench 7b-tp2 2 --synthetic llama2-7b --sp 0 --dp 0 --prompt 128 --tokens 256
  tp_bench 70b-tp2 2 --synthetic llama2-70b --sp 0 --dp 0 --prompt 128 --tokens 256
  tp_bench 70b-tp4 4 --synthetic llama2-70b --sp 0 --dp 0 --prompt 128 --tokens 256
  at end
fi
if has gqa; then
  for k in block warp; do
    for shape in smollm2-135m llama3-8b; do
      SIEVE_ATTENTION_KERNEL=$k timeout 200 $S bench decode --synthetic $shape --sp 0 --dp 0 \
        --prompt 128 --tokens 128 > "$OUT/gqa-$shape-$k-128.log" 2>&1
      echo "$shape $k 128: exit $?"
      grep -E "TPOT" "$OUT/gqa-$shape-$k-128.log" | sed -E 's/\| eager split.*//' | cut -c1-200
      SIEVE_ATTENTION_KERNEL=$k timeout 200 $S bench decode --synthetic $shape --sp 0 --dp 0 \
        --prompt 4032 --tokens 32 --context 4096 > "$OUT/gqa-$shape-$k-4096.log" 2>&1
      echo "$shape $k 4096: exit $?"
      grep -E "TPOT" "$OUT/gqa-$shape-$k-4096.log" | sed -E 's/\| eager split.*//' | cut -c1-200
    done
  done
fi
if has leave; then
  timeout 240 $S bench decode --synthetic llama2-7b --prompt 128 --tokens 128 --format dense \
    --values int4 --sp 0.5 --dp 0.5 --leave-out > "$OUT/leave-int4-teal.log" 2>&1
  echo "leave int4 teal: exit $?"
  grep -vE "^\s*$|^(loaded|upload)" "$OUT/leave-int4-teal.log" | sed -E 's/\| eager split.*//' | cut -c1-260 | tail -20
  for prompt in 128 2048; do
    timeout 200 $S bench decode --synthetic llama2-7b --prompt $prompt --tokens 8 --format dense --values int4 \
      --sp 0.5 --dp 0.5 --prefetch off,on > "$OUT/prefetch-ttft-$prompt.log" 2>&1; echo "prefetch ttft $prompt: exit $?"
    grep -E "TTFT" "$OUT/prefetch-ttft-$prompt.log" | sed -E 's/ \| [0-9.]+ GB\/token.*//' | cut -c1-220
  done
  timeout 240 $S bench decode --synthetic llama2-7b --prompt 128 --tokens 64 --format dense --values int4 \
    --sp 0.5 --dp 0.5 --prefetch off,on --batch 32 > "$OUT/prefetch-batch.log" 2>&1; echo "prefetch batch: exit $?"
  grep -E "TPOT|batch " "$OUT/prefetch-batch.log" | sed -E 's/\| TTFT.*//' | cut -c1-200
fi
if has ncu; then
  PART=ncu bash dev/window-o1.sh
fi
if has ncu || has ncu26; then
  # Issue 26's question for a 4-bit Tiled-CBC: is the f16 Tiled-CBC TEAL product bound by its
  # bytes or by its instructions (issue slots, the warp states)?
  (cd /tmp && timeout 150 ncu --graph-profiling node --section SpeedOfLight --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy -k "regex:^tcbc" \
    --launch-skip 300 --launch-count 2 "$OLDPWD/$S" bench decode --synthetic llama2-7b --prompt 128 \
    --tokens 4 --format tiled-cbc --sp 0.5 --dp 0.5 > "$OUT/ncu-tcbc.txt" 2>&1)
  echo "tcbc: exit $?"
  grep -E "tcbc|Duration|Memory Throughput|DRAM Throughput|Issue Slots Busy|Issued Ipc|Executed Ipc|SM Busy|Achieved Occupancy|Warp Cycles Per Issued|Stall|Executed Instructions  " \
    "$OUT/ncu-tcbc.txt" | cut -c1-160 | head -40
fi
if has ncu || has ncu26 || has w4a16; then
  # Issue 26's dense W4A16 products at half the copy bandwidth on an H200: each of q|k|v, o,
  # gate|up, down of one layer, its DRAM throughput and what its warps wait on.
  (cd /tmp && timeout 150 ncu --graph-profiling node --section SpeedOfLight --section WarpStateStats \
    --section Occupancy --section LaunchStats -k "regex:^lowbit_w4g128_nt" --launch-skip 400 --launch-count 4 \
    "$OLDPWD/$S" bench decode --synthetic llama2-7b --prompt 128 --tokens 4 --format dense --values int4 \
    --sp 0 --dp 0 > "$OUT/ncu-w4a16.txt" 2>&1)
  echo "w4a16: exit $?"
  grep -E "lowbit_w4g128_nt|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Warp Cycles Per Issued|Grid Size|Stall" \
    "$OUT/ncu-w4a16.txt" | cut -c1-160 | head -48
  # Beside the Tiled-CBC rows above: the column-major 4-bit TEAL product's instructions for
  # the same 0.5 / 0.5 step (what a 4-bit Tiled-CBC would compete with).
  (cd /tmp && timeout 150 ncu --graph-profiling node --section SpeedOfLight --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy -k "regex:^lbc_w4" \
    --launch-skip 300 --launch-count 2 "$OLDPWD/$S" bench decode --synthetic llama2-7b --prompt 128 \
    --tokens 4 --format dense --values int4 --sp 0.5 --dp 0.5 > "$OUT/ncu-lbc.txt" 2>&1)
  echo "lbc: exit $?"
  grep -E "lbc_w4|Duration|Memory Throughput|DRAM Throughput|Issue Slots Busy|Issued Ipc|Achieved Occupancy|Warp Cycles Per Issued|Executed Instructions  " \
    "$OUT/ncu-lbc.txt" | cut -c1-160 | head -30
fi
# Logs travel as one archive (a run returns at most 8 files).
(cd "$OUT" && tar czf logs.tgz --exclude logs.tgz *.log 2>/dev/null; rm -f t-*.log san-*.log tp-*.log serve-*.log plain-*.log gqa-*.log prefetch-*.log leave-*.log)
