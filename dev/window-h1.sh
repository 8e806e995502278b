#!/usr/bin/env bash
# Device window H1 (written 2026-12-06 without a device; carry .gpu, built by
# `SERVE=1 scripts/gpu-runner-bundle.sh`): what was built since window G7 and has not run on a
# GPU. (1) Several prompts' chunks in one batched pass (`GpuModel::extend_slots`, the serving
# engine's `prefill_chunks`): its runner test against each chunk alone. (2) W4A16 g128 at 2
# blocks per SM above 8 tokens (window G7 measured it in `bench gemm` only): the low-bit
# kernel tests, the batched runner test, then the 7B step at batches of 1, 8, 32 (window G1:
# int4 g128 sp 0.5 / dp 0.5 5.907 ms at 32, dense f16 6.870 ms; H100). (3) The column-major
# 4-bit kernel with two slots per warp (`t1r16s2`, W4A16 g128 only): its kernel test, then
# `bench gemm` against t1r16 and t2r8 in the same call, and the 4-bit TEAL step with it forced.
# Ran 2026-12-06 10:14-10:33 UTC (docs/BENCHMARKS.md, "Windows H1-H4"); the t1r16s2 and
# t1r16f32 variants it measures were removed after it (an unknown variant name now runs the
# default rule).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} SIEVE_HOME=/tmp/sieve-home
mkdir -p /tmp/m
source scripts/gpu-quick.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run_t runner 240 prompt_chunks_of_several_slots batched_slot_steps --test-threads 1
grep -E "max error" "$OUT/runner.log" | head -12
run_t lowbit 200 --test-threads 1
S=.gpu/bin/sieve
for cfg in "--sp 0 --dp 0" "--format dense --values int4 --sp 0.5 --dp 0.5"; do
  echo "== $cfg"
  timeout 150 $S bench decode --synthetic llama2-7b $cfg --prompt 128 --tokens 64 --batch 1,8,32 > "$OUT/decode-${cfg// /_}.log" 2>&1
  grep -E "TPOT|batch " "$OUT/decode-${cfg// /_}.log" | cut -c1-200
done
for v in t1r16 t1r16s2 t1r16f32 t2r8; do
  (export SIEVE_LOWBIT_COLS_VARIANT=$v; run_t lowbit_cols 90 --test-threads 1 | sed "s/^/$v: /"
   timeout 120 $S bench gemm --shapes llama2-7b --precision w4a16-cols --n 1 --sp 0.5 --dp 0.5,0.7 --graph > "$OUT/gemm-cols-$v.txt" 2>&1
   grep -E "w4a16-cols" "$OUT/gemm-cols-$v.txt" | sed "s/^/$v: /" | head -8)
done
(export SIEVE_LOWBIT_COLS_VARIANT=t1r16s2
 timeout 150 $S bench decode --synthetic llama2-7b --format dense --values int4 --sp 0.5 --dp 0.5 --prompt 128 --tokens 128 > "$OUT/decode-s2.log" 2>&1
 grep -E "TPOT|products" "$OUT/decode-s2.log" | cut -c1-200)
