#!/usr/bin/env bash
# The "Balanced sparsity (N:16 along the outputs)" table of docs/QUALITY.md: perplexity on
# wikitext-2 test of `sieve pack --pattern balanced` (N = round(16 (1 - sp)) kept in every 16
# consecutive outputs of each input column) against unstructured at the same sp, with the same
# helpers and settings as scripts/quality-table.sh (calibration on wikitext-2 *valid*).
#
# Environment: as scripts/quality-table.sh (SIEVE, MODEL, TOKENS, CALIB_SAMPLES, CALIB_LEN,
# FORMAT, OUT). The documented run used TOKENS=4096 CALIB_SAMPLES=16 CALIB_LEN=512.
set -euo pipefail
source "$(dirname "$0")/quality-common.sh" /tmp/sieve-quality
format=${FORMAT:-dense}

row() { # row METHOD PATTERN SP
  local method=$1 pattern=$2 sp=$3
  local file="$out/${method}-${pattern//:/-}-sp${sp}.sieve"
  local t0 t1 stats
  t0=$(date +%s)
  stats=$("$sieve" pack "${model_args[@]}" --out "$file" --method "$method" --pattern "$pattern" \
    --sp "$sp" --dp 0 --format "$format" --calib-samples "$samples" --calib-len "$len" \
    2>/dev/null | awk '$1 == "all" {print $2}')
  t1=$(date +%s)
  echo "| $method | $pattern | $sp | $stats | $(ppl_of "$file") | $((t1 - t0)) s |"
}

echo "ppl on the first $tokens tokens of wikitext-2 test (ctx 1024); calibration $samples x $len tokens of wikitext-2 valid; format $format"
echo "started $(date -u '+%Y-%m-%d %H:%M UTC') on $(nproc) cores, $(uptime | sed 's/.*load/load/')"
echo
echo "| method | pattern | sp | measured sp | ppl | pack time |"
echo "|---|---|---|---|---|---|"
row wanda unstructured 0.5
for method in magnitude wanda sparsegpt; do
  row "$method" balanced 0.5
done
for method in wanda sparsegpt; do
  row "$method" balanced 0.7
  row "$method" unstructured 0.7
done
row magnitude balanced 0.7
row magnitude unstructured 0.7
row sparsegpt unstructured 0.5
echo
echo "finished $(date -u '+%Y-%m-%d %H:%M UTC'), $(uptime | sed 's/.*load/load/')"
