# Helpers for the device-window scripts (dev/window-*.sh from N2 on; the older ones keep their
# own copies as they ran). Source after `cd` to the repo root with OUT set; binaries and test
# executables come from .gpu (scripts/gpu-runner-bundle.sh).
S=.gpu/bin/sieve
start=$(date +%s)
at() { echo "--- $1 at $(( $(date +%s) - start )) s"; }
# The staged test executable of a test target (its name before the hash in .gpu/tests.tsv).
exe() { echo "$PWD/.gpu/tests/$(cut -f1 .gpu/tests.tsv | grep -m1 "^$1-")"; }
t() {  # t NAME SECONDS FILTER CRATE-DIR: one test target on the GPU, its verdict lines
  local bin; bin=$(exe "$1")
  (cd "crates/$4" && SIEVE_REQUIRE_GPU=1 timeout "$2" "$bin" $3 --test-threads 1 --nocapture > "$OUT/t-$1-${3:-all}.log" 2>&1; echo "$1 ${3:-all}: exit $?")
  grep -E "^test |test result|panicked|same tokens|differ" "$OUT/t-$1-${3:-all}.log" | cut -c1-260 | head -20
}
sanitize() {  # sanitize TOOL NAME SECONDS FILTER CRATE-DIR: the same under compute-sanitizer
  local bin; bin=$(exe "$2")
  (cd "crates/$5" && SIEVE_REQUIRE_GPU=1 SIEVE_SANITIZE_SMALL=1 timeout "$3" compute-sanitizer --tool "$1" \
    "$bin" $4 --test-threads 1 > "$OUT/san-$1-$2.log" 2>&1; echo "$1 $2 $4: exit $?")
  grep -E "ERROR SUMMARY|test result|RACECHECK SUMMARY|Error|panicked" "$OUT/san-$1-$2.log" | head -5
}
dec() {  # dec LABEL ARGS...: the 7B shape's decode step, 128-token prompt, 128 tokens
  local label=$1; shift
  timeout 240 $S bench decode --synthetic llama2-7b --prompt 128 --tokens 128 "$@" > "$OUT/dec-$label.log" 2>&1
  echo "$label: exit $?"
  grep -E "TPOT|rror" "$OUT/dec-$label.log" | sed -E 's/\| TTFT.*graph step/| step/; s/\| eager split.*//' | cut -c1-260
}
