# Settings shared by the quality scripts (scripts/quality-*.sh), sourced after `set -euo pipefail`:
# SIEVE (binary, default target/release/sieve), MODEL (default model when empty), TOKENS (ppl
# token budget, default 16384), CALIB_SAMPLES (default 32), CALIB_LEN (default 1024), OUT (folder
# for the .sieve files, default $1).
root=$(git rev-parse --show-toplevel)
cd "$root"
sieve=${SIEVE:-target/release/sieve}
tokens=${TOKENS:-16384}
samples=${CALIB_SAMPLES:-32}
len=${CALIB_LEN:-1024}
out=${OUT:-$1}
mkdir -p "$out"
model_args=()
[ -n "${MODEL:-}" ] && model_args=(--model "$MODEL")

ppl_of() { # ppl_of FILE -> prints the perplexity of FILE
  "$sieve" eval ppl --model "$1" --max-tokens "$tokens" | python3 -c 'import json,sys; print("%.3f" % json.loads(sys.stdin.read())["ppl"])'
}
