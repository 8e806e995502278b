#!/usr/bin/env bash
# Long fuzz run (docs/RELIABILITY.md): every target of crates/sieve-fuzz for SECONDS each, all
# at once at nice 19, each under /usr/bin/time -v (CPU time, peak RSS). Findings and logs go to
# OUT. Usage: bash scripts/fuzz.sh [SECONDS] [OUT] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-1800}
out=${2:-target/fuzz-long}
seed=${3:-1}
cargo build -p sieve-fuzz --quiet
mkdir -p "$out"
cp target/debug/sieve-fuzz "$out/sieve-fuzz"
for t in gguf safetensors pack blob tokenizer; do
    nice -n 19 /usr/bin/time -v "$out/sieve-fuzz" run --targets "$t" --seconds "$seconds" \
        --seed "$seed" --crashes "$out/crashes" >"$out/$t.json" 2>"$out/$t.time" &
done
wait
cat "$out"/*.json
grep -H -E "Maximum resident|User time|System time|Exit status" "$out"/*.time
