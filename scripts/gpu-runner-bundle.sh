#!/usr/bin/env bash
# Light alternative to ../shared/tools/gpu-bundle for GPU runner work: the release `sieve`
# binary and the release test executables of sieve-gpu and sieve-cuda, stripped, in .gpu/
# (bin/, tests/, tests.tsv, run-tests), small enough to travel with a cut model.
#   scripts/gpu-runner-bundle.sh && (on the GPU machine) .gpu/run-tests
#   FUZZ=1 scripts/gpu-runner-bundle.sh   also stages bin/sieve-fuzz for scripts/fuzz-bg.sh
#   SERVE=1 scripts/gpu-runner-bundle.sh  also stages the server tests (tests/serve.rs), which
#     run against the GPU engine there with SIEVE_SERVE_TEST_DEVICE=cuda and the default model
#   KEEP="kernels runner slide" scripts/gpu-runner-bundle.sh  keeps only those test executables
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$(git rev-parse --git-common-dir)/info/exclude"
target=${CARGO_TARGET_DIR:-$root/target}
export CARGO_PROFILE_RELEASE_DEBUG=0
rm -rf .gpu && mkdir -p .gpu/bin .gpu/tests
: > .gpu/tests.tsv
cargo build --release -p sieve --quiet
cp "$target/release/sieve" .gpu/bin/
{ cargo test --release -p sieve-gpu -p sieve-cuda --no-run --message-format=json 2>/dev/null || true
  if [ "${SERVE:-0}" = 1 ]; then
    cargo test --release -p sieve-serve --test serve --no-run --message-format=json 2>/dev/null || true
  fi; } \
  | python3 -c '
import json, os, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["executable"] + "\t" + os.path.dirname(m["manifest_path"]))' \
  | while IFS=$'\t' read -r exe dir; do
      cp "$exe" .gpu/tests/
      printf '%s\t%s\n' "$(basename "$exe")" "$dir" >> .gpu/tests.tsv
    done
cat > .gpu/run-tests <<'EOS'
#!/usr/bin/env bash
# Runs every staged test executable from its crate directory with the GPU required.
cd "$(dirname "$0")/.."
export SIEVE_REQUIRE_GPU=1
status=0
while IFS=$'\t' read -r exe dir; do
  echo "== $exe"
  (cd "$dir" && "$OLDPWD/.gpu/tests/$exe" "$@") || status=1
done < .gpu/tests.tsv
exit $status
EOS
chmod +x .gpu/run-tests
# FUZZ=1: also the fuzz harness (debug build: overflow checks on), for scripts/fuzz-bg.sh there.
if [ "${FUZZ:-0}" = 1 ]; then
  cargo build -p sieve-fuzz --quiet
  cp "$target/debug/sieve-fuzz" .gpu/bin/
fi
for f in .gpu/bin/* .gpu/tests/*; do strip -s "$f" 2>/dev/null || true; done
# KEEP="kernels runner slide": only those test executables (and their tests.tsv lines), so that
# .gpu travels beside the tree and other carried folders within run's 64 MiB.
if [ -n "${KEEP:-}" ]; then
  while IFS=$'\t' read -r exe dir; do
    keep=0
    for k in $KEEP; do case $exe in "$k"-*) keep=1 ;; esac; done
    if [ "$keep" = 1 ]; then printf '%s\t%s\n' "$exe" "$dir"; else rm -f ".gpu/tests/$exe"; fi
  done < .gpu/tests.tsv > .gpu/tests.kept
  mv .gpu/tests.kept .gpu/tests.tsv
fi
du -sh .gpu
tree_kb=$(git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)
echo "carry estimate: .gpu $(du -sk .gpu | cut -f1) KiB + tracked tree ${tree_kb} KiB (run carries at most 65536 KiB in all)"
