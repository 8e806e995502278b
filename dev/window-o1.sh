#!/usr/bin/env bash
# Device window O1 (written 2026-12-07 for the next session): what earlier windows left unmeasured,
# every item runnable from one bundle, most important first, so a short window still closes some.
#   PART=leave  issue 27: `bench decode --leave-out` on the 7B shape (dense f16, dense int4,
#               int4 + 50% + TEAL 50%): the graph step without each op of every layer in turn,
#               so the ~450 us outside the products is split by op inside the real graph; then
#               the 2 MB prefetch default against none where it was never measured (TTFT at 128
#               and 2,048 tokens, the 32-sequence batched step)
#   PART=barrier issue 27: the persistent step's flag barrier (SIEVE_PERSISTENT_BARRIER=flags,
#               built 2026-12-07 without a device): the persistent test with it, then the
#               persistent step against the graph step on the SmolLM2 and 7B shapes, both
#               barriers (each in its own process: the switch is read once)
#   PART=ncu    issue 27: why attention takes ~8 us a layer at 129 positions (2.1 MB of cache):
#               ncu's speed-of-light, warp-state and occupancy sections for the split and
#               combine kernels and the small kernels of the 4-bit TEAL 7B step, in the graph
#               (node mode), one launch each after the prompt
#   PART=resident issue 29: `--prompt-precision f16-resident` (built 2026-12-07 without a
#               device): its runner test, then TTFT at 128 and 2,048 tokens of the 7B shape,
#               per-pass copies against resident ones, for Balanced-CBC and Tiled-CBC 0.5 / 0.5
#               and int4 + TEAL, dense f16 beside them (the target: sparse TTFT <= 1.05x dense)
#   PART=warp   issue 27: the warp split kernel of attention (SIEVE_ATTENTION_KERNEL=warp, built
#               2026-12-07 without a device): the attention tests (both kernels in one run),
#               racecheck, then the 7B step with each kernel at 128 and 4,096 positions
#   PART=owed   issue 29's correctness items: the slide-on-cuSPARSELt runner test, the FP8 cases
#               of the library test against their 1e-2 bound, memcheck on slide and slide_lt;
#               issue 26's: racecheck on w4a8; then issue 29's FP8 TTFT rows (dense and 6:8
#               slide at 2,048 tokens) and the column-format SpMM at N >= 512
# Carry .gpu from `KEEP="runner slide_lt w4a8 slide" bash scripts/gpu-runner-bundle.sh` (~25 MB).
# Rough lengths: leave 4 min, barrier 4, warp 5, resident 7, ncu 6, owed 6. Parts run in the
# order of this file whatever PART lists; with a 30-minute budget: first PART="warp leave" (one
# bundle, one call, ~9 min), then PART="barrier resident" (~11 min), then what is left.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p "$OUT"
PART=${PART:-owed}
exec > >(tee "$OUT/window-o1-${PART// /-}.log") 2>&1
. dev/window-lib.sh
has() { case " $PART " in *" $1 "*) return 0 ;; esac; return 1; }  # PART may list several
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ttft() {  # ttft LABEL ARGS...: a 2,048-token prompt's TTFT
  local label=$1; shift
  timeout 170 $S bench decode --synthetic llama2-7b --prompt 2048 --tokens 8 "$@" > "$OUT/ttft-$label.log" 2>&1
  echo "$label: exit $?"
  grep -E "TTFT|weights|rror" "$OUT/ttft-$label.log" | cut -c1-300 | head -4
}
if has barrier; then
  at tests
  SIEVE_PERSISTENT_BARRIER=flags t runner 90 persistent_step_matches_the_graph_step sieve-gpu
  SIEVE_ATTENTION_KERNEL=warp t runner 60 rope_and_attention_match_reference sieve-gpu
  at decode
  for b in flags count; do
    for shape in smollm2-135m llama2-7b; do
      SIEVE_PERSISTENT_BARRIER=$b timeout 200 $S bench decode --synthetic $shape --sp 0 --dp 0 --prompt 128 \
        --tokens 64 --step persistent,graph --trace "$OUT/persistent-$shape-$b.svg" > "$OUT/barrier-$shape-$b.log" 2>&1
      echo "$shape $b: exit $?"
      grep -E "TPOT|barriers|fixed cost|idle|rror" "$OUT/barrier-$shape-$b.log" | sed -E 's/\| eager split.*//' | cut -c1-230
    done
  done
  at end
fi
if has ncu; then
  for k in attention_split_g1 attention_combine rmsnorm_zero silu_mul rope_kv lbc_w4; do
    (cd /tmp && timeout 150 ncu --graph-profiling node --section SpeedOfLight --section WarpStateStats \
      --section Occupancy --section LaunchStats -k "regex:^$k" --launch-skip 300 --launch-count 1 \
      "$OLDPWD/$S" bench decode --synthetic llama2-7b --prompt 128 --tokens 4 --format dense --values int4 \
      --sp 0.5 --dp 0.5 > "$OUT/ncu-$k.txt" 2>&1)
    echo "$k: exit $?"
    grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Block Limit|Registers Per|Grid Size|Stall|One or More" "$OUT/ncu-$k.txt" | cut -c1-160 | head -24
  done
  at end
fi
if has resident; then
  at tests
  t runner 120 resident_f16_prompt_copies_give_the_per_pass_logits sieve-gpu
  at ttft
  ttft_of() {  # ttft_of LABEL PROMPT ARGS...
    local label=$1 prompt=$2; shift 2
    timeout 150 $S bench decode --synthetic llama2-7b --prompt $prompt --tokens 8 "$@" > "$OUT/resident-$label-$prompt.log" 2>&1
    echo "$label $prompt: exit $?"
    grep -E "TTFT|rror" "$OUT/resident-$label-$prompt.log" | sed -E 's/ \| [0-9.]+ GB\/token.*//' | cut -c1-200
  }
  ttft_of dense 128 --sp 0 --dp 0
  for p in f16 f16-resident; do
    ttft_of "balanced-$p" 128 --format balanced-cbc --sp 0.5 --dp 0.5 --prompt-precision $p
    ttft_of "tcbc-$p" 128 --sp 0.5 --dp 0.5 --prompt-precision $p
  done
  ttft_of dense 2048 --sp 0 --dp 0
  for p in f16 f16-resident; do
    ttft_of "balanced-$p" 2048 --format balanced-cbc --sp 0.5 --dp 0.5 --prompt-precision $p
  done
  at end
fi
if has warp; then
  at tests
  t runner 60 rope_and_attention_match_reference sieve-gpu
  t kv_cache 120 "" sieve-cuda
  sanitize racecheck kv_cache 240 int8_attention_matches_reference sieve-cuda
  at decode
  for k in block warp; do
    SIEVE_ATTENTION_KERNEL=$k dec "attn-$k" --format dense --values int4 --sp 0,0.5 --dp 0,0.5
    SIEVE_ATTENTION_KERNEL=$k timeout 200 $S bench decode --synthetic llama2-7b --prompt 4032 --tokens 32 \
      --context 4096 --sp 0 --dp 0 > "$OUT/attn-$k-4096.log" 2>&1; echo "attn $k 4096: exit $?"
    grep -E "TPOT" "$OUT/attn-$k-4096.log" | sed -E 's/\| TTFT.*graph step/| step/; s/\| eager split.*//' | cut -c1-230
  done
  at end
fi
if has leave; then
  for m in "f16 --format dense --sp 0 --dp 0" "int4 --format dense --values int4 --sp 0,0.5 --dp 0,0.5"; do
    set -- $m; label=$1; shift
    timeout 240 $S bench decode --synthetic llama2-7b --prompt 128 --tokens 128 "$@" --leave-out > "$OUT/leave-$label.log" 2>&1
    echo "$label: exit $?"
    grep -vE "^\s*$|^(loaded|upload)" "$OUT/leave-$label.log" | sed -E 's/\| eager split.*//' | cut -c1-260 | tail -40
  done
  # The 2 MB prefetch default where it was never measured: prompts (TTFT, 128 and 2,048 tokens)
  # and the serving path's batched step (32 sequences).
  for prompt in 128 2048; do
    timeout 200 $S bench decode --synthetic llama2-7b --prompt $prompt --tokens 8 --format dense --values int4 \
      --sp 0.5 --dp 0.5 --prefetch off,on > "$OUT/prefetch-ttft-$prompt.log" 2>&1; echo "prefetch ttft $prompt: exit $?"
    grep -E "TTFT" "$OUT/prefetch-ttft-$prompt.log" | sed -E 's/ \| [0-9.]+ GB\/token.*//' | cut -c1-220
  done
  timeout 240 $S bench decode --synthetic llama2-7b --prompt 128 --tokens 64 --format dense --values int4 \
    --sp 0.5 --dp 0.5 --prefetch off,on --batch 32 > "$OUT/prefetch-batch.log" 2>&1; echo "prefetch batch: exit $?"
  grep -E "TPOT|batch " "$OUT/prefetch-batch.log" | sed -E 's/\| TTFT.*//' | cut -c1-200
  at end
fi
if has owed; then
  at tests
  t runner 150 slide_prompts_on_cusparselt_match_cpu sieve-gpu
  SIEVE_LT_PRECISIONS=fp8 t slide_lt 90 gpu_slide_on_cusparselt_matches sieve-cuda
  at sanitizers
  sanitize racecheck w4a8 120 "" sieve-cuda
  sanitize memcheck slide 120 "" sieve-cuda
  SIEVE_LT_PRECISIONS=int8 sanitize memcheck slide_lt 120 "" sieve-cuda
  at ttft
  ttft dense-fp8 --sp 0 --dp 0 --prompt-precision fp8
  ttft dense-int8 --sp 0 --dp 0 --prompt-precision int8
  ttft slide-fp8 --format slide --pattern 6:8 --sp 0.25 --dp 0 --prompt-precision fp8
  at gemm
  timeout 120 $S bench gemm --shapes llama2-7b --precision f16,tcbc-spmm,tcbc-decode-gemm --sp 0.5 \
    --n 512,2048,8192 --reps 10 > "$OUT/gemm-tcbc.log" 2>&1; echo "gemm: exit $?"
  grep -E "^\||rror" "$OUT/gemm-tcbc.log" | cut -c1-150
  at end
fi
