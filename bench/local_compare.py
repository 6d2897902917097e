"""Local updates: lbcomm.OneBitLocalUpdates against torchft's DiLoCo, on the suite's tasks.

Every method trains the task's model from the same weights on the same samples (4 gloo
ranks, each its quarter of the global batch at every step, AdamW inner optimizer with the
task's weight decay and the suite's cosine schedule, best of the Adam lr grid), for a
number of steps that is a multiple of H so that every run ends on a synchronization:

    ddp          data-parallel AdamW, an fp32 allreduce of the gradients every step (context)
    torchft      torchft.local_sgd.DiLoCo at H (Manager with a synchronous quorum, an
                 in-process LighthouseServer, one replica group per process, gloo),
                 outer Nesterov SGD, lr --outer-lr (0.7) and momentum --outer-momentum (0.9);
                 --outer-lr 1 --outer-momentum 0 is plain averaging (local SGD), for every method
    fp32         OneBitLocalUpdates(compress=False) at H: the same algorithm as torchft's,
                 the same code as the 1-bit mode (a check that the outer loops agree)
    onebit       OneBitLocalUpdates at H: 1-bit outer pseudo-gradients, same H
    onebit_bytes OneBitLocalUpdates at the smallest power of two H' at which it sends at most
                 torchft's bytes per step at H (about H / 32 for a large model; more where
                 exact_numel's small tensors, averaged in fp32, are a large part of it)

Printed per task: best-of-grid final validation loss, its ratio to torchft's, the mean
validation loss over the synchronization points of the best run (convergence per step) and
the bytes one rank sent (convergence per byte), torchft's counted as an fp32 ring allreduce
of the pseudo-gradient per synchronization; and, at each lr, the largest |θ_fp32 − θ_torchft|
after the last sync.

    python -m bench.local_compare                      # 3 tasks, 256 steps, H = 32
    python -m bench.local_compare --tasks dead_relu --lrs 0.003 --methods torchft,fp32
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time

import torch
import torch.distributed as dist

import lbcomm
from lbcomm.common import ring_allreduce_bytes

from . import tasks as T
from .suite import QUICK_TASKS, spawn_ranks

METHODS = ("ddp", "torchft", "fp32", "onebit", "onebit_bytes")
BASE = "torchft"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.local_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default=",".join(QUICK_TASKS), help="comma-separated tasks of bench/tasks.py")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {METHODS}")
    p.add_argument("--sync-every", type=int, default=32, help="H of torchft, fp32 and onebit (default: 32)")
    p.add_argument("--steps", type=int, default=256, help="inner steps, a multiple of H (default: 256)")
    p.add_argument("--lrs", default=None, help="comma-separated inner lrs (default: the tasks' Adam grid)")
    p.add_argument("--ranks", type=int, default=4, help="gloo ranks (default: 4)")
    p.add_argument("--seed", type=int, default=0, help="task seed (default: 0)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer SGD lr of every local-update method "
                   "(default: 0.7, DiLoCo's)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="outer SGD momentum, Nesterov when > 0 "
                   "(default: 0.9, DiLoCo's)")
    p.add_argument("--json", default=None, help="write the results to this file")
    a = p.parse_args(argv)
    a.tasks = a.tasks.split(",")
    a.methods = a.methods.split(",")
    bad = [m for m in a.methods if m not in METHODS]
    if bad:
        p.error(f"unknown methods {bad}; use {METHODS}")
    if a.steps % a.sync_every:
        p.error("--steps must be a multiple of --sync-every (every run ends on a synchronization)")
    a.lrs = None if a.lrs is None else [float(x) for x in a.lrs.split(",")]
    return a


def _h(method, a, model, inner) -> int:
    """H of a run; for onebit_bytes the smallest power of two H' at which the 1-bit mode
    sends at most torchft's bytes per step at H: H' >= H * (1-bit bytes per sync) / (fp32
    bytes per sync), measured on this model (its exact_numel part is fp32)."""
    H = a.sync_every
    if method != "onebit_bytes":
        return H
    probe = lbcomm.OneBitLocalUpdates(model.parameters(), inner, 1)
    need = H * probe.bytes_per_sync() / max(1, probe.fp32_bytes_per_step())
    return min(H, 1 << max(0, math.ceil(math.log2(max(need, 1)))))


class _TorchFT:
    """One torchft Manager per process (its own replica group of one rank), reused by
    every run; a fresh DiLoCo per run."""

    def __init__(self, rank, world, lighthouse):
        from torch.distributed import TCPStore
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self.store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(pg=ProcessGroupGloo(), load_state_dict=None, state_dict=None, min_replica_size=world,
                               use_async_quorum=False, replica_id=f"local_compare_{rank}", store_addr="localhost",
                               store_port=self.store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                               init_sync=False, timeout=datetime.timedelta(seconds=300))

    def diloco(self, model, inner, H, a):
        from torchft.local_sgd import DiLoCo

        # a fresh DiLoCo registers its fragment's state under the same key: drop the last run's
        for d in (self.manager._load_state_dict_fns, self.manager._user_state_dicts):
            d.pop("StreamingDiLoCoFragment_0", None)
        outer = torch.optim.SGD(model.parameters(), lr=a.outer_lr, momentum=a.outer_momentum,
                                nesterov=a.outer_momentum > 0)
        return DiLoCo(self.manager, [model], inner, outer, sync_every=H)


def one_run(rank, world, task, method, lr, a, ft):
    model = task.make_model()
    n = sum(p.numel() for p in model.parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, task.beta2), weight_decay=task.weight_decay)
    H, steps = _h(method, a, model, inner), a.steps
    local, ctx = None, None
    if method in ("fp32", "onebit", "onebit_bytes"):
        local = lbcomm.OneBitLocalUpdates(model.parameters(), inner, H, compress=method != "fp32",
                                          outer_lr=a.outer_lr, outer_momentum=a.outer_momentum,
                                          comm=lbcomm.CommConfig(nonfinite="raise"))
    elif method == "torchft":
        ctx = ft.diloco(model, inner, H, a)
        ctx.__enter__()
    curve, diverged = [], None
    try:
        for step in range(steps):
            for g in inner.param_groups:
                g["lr"] = lr * T.schedule_factor("cosine", step, steps)
            batch = task.batch(step)
            per = batch[0].shape[0] // world
            part = tuple(t[rank * per:(rank + 1) * per] for t in batch)
            inner.zero_grad(set_to_none=True)
            task.loss(model, part).backward()
            if method == "ddp":
                grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                dist.all_reduce(grads)
                grads.div_(world)
                o = 0
                for p in model.parameters():
                    p.grad.copy_(grads[o:o + p.numel()].view_as(p))
                    o += p.numel()
            try:
                inner.step()  # torchft's DiLoCo synchronizes in the inner optimizer's post hook
                if local is not None:
                    local.step()
            except lbcomm.NonFiniteError:
                diverged = step + 1
                break
            if (step + 1) % a.sync_every == 0:
                curve.append(T.evaluate(task, model))
                if not math.isfinite(curve[-1]):
                    diverged = step + 1
                    break
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    if method == "ddp":
        sent = steps * ring_allreduce_bytes(4 * n, world)
    elif method == "torchft":
        sent = steps // H * ring_allreduce_bytes(4 * n, world)
    else:
        sent = local.compression_stats()["bytes_sent"]
    final = float("nan") if diverged else curve[-1]
    return {"task": task.name, "method": method, "lr": lr, "H": H, "final": final, "curve": curve,
            "diverged": diverged, "bytes_sent": int(sent), "numel": n}, torch.cat(
                [p.detach().reshape(-1) for p in model.parameters()])


def rank_main(rank, world, a, lighthouse, out_path, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    ft = _TorchFT(rank, world, lighthouse) if "torchft" in a.methods else None
    results, last = [], {}
    for name in a.tasks:
        task = T.make_task(name, seed=a.seed)
        last = {}  # (method, lr) -> the final weights of fp32 and torchft
        for method in a.methods:
            for lr in a.lrs or task.grids["adam"]:
                t0 = time.perf_counter()
                r, theta = one_run(rank, world, task, method, lr, a, ft)
                if method in ("fp32", BASE):  # the same algorithm twice: how far apart they end
                    last[method, lr] = theta
                    other = last.get(("fp32" if method == BASE else BASE, lr))
                    if other is not None:
                        r["fp32_vs_torchft"] = float((theta - other).abs().max())
                results.append(r)
                if rank == 0:
                    print(f"  {name:<14}{method:<13}H {r['H']:<3} lr {lr:<7g} final {r['final']:.4f}  "
                          f"bytes {r['bytes_sent']:.3g}" + (f"  DIVERGED at {r['diverged']}" if r["diverged"] else "")
                          + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    if ft is not None:
        ft.manager.shutdown(wait=False)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def report(results, a) -> None:
    def best(task, method):
        ok = [r for r in results if r["task"] == task and r["method"] == method and math.isfinite(r["final"])]
        return min(ok, key=lambda r: r["final"]) if ok else None

    cols = [m for m in a.methods]
    print(f"\nbest-of-grid final validation loss (ratio to {BASE} where it ran), mean loss over the syncs, "
          "bytes one rank sent")
    for task in a.tasks:
        base = best(task, BASE) if BASE in cols else None
        print(f"\n{task}")
        print(f"  {'method':<13}{'H':>4}{'lr':>8}{'final':>9}{'ratio':>8}{'curve mean':>12}{'bytes':>11}{'bytes/base':>12}")
        for m in cols:
            r = best(task, m)
            if r is None:
                print(f"  {m:<13} every lr diverged")
                continue
            ratio = f"{r['final'] / base['final']:.3f}" if base else "-"
            mean = sum(r["curve"]) / len(r["curve"])
            bratio = f"{r['bytes_sent'] / base['bytes_sent']:.4f}" if base else "-"
            print(f"  {m:<13}{r['H']:>4}{r['lr']:>8g}{r['final']:>9.4f}{ratio:>8}{mean:>12.4f}"
                  f"{r['bytes_sent']:>11.3g}{bratio:>12}")
        for r in results:
            if r["task"] == task and "fp32_vs_torchft" in r:
                print(f"  lr {r['lr']:g}: max |θ_fp32 − θ_torchft| after the last sync = {r['fp32_vs_torchft']:.3g}")


def main(argv=None):
    a = parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO
    t0 = time.perf_counter()
    lighthouse = None
    if "torchft" in a.methods:
        from torchft._torchft import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=a.ranks)
    try:
        results = spawn_ranks(rank_main, a.ranks, a, None if lighthouse is None else lighthouse.address())
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    report(results, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return results


if __name__ == "__main__":
    main()
