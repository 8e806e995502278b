#!/usr/bin/env python3
"""Fits the per-kernel time models behind sieve-cuda's automatic kernel choice
(`crates/sieve-cuda/src/choice.rs`) to `sieve bench kernels --json` results, by least squares:

  dense-colmajor:   t = a0 + a1 * MB(active columns, dense f16) + a2 * row_tiles
  tiled-cbc/lane8:  t = b0 + b1 * MB(format bytes at dp = 0) * (1 - dp) + b2 * active column tiles / 1e3

(MB = 1e6 bytes, t in µs). Prints the coefficients and how often the fitted choice picks the
kernel that was really faster (or within 3% of it).

  scripts/fit-kernel-model.py docs/bench/gpu-run3-7b-13b-l3.json docs/bench/gpu-run3-70b.json
"""
import json, sys
import numpy as np

rows = []
for p in sys.argv[1:]:
    rows += json.load(open(p))["rows"]
# Bytes of the whole encoding: what the format reads with every column active.
full = {(r["format"], r["m"], r["k"], r["sp"]): r["bytes"] for r in rows if r["dp"] == 0}

def feats(r, kind):
    m, k, sp, dp = r["m"], r["k"], r["sp"], r["dp"]
    row_tiles = -(-m // 256)
    active_tiles = row_tiles * k * (1 - dp)
    if kind == "colmajor":
        mb = m * k * 2 * (1 - dp) / 1e6
        return [1.0, mb, row_tiles]
    mb = full[("tiled-cbc/lane8", m, k, sp)] * (1 - dp) / 1e6
    return [1.0, mb, active_tiles / 1e3]

fits = {}
for kind, prefix in [("colmajor", "dense-colmajor"), ("lane8", "tiled-cbc/lane8")]:
    sel = [r for r in rows if r["format"] == prefix]
    X = np.array([feats(r, kind) for r in sel])
    y = np.array([r["us"] for r in sel])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    pred = X @ coef
    err = np.abs(pred - y) / y
    fits[kind] = coef
    print(f"{kind}: coef {np.round(coef, 4).tolist()}  median |err| {np.median(err)*100:.1f}%  max {err.max()*100:.1f}%  ({len(sel)} points)")

# Choice quality on the lane8 points (sp > 0), colmajor time taken at the same shape and dp.
colm = {(r["m"], r["k"], r["dp"]): r["us"] for r in rows if r["format"] == "dense-colmajor"}
good = total = 0
for r in rows:
    if r["format"] != "tiled-cbc/lane8" or r["sp"] == 0:
        continue
    key = (r["m"], r["k"], r["dp"])
    if key not in colm:
        continue
    # colmajor features from a synthetic row of the same shape
    c_pred = np.dot(fits["colmajor"], feats({"m": r["m"], "k": r["k"], "sp": 0, "dp": r["dp"]}, "colmajor"))
    l_pred = np.dot(fits["lane8"], feats(r, "lane8"))
    pick_lane8 = l_pred < c_pred
    best = min(colm[key], r["us"])
    got = r["us"] if pick_lane8 else colm[key]
    total += 1
    good += got <= best * 1.03
print(f"choice within 3% of the faster kernel: {good}/{total}")
