#!/usr/bin/env bash
# Long fuzz run (docs/RELIABILITY.md): every reader target of crates/sieve-fuzz (gguf-real too
# when the default model is there), one process each, all at once at nice NICE (default 10),
# each until its fuzzing thread has used CPU_SECONDS of CPU time (default 1830: the "30 CPU
# minutes per target" of issue 30, whatever else the machine runs) or SECONDS of wall time
# (default 4 hours) have passed, under /usr/bin/time -v (CPU time, peak RSS). Temporary files
# (the safetensors target writes a directory per input) and findings go to tmpfs where there
# is one: on disk that target spends its time blocked in I/O. Results and logs go to OUT.
# Usage: bash scripts/fuzz.sh [CPU_SECONDS] [OUT] [SEED] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
cpu_seconds=${1:-1830}
out=${2:-target/fuzz-long}
seed=${3:-1}
seconds=${4:-14400}
cargo build -p sieve-fuzz --quiet
mkdir -p "$out"
cp target/debug/sieve-fuzz "$out/sieve-fuzz"
scratch=$out
[ -d /dev/shm ] && scratch=$(mktemp -d /dev/shm/sieve-fuzz.XXXXXX)
targets="gguf safetensors pack blob tokenizer"
[ -f "${SIEVE_HOME:-$HOME/.cache/sieve}/models/SmolLM2-135M-Instruct.Q4_1.gguf" ] && targets="$targets gguf-real"
for t in $targets; do
    TMPDIR=$scratch nice -n "${NICE:-10}" /usr/bin/time -v "$out/sieve-fuzz" run --targets "$t" \
        --cpu-seconds "$cpu_seconds" --seconds "$seconds" --seed "$seed" \
        --crashes "$scratch/crashes-$t" >"$out/$t.json" 2>"$out/$t.time" &
done
wait
cat "$out"/*.json
grep -H -E "Maximum resident|User time|System time|Exit status" "$out"/*.time
echo "findings (beyond each target's <target>.current, the input in flight at the end): $scratch"
ls -la "$scratch"/crashes-* 2>/dev/null || true
