#!/usr/bin/env python3
"""Summarizes `sieve bench kernels --json` files against issue 5's targets: for each target
(sp, dp), the median over shapes of the speedup over cuBLAS (same run), per kernel and for the
best sieve kernel per shape, plus the slowest shape.

  scripts/bench-targets.py docs/bench/gpu-run3-7b-13b-l3.json docs/bench/gpu-run3-70b.json
  scripts/bench-targets.py --graph --issue11 RUN.json   # graph-mode figures, issue 11's targets
  scripts/bench-targets.py --graph --matrix RUN.json...  # also the sp x dp table of medians, and
      # for matrices over 50 MB: % of copy bandwidth of tiled-cbc/lane8 and whether it beats the
      # best dense-storage kernel at the same dp on every such shape
  scripts/bench-targets.py --graph --matrix --sparse=balanced-cbc RUN.json...  # that last table
      # for another weight-sparse kernel (rows whose format starts with the given prefix)

`--graph` reads each row's graph-mode speedup (runs made with `sieve bench kernels --graph`;
rows without graph figures are left out); `--issue11` checks issue 11's targets instead.

Kernels measured at sp = 0 (dense-gemv, dense-colmajor) are listed for the sp = 0 targets; for
sp > 0 targets the best-kernel column also considers `dense-colmajor*`: the pruned matrix
stored dense (zeros kept) under the column-skipping kernel, whose time does not depend on the
weight values, i.e. what an automatic per-layer kernel choice could pick.
"""
import json, statistics, sys
from collections import defaultdict

TARGETS = [((0.5, 0.5), 2.5), ((0.7, 0.7), 4.0), ((0.5, 0.0), 1.4), ((0.0, 0.5), 1.7), ((0.3, 0.3), 1.3)]
TARGETS_ISSUE11 = [((0.5, 0.5), 2.5), ((0.7, 0.7), 4.0), ((0.5, 0.0), 1.5), ((0.7, 0.0), 2.0),
                   ((0.0, 0.5), 1.8), ((0.3, 0.3), 1.5)]

args = sys.argv[1:]
graph = "--graph" in args
matrix = "--matrix" in args
if "--issue11" in args:
    TARGETS = TARGETS_ISSUE11
SPARSE = "tiled-cbc/lane8"
for a in args:
    if a.startswith("--sparse="):
        SPARSE = a.split("=", 1)[1]
args = [a for a in args if a not in ("--graph", "--issue11", "--matrix") and not a.startswith("--sparse=")]

def speedup(r):
    if graph:
        g = r.get("graph")
        return g["speedup_vs_cublas"] if g else None
    return r["speedup_vs_cublas"]

def family(fmt):
    # `auto:<kernel>` rows are the per-layer choice, whichever kernel it picked.
    if fmt.startswith("auto:"):
        return "auto"
    return fmt.split("/")[0] + ("/" + fmt.split("/")[1] if fmt.startswith("tiled-cbc/") else "")

rows = []
for path in args:
    rows += [r for r in json.load(open(path))["rows"] if speedup(r) is not None]
shapes = sorted({(r["model"], r["m"], r["k"]) for r in rows}, key=lambda s: (s[0], s[1] * s[2]))
print(("graph mode, " if graph else "event mode, ") + f"{len(shapes)} shapes: " + ", ".join(f"{m}x{k}" for _, m, k in shapes))
print()
print("| sp / dp | target | best sieve kernel: median | min (shape) | per kernel: median |")
print("|---|---|---|---|---|")
for (sp, dp), target in TARGETS:
    per_kernel = defaultdict(dict)
    for r in rows:
        if r["format"] == "cublas" or "/no-" in r["format"] or "loads-only" in r["format"]:
            continue
        if abs(r["dp"] - dp) > 1e-9:
            continue
        shape = (r["model"], r["m"], r["k"])
        if abs(r["sp"] - sp) < 1e-9:
            per_kernel[family(r["format"])][shape] = speedup(r)
        elif sp > 0 and r["sp"] == 0 and r["format"].startswith("dense-colmajor"):
            per_kernel["dense-colmajor*"][shape] = speedup(r)
    best = {}
    for k, by_shape in per_kernel.items():
        for s, v in by_shape.items():
            if v > best.get(s, (0, ""))[0]:
                best[s] = (v, k)
    if not best:
        continue
    med = statistics.median(v for v, _ in best.values())
    worst_shape, (worst, wk) = min(best.items(), key=lambda kv: kv[1][0])
    kernels = ", ".join(
        f"{k} {statistics.median(v.values()):.2f}x ({len(v)})" for k, v in sorted(per_kernel.items())
    )
    ok = "met" if med >= target else "missed"
    print(f"| {sp} / {dp} | >= {target}x | **{med:.2f}x** ({ok}) | {worst:.2f}x ({worst_shape[1]}x{worst_shape[2]}, {wk}) | {kernels} |")

if matrix:
    def pct(r):
        g = r.get("graph") if graph else r
        return g["pct_copy_bw"] if g else None

    sps = sorted({r["sp"] for r in rows})
    dps = sorted({r["dp"] for r in rows})
    cell = defaultdict(dict)  # (sp, dp) -> shape -> (speedup, kernel)
    lane8 = defaultdict(dict)
    dense_storage = defaultdict(dict)  # dp -> shape -> best dense-storage speedup
    big = {}
    for r in rows:
        if r["format"] == "cublas":
            big[(r["model"], r["m"], r["k"])] = r["bytes"] > 50e6
    # A point measured in several runs (dense-storage kernels at sp 0 come with every run of
    # that dp): the mean of its runs, each against its own run's cuBLAS.
    seen = defaultdict(list)
    for r in rows:
        seen[(r["format"], r["model"], r["m"], r["k"], r["sp"], r["dp"])].append(r)
    merged = []
    for same in seen.values():
        r = dict(same[0])
        r["_speedup"] = statistics.mean(speedup(x) for x in same)
        r["_pct"] = statistics.mean(pct(x) for x in same)
        merged.append(r)
    for r in merged:
        f = r["format"]
        if f == "cublas" or "/no-" in f or "loads-only" in f:
            continue
        shape = (r["model"], r["m"], r["k"])
        v = r["_speedup"]
        if f.startswith("dense"):
            # dense-storage kernels ignore the weights' zeros: they count at every sp
            dense_storage[r["dp"]][shape] = max(v, dense_storage[r["dp"]].get(shape, 0))
            for sp in sps:
                if v > cell[(sp, r["dp"])].get(shape, (0, ""))[0]:
                    cell[(sp, r["dp"])][shape] = (v, family(f))
        else:
            if v > cell[(r["sp"], r["dp"])].get(shape, (0, ""))[0]:
                cell[(r["sp"], r["dp"])][shape] = (v, family(f))
            if f.startswith(SPARSE):
                lane8[(r["sp"], r["dp"])][shape] = (v, r["_pct"])
    print()
    print("median speedup over cuBLAS over shapes, best kernel per shape (shapes counted)")
    print("| sp \\ dp | " + " | ".join(f"{d:g}" for d in dps) + " |")
    print("|---|" + "---|" * len(dps))
    for sp in sps:
        cells = []
        for dp in dps:
            c = cell.get((sp, dp), {})
            cells.append(f"{statistics.median(v for v, _ in c.values()):.2f} ({len(c)})" if c else "-")
        print(f"| best, sp {sp:g} | " + " | ".join(cells) + " |")
    for sp in sps:
        cells = []
        for dp in dps:
            c = lane8.get((sp, dp), {})
            cells.append(f"{statistics.median(v for v, _ in c.values()):.2f}" if c else "-")
        if any(x != "-" for x in cells):
            print(f"| {SPARSE}, sp {sp:g} | " + " | ".join(cells) + " |")
    print()
    print(f"matrices over 50 MB: {SPARSE} % of copy bandwidth (min-max), and shapes where it beats")
    print("the best dense-storage kernel at the same dp")
    print("| sp / dp | % copy | beats dense storage |")
    print("|---|---|---|")
    for (sp, dp), by_shape in sorted(lane8.items()):
        if sp < 0.3 - 1e-9:
            continue
        bs = [s for s in by_shape if big.get(s)]
        if not bs:
            continue
        ps = [by_shape[s][1] for s in bs]
        wins = sum(1 for s in bs if by_shape[s][0] > dense_storage[dp].get(s, 0))
        print(f"| {sp:g} / {dp:g} | {min(ps):.0f}-{max(ps):.0f}% | {wins} of {len(bs)} |")
