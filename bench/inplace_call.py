"""Median call time of the compressed allreduce's call forms on 4 gloo ranks (loopback),
interleaved in one run, and the CompressionState's bytes per element:

    alloc            compressed_allreduce(x.clone(), st)    (deprecated: a fresh output per call)
    out              compressed_allreduce(x, st, out=out)
    inplace          compressed_allreduce_(y, st)
    inplace_checked  reduce_(st, y, y, checked=True)        (the optimizers' form: no agreement)

    python bench/inplace_call.py 8388608 10
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import torch
from dist_util import run_ranks


def state_bytes(st):
    seen, total = set(), 0
    for v in list(vars(st).values()):
        items = v if isinstance(v, (list, tuple)) else [v]
        for t in items:
            ts = t if isinstance(t, (list, tuple)) else [t]
            for u in ts:
                if isinstance(u, torch.Tensor) and u.data_ptr() not in seen:
                    seen.add(u.data_ptr())
                    total += u.numel() * u.element_size()
    return total


def rank_fn(rank, p, n, iters):
    import lbcomm
    torch.set_num_threads(1)
    from lbcomm.comm import get_transport

    tr = get_transport()
    st = lbcomm.CompressionState(n)
    x = torch.randn(n)
    out = torch.empty(n)
    modes = {"alloc": lambda: lbcomm.compressed_allreduce(x.clone(), st),
             "out": lambda: lbcomm.compressed_allreduce(x, st, out=out)}
    y = torch.randn(n)
    modes["inplace"] = lambda: lbcomm.compressed_allreduce_(y, st)
    modes["inplace_checked"] = lambda: lbcomm.compressed.reduce_(st, y, y, checked=True)
    import warnings
    warnings.simplefilter("ignore")
    times = {k: [] for k in modes}
    for f in modes.values():
        f()
    for _ in range(iters):
        for k, f in modes.items():
            tr.barrier()
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    return med, state_bytes(st) / n


if __name__ == "__main__":
    n, iters = int(float(sys.argv[1])), int(sys.argv[2])
    res = run_ranks(rank_fn, 4, n, iters, timeout=900)
    for k in res[0][0]:
        print(f"{k:16s} median ms per rank: " + " ".join(f"{r[0][k]:.1f}" for r in res))
    print("state bytes/element:", res[0][1])
