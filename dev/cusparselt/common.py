"""What bench.py and direct.py share: the shapes, pruning to 2:4, event timing, the error."""
import argparse
import statistics

import torch

SHAPES = {
    "7b": [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)],
    "13b": [(15360, 5120), (5120, 5120), (27648, 5120), (5120, 13824)],
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
}
L2_BYTES = 60 * 2**20


def prune_2_4(w):
    m, k = w.shape
    g = w.float().abs().view(m, k // 4, 4)
    keep = torch.zeros_like(g, dtype=torch.bool)
    keep.scatter_(2, g.topk(2, dim=2).indices, True)
    return w * keep.view(m, k).to(w.dtype)


def timed(fn, copies, reps):
    for i in range(3):
        fn(i % copies)
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(r % copies)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def arguments():
    """The options both scripts take."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="7b")
    ap.add_argument("--n", default="8,32,128,512,2048,4096,8192")
    ap.add_argument("--precision", default="f16,int8,fp8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    return ap.parse_args()
