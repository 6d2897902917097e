"""DCT data parallelism: DDP + dct_hook against fp32 DDP and DDP + onebit_hook.

On real gloo ranks (2 by default), for each task of bench/tasks.py asked for (zipf_embed,
the embedding table with Zipf-distributed rows, by default) and each lr: the same model,
samples and torch.optim.SGD(momentum 0.9) at the same lr with

    ddp     DDP's fp32 allreduce (the baseline)
    onebit  lbcomm.onebit_hook (default settings)
    dct     lbcomm.dct_hook at each --densities value

both hooks compressing from the same iteration (--start, a share of the steps). Printed
per run: the final validation loss and its ratio to ddp's at the same lr (target: DCT
within 2 %), the bytes a rank sent per compressed step and ddp's bytes per step over them
(target: DCT >= 100x less), the share of entries DCT sent (sent_fraction), and the whole
run's bytes including the full-precision start. --cost times one reduction of the task's
gradient size on the loopback: the DCT exchange (a refresh call and a plain one) and the
one-bit call against the fp32 allreduce, median of --repeats calls.

    python -m bench.dct                                   # zipf_embed, lr 0.3 and 1, densities 0.01 and 0.005
    python -m bench.dct --tasks zipf_embed,rare_features --lrs 0.3 --cost
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist

import lbcomm
from lbcomm.comm import get_transport
from lbcomm.common import ring_allreduce_bytes
from lbcomm.dct import DCTReducer

from . import tasks as T
from .suite import spawn_ranks

SGD_MOMENTUM = 0.9


def start_of(task, a) -> int:
    return max(2, round(a.start * task.steps))


def one_run(rank, world, task, method, density, lr, a):
    model = task.make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = None
    if method == "onebit":
        state = lbcomm.OneBitHookState(start_of(task, a))
        ddp.register_comm_hook(state, lbcomm.onebit_hook)
    elif method == "dct":
        state = lbcomm.DCTHookState(start_of(task, a), density=density, refresh_every=a.refresh_every,
                                    comm=lbcomm.CommConfig(exact_numel=a.exact_numel))
        ddp.register_comm_hook(state, lbcomm.dct_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=SGD_MOMENTUM)
    numel = sum(p.numel() for p in model.parameters())
    start, sent_at_start = start_of(task, a), None
    for step in range(task.steps):
        if step == start and state is not None:
            sent_at_start = state.compression_stats()["bytes_sent"]
        for g in opt.param_groups:
            g["lr"] = lr * T.schedule_factor("cosine", step, task.steps)
        batch = task.batch(step)
        per = batch[0].shape[0] // world
        part = tuple(t[rank * per:(rank + 1) * per] for t in batch)
        opt.zero_grad(set_to_none=True)
        task.loss(ddp, part).backward()
        opt.step()
    ring = ring_allreduce_bytes(4 * numel, world)
    stats = state.compression_stats() if state is not None else {}
    compressed = task.steps - start
    total = stats.get("bytes_sent", ring * task.steps)
    per_step = ring if state is None else (total - sent_at_start) / compressed
    return {"task": task.name, "method": method, "density": density, "lr": lr, "final": T.evaluate(task, model),
            "bytes_per_step": per_step, "ddp_bytes_per_step": ring, "bytes_total": total,
            "sent_fraction": stats.get("sent_fraction")}


def cost(rank, world, numel, a):
    """Seconds per call of the reductions of a `numel` gradient (median over repeats)."""
    tr = get_transport(backend="torch")
    g = torch.Generator().manual_seed(rank)
    grad = torch.randn(numel, generator=g) * (torch.rand(numel, generator=g) < 0.1)  # sparse-ish, like rows
    out, times = torch.empty(numel), {}
    red = DCTReducer(numel, tr, density=a.densities[-1], refresh_every=1)
    plain = DCTReducer(numel, tr, density=a.densities[-1], refresh_every=10**9)
    onebit = lbcomm.make_reducer(numel, lbcomm.CommConfig(), transport=tr)
    plain.reduce_(grad, out)  # its one refresh
    calls = {"fp32 allreduce": lambda: tr.all_reduce(grad.clone(), "mean"),
             "dct (refresh call)": lambda: red.reduce_(grad, out),
             "dct (plain call)": lambda: plain.reduce_(grad, out),
             "onebit": lambda: onebit.reduce_(grad, out)}
    for _ in range(a.repeats):
        for name, call in calls.items():  # interleaved: the load shifts every method alike
            tr.barrier()
            t0 = time.perf_counter()
            call()
            times.setdefault(name, []).append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def rank_main(rank, world, a, out_path, init_file):
    import json

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    results, costs = [], {}
    for name in a.tasks:
        task = T.make_task(name, quick=a.quick)
        if a.steps:
            task.steps = a.steps
        for lr in a.lrs:
            runs = [("ddp", None), ("onebit", None)] + [("dct", d) for d in a.densities]
            for method, density in runs:
                t0 = time.perf_counter()
                r = one_run(rank, world, task, method, density, lr, a)
                r["seconds"] = time.perf_counter() - t0
                results.append(r)
                if rank == 0:
                    print(f"  {name:<14}{method:<7}{'' if density is None else density:<7}lr {lr:<5g} final "
                          f"{r['final']:.4f}  {r['bytes_per_step']:.0f} B/step  ({r['seconds']:.1f} s)", flush=True)
        if a.cost:
            costs[name] = cost(rank, world, sum(p.numel() for p in task.make_model().parameters()), a)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"results": results, "costs": costs}, f)
    dist.barrier()
    dist.destroy_process_group()


def report(out, a) -> None:
    res = out["results"]
    print(f"\n{a.ranks} ranks, SGD momentum {SGD_MOMENTUM}, cosine schedule, compression from {a.start:.0%} of the "
          f"steps, refresh_every {a.refresh_every}, DCT exact_numel {a.exact_numel}")
    print(f"{'task':<14}{'lr':<6}{'method':<13}{'final':>8}{'/ ddp':>8}{'B/step':>10}{'ddp / it':>10}"
          f"{'sent frac':>10}{'run bytes / ddp':>17}")
    for r in res:
        base = next(b for b in res if b["task"] == r["task"] and b["lr"] == r["lr"] and b["method"] == "ddp")
        label = r["method"] + ("" if r["density"] is None else f" {r['density']}")
        frac = "" if r["sent_fraction"] is None else f"{r['sent_fraction']:.4f}"
        print(f"{r['task']:<14}{r['lr']:<6g}{label:<13}{r['final']:>8.4f}{r['final'] / base['final']:>8.3f}"
              f"{r['bytes_per_step']:>10.0f}{r['ddp_bytes_per_step'] / r['bytes_per_step']:>9.1f}x{frac:>10}"
              f"{base['bytes_total'] / r['bytes_total']:>16.1f}x")
    for name, c in out["costs"].items():
        base = c["fp32 allreduce"]
        print(f"\nstep cost on the loopback, {name}'s gradient size, {a.ranks} ranks (median of {a.repeats}): "
              + ", ".join(f"{k} {v * 1e3:.2f} ms ({base / v:.2f}x fp32's speed)" for k, v in c.items()))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.dct", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tasks", default="zipf_embed", help=f"comma list of {', '.join(T.TASKS)}")
    p.add_argument("--lrs", default="0.3,1.0", help="comma list of SGD lrs (every method at each)")
    p.add_argument("--densities", default="0.01,0.005", help="comma list of DCT densities")
    p.add_argument("--refresh-every", type=int, default=50, help="DCT's refresh_every (iterations)")
    p.add_argument("--exact-numel", type=int, default=0,
                   help="DCT's CommConfig(exact_numel): parameters of at most that many elements averaged exactly "
                   "(default 0: every gradient sparsified)")
    p.add_argument("--start", type=float, default=0.1, help="share of the steps at full precision first")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="steps per run (default: the task's)")
    p.add_argument("--quick", action="store_true", help="the tasks' short runs (80 steps)")
    p.add_argument("--cost", action="store_true", help="also time one reduction of each task's gradient size")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per method with --cost")
    a = p.parse_args(argv)
    a.tasks = [t for t in a.tasks.split(",") if t]
    a.lrs = [float(x) for x in a.lrs.split(",") if x]
    a.densities = [float(x) for x in a.densities.split(",") if x]
    unknown = [t for t in a.tasks if t not in T.TASKS]
    if unknown:
        p.error(f"unknown task: {unknown}")
    if not 0 < a.start < 1:
        p.error(f"--start must be in (0, 1), got {a.start}")
    return a


def main(argv=None):
    a = parse_args(argv)
    t0 = time.perf_counter()
    out = spawn_ranks(rank_main, a.ranks, a)
    report(out, a)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return out


if __name__ == "__main__":
    main()
