#!/usr/bin/env bash
# Light alternative to ../shared/tools/gpu-bundle for sieve-cuda work: builds only this crate's
# release test executables and the bench_kernels example (the `sieve bench kernels` code) into
# .gpu-cuda/, in the same layout (bin/, tests/, tests.tsv), for scripts/gpu-kernels.sh with
# BUNDLE=.gpu-cuda.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu-cuda/' .git/info/exclude 2>/dev/null || echo '/.gpu-cuda/' >> .git/info/exclude
target=${CARGO_TARGET_DIR:-$root/target}
rm -rf .gpu-cuda && mkdir -p .gpu-cuda/bin .gpu-cuda/tests
: > .gpu-cuda/tests.tsv
cargo build --release -p sieve-cuda --examples --quiet
cp "$target/release/examples/bench_kernels" .gpu-cuda/bin/
cargo test --release -p sieve-cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, os, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["executable"] + "\t" + os.path.dirname(m["manifest_path"]))' \
  | while IFS=$'\t' read -r exe dir; do
      cp "$exe" .gpu-cuda/tests/
      printf '%s\t%s\n' "$(basename "$exe")" "$dir" >> .gpu-cuda/tests.tsv
    done
for f in .gpu-cuda/bin/* .gpu-cuda/tests/*; do strip -s "$f" 2>/dev/null || true; done
du -sh .gpu-cuda
