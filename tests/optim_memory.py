"""Resident optimizer state per parameter (README, "Optimizer memory").

bench/convergence.py's `state_bytes(opt, model)` counts every tensor the optimizer holds
(its flat buffers, views counted once per storage, scratch and staging buffers, masks) and
everything its CompressionState holds (error buffers, their spares, wire buffers);
parameters and gradients are excluded. Run on 4 gloo ranks, past the freeze:

    PYTHONPATH=$PWD python tests/optim_memory.py [numel [timed steps]]

With timed steps, the median time of optimizer.step() in the compression stage is
printed too (no bandwidth limit: the compute and loopback cost of a step), wall clock and
the rank's process (CPU) time: with 4 ranks on fewer cores the wall clock also holds the
time a rank waits for a core, so the CPU ratios vary less from run to run; the kinds taking
their steps in turn, round by round, so that load from other processes hits them alike;
AdamW+allreduce is torch's AdamW after an fp32 allreduce of the gradients, the step the
1-bit optimizers replace (Lamb averages its gradients itself). Under each
total, `breakdown` lists what holds the bytes (the same tensors, each storage once, named
by the shortest path from the optimizer; the rows add up to the total).

ZeroOneAdam is measured in its 1-bit stage (variance steps at 1 and 3, 1-bit steps at 2
and 4) and, as ZeroOneAdam/local, in its local-step stage (var_freeze_step=2: the anchor
and the accumulated update on top).
"""
from __future__ import annotations

import os
import re
import sys
import time
from collections import deque

import torch
from torch import nn

import lbcomm
from bench.convergence import MAX_STATE_DEPTH, state_bytes


# OneBitLamb/decoded: the live ratio on the decoded direction's norm (norm_samples=0), the
# rule before the estimated norm: what the estimate costs, in the same process
KINDS = ("AdamW", "OneBitAdam", "Lamb", "OneBitLamb", "OneBitLamb/decoded", "ZeroOneAdam", "ZeroOneAdam/local")


def make(kind: str, params):
    if kind == "AdamW":
        return torch.optim.AdamW(params, lr=1e-3)
    if kind == "Lamb":
        return lbcomm.Lamb(params, lr=1e-3)
    if kind == "OneBitLamb/decoded":
        return lbcomm.OneBitLamb([{"params": list(params), "norm_samples": 0}], lr=1e-3, freeze_step=2)
    if kind == "ZeroOneAdam":
        return lbcomm.ZeroOneAdam(params, lr=1e-3, var_update_scaler=1)
    if kind == "ZeroOneAdam/local":
        return lbcomm.ZeroOneAdam(params, lr=1e-3, var_freeze_step=2)
    return getattr(lbcomm, kind)(params, lr=1e-3, freeze_step=2)


def breakdown(opt, model):
    """{name: bytes} of the tensors `state_bytes` counts, each storage under the shortest
    path from the optimizer that reaches it (piece and rank indices folded into [*], so
    that e.g. all wire buffers of one kind add up in one row)."""
    exclude = {q.untyped_storage().data_ptr() for q in model.parameters()}
    exclude |= {q.grad.untyped_storage().data_ptr() for q in model.parameters() if q.grad is not None}
    seen, visited, rows = set(), set(), {}
    todo = deque((k, v, 1) for k, v in vars(opt).items() if k != "param_groups")
    while todo:  # breadth first: each object at its least depth, state_bytes' depth limit
        path, o, depth = todo.popleft()
        if depth > MAX_STATE_DEPTH:
            continue
        if isinstance(o, torch.Tensor):
            ptr = o.untyped_storage().data_ptr()
            if ptr not in exclude and ptr not in seen:
                seen.add(ptr)
                name = re.sub(r"\[\d+\]", "[*]", path)
                rows[name] = rows.get(name, 0) + o.untyped_storage().nbytes()
            continue
        if id(o) in visited:
            continue
        if isinstance(o, dict):
            visited.add(id(o))
            todo.extend((f"{path}[{k if isinstance(k, (str, int)) else type(k).__name__}]", v, depth + 1)
                        for k, v in o.items())
        elif isinstance(o, tuple) and hasattr(o, "_fields"):
            visited.add(id(o))
            todo.extend((f"{path}.{k}", v, depth + 1) for k, v in zip(o._fields, o))
        elif isinstance(o, (list, tuple)):
            visited.add(id(o))
            todo.extend((f"{path}[{i}]", v, depth + 1) for i, v in enumerate(o))
        elif type(o).__module__.startswith("lbcomm"):
            visited.add(id(o))
            todo.extend((f"{path}.{k}", v, depth + 2) for k, v in vars(o).items())
    return rows


class _AllreduceThen:
    """torch.optim.AdamW after an fp32 allreduce of the gradients (one flat buffer): the
    step a 1-bit optimizer's compression stage replaces."""

    def __init__(self, params):
        self.params = list(params)
        self.opt = torch.optim.AdamW(self.params, lr=1e-3)

    def step(self):
        grads = [q.grad for q in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        flat.div_(torch.distributed.get_world_size())
        torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads)])
        self.opt.step()


def measure(rank, p, numel, steps=4, timed=0):
    """Every kind built and stepped past its freeze, its state counted; then `timed` rounds
    in which every kind takes one step in turn (so that load from other processes hits
    them alike), the median per kind."""
    torch.set_num_threads(1)
    out, built = {}, {}
    for kind in KINDS + ("AdamW+allreduce",):
        torch.manual_seed(0)
        width = 1024
        net = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(max(1, numel // width ** 2))])
        opt = _AllreduceThen(net.parameters()) if kind == "AdamW+allreduce" else make(kind, net.parameters())
        for t in range(steps):
            for q in net.parameters():
                q.grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(t * 10 + rank))
            opt.step()
        n = sum(q.numel() for q in net.parameters())
        target = opt.opt if kind == "AdamW+allreduce" else opt
        out[kind] = {"bytes": state_bytes(target, net)[0] / n,
                     "parts": {k: v / n for k, v in breakdown(target, net).items()}, "times": [], "cpu": []}
        built[kind] = opt
    for _ in range(timed):  # the compression stage's step (gradients already in place)
        for kind, opt in built.items():
            torch.distributed.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            opt.step()
            out[kind]["times"].append(time.perf_counter() - start)
            out[kind]["cpu"].append(time.process_time() - cpu)
    for r in out.values():
        for key, name in (("times", "step_ms"), ("cpu", "cpu_ms")):
            times = sorted(r.pop(key))
            r[name] = 1e3 * times[len(times) // 2] if times else None
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dist_util import run_ranks

    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 8 << 20
    timed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    res = run_ranks(measure, 4, numel, 4, timed, timeout=1800)
    print(f"resident optimizer state, bytes per parameter, 4 ranks, {numel} parameters (rank 0):")
    for kind, r in res[0].items():
        ms = "" if r["step_ms"] is None else (f"   step {r['step_ms']:7.1f} ms, cpu {r['cpu_ms']:7.1f} ms "
                                              f"(medians of {timed} rounds)")
        print(f"  {kind:<18} {r['bytes']:6.2f}{ms}")
        if abs(sum(r["parts"].values()) - r["bytes"]) > 1e-9:
            print(f"    (the breakdown adds up to {sum(r['parts'].values()):.2f})")
        small = sum(v for v in r["parts"].values() if v < 0.005)
        for name, v in sorted(r["parts"].items(), key=lambda kv: -kv[1]):
            if v >= 0.005:
                print(f"    {v:6.3f}  {name}")
        if small:
            print(f"    {small:6.3f}  (rows under 0.005 each: vectors, masks, counts)")
    if timed:  # cpu: the median over the ranks of each rank's median process time
        steps = {k: r["step_ms"] for k, r in res[0].items()}
        cpu = {k: sorted(rank[k]["cpu_ms"] for rank in res)[len(res) // 2] for k in steps}
        for one, twin in (("OneBitAdam", "AdamW+allreduce"), ("OneBitLamb", "Lamb"), ("ZeroOneAdam", "AdamW+allreduce"),
                          ("ZeroOneAdam/local", "AdamW+allreduce"), ("OneBitLamb", "OneBitLamb/decoded")):
            print(f"step {one} / {twin}: {steps[one] / steps[twin]:.2f} (cpu {cpu[one] / cpu[twin]:.2f})")
