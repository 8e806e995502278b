#!/usr/bin/env bash
# Background fuzzing on a machine with spare cores (e.g. the GPU machine while a benchmark
# runs): every committed-corpus target of sieve-fuzz with SEEDS seeds each, at nice 19, for
# SECONDS, with the staged binary BIN (default .gpu/bin/sieve-fuzz). Results (one JSON line
# per process, CPU time and peak RSS from /usr/bin/time when present) go to OUT.
# OUT/done appears when every process has ended (wait for it with a file test: `pgrep -f` also
# matches the shell running the wait loop). Stage the binary with FUZZ=1 scripts/gpu-runner-bundle.sh.
#   bash scripts/fuzz-bg.sh SECONDS OUT "11 12" &   ...   until [ -f OUT/done ]; do sleep 2; done
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-500}
out=${2:-/tmp/fuzz-bg}
seeds=${3:-"11 12"}
bin=${BIN:-.gpu/bin/sieve-fuzz}
mkdir -p "$out"
if [ ! -x "$bin" ]; then
  echo "fuzz-bg: no fuzz binary at $bin (stage it with FUZZ=1 scripts/gpu-runner-bundle.sh)" | tee "$out/ERROR"
  touch "$out/done"
  exit 1
fi
timer=()
[ -x /usr/bin/time ] && timer=(/usr/bin/time -v)
for t in gguf safetensors pack blob tokenizer; do
  for s in $seeds; do
    nice -n 19 timeout $((seconds + 60)) "${timer[@]}" "$bin" run --targets "$t" --seconds "$seconds" \
      --seed "$s" --crashes "$out/crashes-$t-$s" > "$out/$t-$s.json" 2> "$out/$t-$s.time" &
  done
done
wait
touch "$out/done"
