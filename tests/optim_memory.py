"""Resident optimizer state per parameter (README, "Optimizer memory").

bench/convergence.py's `state_bytes(opt, model)` counts every tensor the optimizer holds
(its flat buffers, views counted once per storage, scratch and staging buffers, masks) and
everything its CompressionState holds (error buffers, their spares, wire buffers);
parameters and gradients are excluded. Run on 4 gloo ranks, past the freeze:

    PYTHONPATH=$PWD python tests/optim_memory.py [numel [timed steps]]

With timed steps, the median time of optimizer.step() in the compression stage is
printed too (no bandwidth limit: the compute and loopback cost of a step).
"""
from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

import lbcomm
from bench.convergence import state_bytes


# OneBitLamb/decoded: the live ratio on the decoded direction's norm (norm_samples=0), the
# rule before the estimated norm: what the estimate costs, in the same process
KINDS = ("AdamW", "OneBitAdam", "Lamb", "OneBitLamb", "OneBitLamb/decoded")


def make(kind: str, params):
    if kind == "AdamW":
        return torch.optim.AdamW(params, lr=1e-3)
    if kind == "Lamb":
        return lbcomm.Lamb(params, lr=1e-3)
    if kind == "OneBitLamb/decoded":
        return lbcomm.OneBitLamb([{"params": list(params), "norm_samples": 0}], lr=1e-3, freeze_step=2)
    return getattr(lbcomm, kind)(params, lr=1e-3, freeze_step=2)


def measure(rank, p, numel, steps=4, timed=0):
    torch.set_num_threads(1)
    out = {}
    for kind in KINDS:
        torch.manual_seed(0)
        width = 1024
        net = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(max(1, numel // width ** 2))])
        opt = make(kind, net.parameters())
        for t in range(steps):
            for q in net.parameters():
                q.grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(t * 10 + rank))
            opt.step()
        n = sum(q.numel() for q in net.parameters())
        out[kind] = {"bytes": state_bytes(opt, net)[0] / n}
        times = []
        for t in range(timed):  # the compression stage's step (gradients already in place)
            torch.distributed.barrier()
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        out[kind]["step_ms"] = 1e3 * sorted(times)[len(times) // 2] if times else None
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dist_util import run_ranks

    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 8 << 20
    timed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    res = run_ranks(measure, 4, numel, 4, timed, timeout=1800)
    print(f"resident optimizer state, bytes per parameter, 4 ranks, {numel} parameters (rank 0):")
    for kind, r in res[0].items():
        ms = "" if r["step_ms"] is None else f"   step {r['step_ms']:7.1f} ms (median of {timed})"
        print(f"  {kind:<18} {r['bytes']:6.2f}{ms}")
