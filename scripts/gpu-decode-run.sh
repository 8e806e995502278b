#!/usr/bin/env bash
# One GPU-machine call for the decode runner (carry .gpu, built by scripts/gpu-runner-bundle.sh;
# optionally .gpu-model holding a cut GGUF from scripts/cut-gguf.py and, for `packs`, calib.txt,
# e.g. `head -c 200000 data/wikitext-2/valid.txt > .gpu-model/calib.txt`):
#   tests  - every staged test executable with SIEVE_REQUIRE_GPU=1
#   smol   - CPU vs GPU greedy text on the cut SmolLM2 in .gpu-model
#   packs  - FORMAT (default tiled-cbc; balanced-cbc packs get the balanced N:16 pattern) packs
#            of the cut SmolLM2 (sp 0.5 with dp 0, and with dp 0.5), calibrated
#            on .gpu-model/calib.txt, each checked against the CPU (models_from_env_match_cpu):
#            dp 0 checks the kernels at the plain tolerance, dp 0.5 against the CPU's own
#            threshold sensitivity
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
    packs)
      exe=$(cut -f1 .gpu/tests.tsv | grep '^runner-' | head -1)
      models=""
      for m in .gpu-model/*.gguf; do
        for dp in 0 0.5; do
          p="/tmp/$(basename "$m" .gguf)-${FORMAT:-tiled-cbc}-sp0.5-dp$dp.sieve"
          .gpu/bin/sieve pack --model "$m" --out "$p" --method magnitude --sp 0.5 --dp "$dp" \
            --format "${FORMAT:-tiled-cbc}" --calib .gpu-model/calib.txt --calib-samples 4 --calib-len 256 > "$OUT/pack-dp$dp.log" 2>&1 \
            && models="$models:$p" || echo "pack $p failed (see $OUT/pack-dp$dp.log)"
        done
      done
      (cd crates/sieve-gpu && SIEVE_REQUIRE_GPU=1 SIEVE_GPU_CHECK_MODELS="$models" "../../.gpu/tests/$exe" \
        models_from_env_match_cpu --nocapture) > "$OUT/packs.log" 2>&1; echo "packs: exit $?"
      grep -E "logit error|against itself|panicked|test result" "$OUT/packs.log" ;;
    decode)
      .gpu/bin/sieve bench decode --synthetic "${NAME:-llama2-7b}" ${ARGS:-} --json "$OUT/decode-${NAME:-llama2-7b}.json" --plot "$OUT/decode-${NAME:-llama2-7b}.svg" 2>&1 | tee "$OUT/decode-${NAME:-llama2-7b}.log" | tail -8 ;;
    *) echo "unknown step $step" ;;
  esac
done
