#!/usr/bin/env bash
# Device-side helpers for short GPU sessions (source it): run_t NAME SECONDS [ARGS...] runs the
# staged test executable NAME-<hash> from .gpu/ in its crate directory with the GPU required,
# its log in $OUT/NAME.log and a summary on stdout.
export SIEVE_HOME=${SIEVE_HOME:-/tmp/sieve-home}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run_t() {
  local name=$1 secs=$2; shift 2
  local exe dir
  exe=$(cut -f1 .gpu/tests.tsv | grep -m1 "^$name-[0-9a-f]*$")
  dir=$(grep -m1 "^$exe" .gpu/tests.tsv | cut -f2)
  dir="crates/${dir##*/crates/}"
  (cd "$dir" && SIEVE_REQUIRE_GPU=1 SIEVE_SERVE_TEST_DEVICE=cuda timeout "$secs" "$OLDPWD/.gpu/tests/$exe" "$@") \
    > "$OUT/$name.log" 2>&1
  echo "$name: exit $?"
  grep -E "^test result|FAILED|panicked|error" "$OUT/$name.log" | head -12
}
