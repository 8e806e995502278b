#!/usr/bin/env bash
# Device window J1 (2026-12-06; carry .gpu from scripts/gpu-runner-bundle.sh): issue 28's union
# product over Tiled-CBC for a few sequences (built without a device). Its kernel test against
# the f64 reference, the runner's batched-slot tests (a Tiled-CBC model among them), then the
# 7B many-sequence step at 1..8 sequences with the union against without it
# (SIEVE_BATCH_UNION=off: single steps below 3 sequences, the tensor-core SpMM from 3).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
source scripts/gpu-quick.sh
run_t kernels 150 union_matches tiled_cbc_spmm
run_t runner 150 batched_slot_steps prompt_chunks_of_several_slots --test-threads 1
S=.gpu/bin/sieve
for cfg in "0.5 0.5 tiled-cbc" "0.7 0.7 tiled-cbc" "0.5 0.5 balanced-cbc"; do
  set -- $cfg
  for union in on off; do
    ( [ "$union" = off ] && export SIEVE_BATCH_UNION=off
      timeout 120 $S bench decode --synthetic llama2-7b --format $3 --sp $1 --dp $2 --prompt 128 --tokens 32 --batch 1,2,3,4,6,8 2>&1 \
        | grep -E "TPOT|batch" | cut -c1-150 | sed "s/^/$3 union $union: /" )
  done
done
