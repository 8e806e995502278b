#!/usr/bin/env bash
# One GPU-machine call for the decode runner (carry .gpu, built by scripts/gpu-runner-bundle.sh;
# optionally .gpu-model holding a cut GGUF from scripts/cut-gguf.py):
#   tests  - every staged test executable with SIEVE_REQUIRE_GPU=1
#   smol   - CPU vs GPU greedy text on the cut SmolLM2 in .gpu-model
#   decode - sieve bench decode on a synthetic model (NAME, ARGS from the environment)
# Full logs and JSON go to $OUT; the last lines printed are the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export SIEVE_HOME=${SIEVE_HOME:-/tmp/sieve-home}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
for step in "$@"; do
  case "$step" in
    tests)
      .gpu/run-tests > "$OUT/tests.log" 2>&1; echo "tests: exit $?"
      grep -E "^test result|FAILED|panicked|max logit error|bytes per token|of the dense" "$OUT/tests.log" | head -40 ;;
    smol)
      for m in .gpu-model/*.gguf; do
        for dev in cpu cuda; do
          echo "== $m on $dev"
          .gpu/bin/sieve generate --model "$m" --device "$dev" --max-tokens 32 "The capital of France is" 2>&1 | tail -4
        done
      done ;;
    decode)
      .gpu/bin/sieve bench decode --synthetic "${NAME:-llama2-7b}" ${ARGS:-} --json "$OUT/decode-${NAME:-llama2-7b}.json" --plot "$OUT/decode-${NAME:-llama2-7b}.svg" 2>&1 | tee "$OUT/decode-${NAME:-llama2-7b}.log" | tail -8 ;;
    *) echo "unknown step $step" ;;
  esac
done
