#!/usr/bin/env bash
# Builds the quality table of docs/QUALITY.md: perplexity on wikitext-2 test (same token budget per
# row) of the dense model and of `sieve pack` outputs:
#   - dense;
#   - magnitude / Wanda / SparseGPT at 50% unstructured, 2:4 and 6:8;
#   - TEAL alone (dp 0.3, 0.4, 0.5), uniform and with TEAL's greedy allocation (--teal-greedy);
#   - the dual grid (sp, dp) in {0, 0.2, 0.3, 0.4, 0.5}^2 with Wanda, unstructured.
# Calibration is on wikitext-2 *valid* (never test). Prints one Markdown row per model as it goes.
#
# Environment: SIEVE (binary, default target/release/sieve), MODEL (default model when empty),
# TOKENS (ppl token budget, default 16384), CALIB_SAMPLES (default 32), CALIB_LEN (default 1024),
# FORMAT (default dense: every format stores the same values except ie-bme's INT4 payload, and
# dense evaluates fastest), OUT (folder for the .sieve files, default /tmp/sieve-quality).
set -euo pipefail
source "$(dirname "$0")/quality-common.sh" /tmp/sieve-quality
format=${FORMAT:-dense}

ppl() { # ppl FILE|"" -> prints the perplexity
  local m=()
  # The dense row is the f16-dequantized model `sieve pack` prunes, not the GGUF's quantized blocks.
  if [ -n "$1" ]; then m=(--model "$1"); else m=("${model_args[@]}" --f16-weights); fi
  "$sieve" eval ppl "${m[@]}" --max-tokens "$tokens" | python3 -c 'import json,sys; print("%.3f" % json.loads(sys.stdin.read())["ppl"])'
}

row() { # row METHOD PATTERN SP DP [EXTRA PACK FLAGS...]
  local method=$1 pattern=$2 sp=$3 dp=$4
  shift 4
  local extra=("$@") label=$method suffix=""
  if [ ${#extra[@]} -gt 0 ]; then label="$method ${extra[*]}"; suffix="${extra[*]// /}"; fi
  local file="$out/${method}-${pattern/:/-}-sp${sp}-dp${dp}${suffix}.sieve"
  local t0 t1 stats
  t0=$(date +%s)
  stats=$("$sieve" pack "${model_args[@]}" --out "$file" --method "$method" --pattern "$pattern" \
    --sp "$sp" --dp "$dp" --format "$format" --calib-samples "$samples" --calib-len "$len" \
    "${extra[@]}" 2>/dev/null | awk '$1 == "all" {print $2, $3, $5}')
  t1=$(date +%s)
  read -r msp mdp mtotal <<<"$stats"
  echo "| $label | $pattern | $sp | $dp | $msp | $mdp | $mtotal | $(ppl "$file") | $((t1 - t0)) s |"
}

echo "ppl on the first $tokens tokens of wikitext-2 test (ctx 1024); calibration $samples x $len tokens of wikitext-2 valid; format $format"
echo "started $(date -u '+%Y-%m-%d %H:%M UTC') on $(nproc) cores, $(uptime | sed 's/.*load/load/')"
echo
echo "| method | pattern | sp | dp | measured sp | measured dp | total sparsity | ppl | pack time |"
echo "|---|---|---|---|---|---|---|---|---|"
echo "| dense | - | 0 | 0 | 0 | 0 | 0 | $(ppl "") | - |"
for method in magnitude wanda sparsegpt; do
  row "$method" unstructured 0.5 0
  row "$method" 2:4 0.5 0
  row "$method" 6:8 0.25 0
done
for dp in 0.3 0.4 0.5; do
  row magnitude unstructured 0 "$dp"
  row magnitude unstructured 0 "$dp" --teal-greedy
done
for sp in 0 0.2 0.3 0.4 0.5; do
  for dp in 0 0.2 0.3 0.4 0.5; do
    [ "$sp" = 0 ] && [ "$dp" = 0 ] && continue
    row wanda unstructured "$sp" "$dp"
  done
done
echo
echo "finished $(date -u '+%Y-%m-%d %H:%M UTC'), $(uptime | sed 's/.*load/load/')"
