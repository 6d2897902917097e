"""The convergence suite's runs (bench/suite.py): what each method is and one run of it.

The method tables (each 1-bit method's full-precision twin, its lr grid family, its
label), `build` (the model and optimizer of one method at one lr), `one_run` (one training
run of a task on this rank: final and initial validation loss, divergence, the first
compressed update, bytes sent) and `rank_main`, which runs a whole grid on one of the
spawned gloo ranks. The tables of the results are in bench/suite_report.py; the CLI in
bench/suite.py, which re-exports these names.
"""
from __future__ import annotations

import datetime
import functools
import itertools
import json
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lbcomm
from lbcomm.config import COMM_FIELDS
from lbcomm.common import ring_allreduce_bytes

from .cli_options import construct, optimizer_options
from . import tasks as T
from .convergence_run import average_grads, zeroone_local_step_scaler

METHODS = ("adamw", "onebit_adam", "lamb", "onebit_lamb", "sgd", "sgd_hook", "sgd_mom_hook", "lars", "lars_hook")
EXTRA_METHODS = ("adamw_hook", "zeroone")  # on request only: DDP + onebit_hook + torch AdamW; 0/1 Adam
TWIN = {"onebit_adam": "adamw", "onebit_lamb": "lamb", "sgd_hook": "sgd", "sgd_mom_hook": "sgd", "lars_hook": "lars",
        "adamw_hook": "adamw", "zeroone": "adamw"}
FAMILY = {"adamw": "adam", "onebit_adam": "adam", "lamb": "lamb", "onebit_lamb": "lamb", "sgd": "sgd",
          "sgd_hook": "sgd", "sgd_mom_hook": "sgd", "lars": "lars", "lars_hook": "lars", "adamw_hook": "adam",
          "zeroone": "adam"}
LABEL = {"adamw": "AdamW", "onebit_adam": "OneBitAdam", "lamb": "Lamb", "onebit_lamb": "OneBitLamb",
         "sgd": "SGD+DDP", "sgd_hook": "SGD+onebit_hook", "sgd_mom_hook": "SGD+hook(mom)", "lars": "Lars",
         "lars_hook": "Lars+onebit_hook", "adamw_hook": "AdamW+onebit_hook", "zeroone": "ZeroOneAdam"}
LARS_TRUST = 0.02  # trust_coefficient of the LARS runs (their lr grid is tasks.GRIDS["lars"])
QUICK_TASKS = ("rare_features", "dead_relu", "zipf_embed")
SGD_MOMENTUM = 0.9
HOOKS = ("sgd_hook", "sgd_mom_hook", "lars_hook", "adamw_hook")
# sgd_mom_hook: the hook as README recommends it for SGD momentum (its momentum = SGD's)
MOM_HOOK = {"momentum": SGD_MOMENTUM, "normalize": "adaptive"}
ORDER_STRIDE = 1_000_003  # --repeats: order k reads the task's batches of steps k * ORDER_STRIDE + step


def lars_options(a) -> dict:
    """--lars-options as lbcomm.Lars arguments: "exclude_over": N excludes the tensors of
    more than N elements (and, as the default rule, those of at most one dimension) from the
    trust ratio: with the hook's exact_numel, the compressed ones."""
    opts = dict(a.lars_options)
    if "exclude_over" in opts:
        n = opts.pop("exclude_over")
        opts["exclude_from_adaptation"] = functools.partial(_dim1_or_over, n=n)
    return opts


def _dim1_or_over(p, n) -> bool:
    return p.dim() <= 1 or p.numel() > n


def freeze_of(task, a=None, hook: bool = False):
    """The step of the 1-bit methods' freeze (ZeroOneAdam's var_freeze_step, the hooks'
    start): `--freeze-at` of the run, 25 % by default; "auto" for the optimizers with
    `--freeze-at auto` (the hooks keep 25 %)."""
    at = getattr(a, "freeze_at", 0.25)
    if at == "auto":
        if not hook:
            return "auto"
        at = 0.25
    return max(2, round(at * task.steps))


# the optimizer class (or factory: called as the class) of each lbcomm method; build() and
# one_run() take a mapping that overrides some of them (bench.parity passes variants)
CLASSES = {"onebit_adam": lbcomm.OneBitAdam, "onebit_lamb": lbcomm.OneBitLamb, "zeroone": lbcomm.ZeroOneAdam}


def build(method, model, lr, task, world, a, classes=None):
    """(model to call, optimizer) for one run; `classes` overrides entries of CLASSES."""
    betas, wd = (0.9, task.beta2), task.weight_decay
    # non-finite steps raise (NonFiniteError marks the run diverged, below)
    extra = optimizer_options(a.onebit_options, nonfinite="raise")
    cls = {**CLASSES, **(classes or {})}
    adam_cls, lamb_cls = cls["onebit_adam"], cls["onebit_lamb"]
    if method == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=wd)
    if method == "onebit_adam":
        return model, construct(adam_cls, model.parameters(), lr=lr, betas=betas, weight_decay=wd,
                                freeze_step=freeze_of(task, a), **extra)
    if method == "zeroone":  # var_freeze_step at 25 % as the others' freeze; alpha scaled to the run
        opts = optimizer_options({"local_step_scaler": zeroone_local_step_scaler(task.steps),
                                  **a.zeroone_options}, nonfinite="raise")
        return model, cls["zeroone"](model.parameters(), lr=lr, betas=betas, weight_decay=wd,
                                         var_freeze_step=freeze_of(task, a), **opts)
    if method == "lamb":
        return model, lbcomm.Lamb(model.parameters(), lr=lr, betas=betas, weight_decay=wd,
                                  comm=lbcomm.CommConfig(nonfinite="raise"))
    if method == "onebit_lamb":
        return model, construct(lamb_cls, model.parameters(), lr=lr, betas=betas, weight_decay=wd,
                                freeze_step=freeze_of(task, a), **extra)
    def lars(grads_averaged=False):
        return lbcomm.Lars(model.parameters(), lr=lr, weight_decay=wd, trust_coefficient=LARS_TRUST,
                           grads_averaged=grads_averaged, **optimizer_options(lars_options(a), nonfinite="raise"))

    if method == "lars":
        return model, lars()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    extra = a.hook_options
    if method in HOOKS:
        base = MOM_HOOK if method == "sgd_mom_hook" else {}
        # its bytes are reported
        opts = {**base, **extra}
        # hook options that go to comm= (OneBitOptions' math is not a hook's)
        comm = lbcomm.CommConfig(**{k: opts.pop(k) for k in list(opts) if k in COMM_FIELDS})
        ddp.hook_state = lbcomm.OneBitHookState(freeze_of(task, a, hook=True), **opts, comm=comm)
        ddp.register_comm_hook(ddp.hook_state, lbcomm.onebit_hook)
    if method == "lars_hook":  # onebit_hook averages the gradients: Lars does not average them again
        return ddp, lars(grads_averaged=True)
    if method == "adamw_hook":
        return ddp, torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=wd)
    return ddp, torch.optim.SGD(model.parameters(), lr=lr, momentum=SGD_MOMENTUM)


def in_order(batches, k):
    """Batch order k of a task: step s reads the batch of step s + k * ORDER_STRIDE (order 0:
    the task's own); the same data, other draws."""
    return batches if k == 0 else functools.partial(lambda step, k: batches(step + k * ORDER_STRIDE), k=k)


def one_run(rank, world, task, method, lr, a, classes=None):
    model = task.make_model()
    net, opt = build(method, model, lr, task, world, a, classes)
    init = T.evaluate(task, model)
    steps, freeze = task.steps, freeze_of(task, a)
    schedule = getattr(a, "schedule", "cosine")
    diverged, first_ratio, first_pmax, frozen_at = None, None, None, None
    every, trajectory = getattr(a, "trajectory", 0), []  # validation loss every `every` steps
    for step in range(steps):
        part = T.rank_step(task, opt, lr, schedule, step, rank, world)
        cur = opt.param_groups[0]["lr"]
        opt.zero_grad(set_to_none=True)
        loss = task.loss(net, part)
        loss.backward()
        if method in ("adamw",):
            average_grads(model, world)
        before = [p.detach().clone() for p in model.parameters()] if step == freeze else None
        if before is not None:
            first_pmax = max(float(b.abs().max()) for b in before)
        try:
            opt.step()
        except lbcomm.NonFiniteError:
            diverged = step + 1
            break
        if frozen_at is None and getattr(opt, "local_steps_started", getattr(opt, "frozen", False)):
            frozen_at = opt.global_step
        if before is not None:  # the first compressed step: largest |update| per coordinate / lr
            first_ratio = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before)) / cur
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            diverged = step + 1
            break
        if every and (step + 1) % every == 0 and step + 1 < steps:
            trajectory.append([step + 1, T.evaluate(task, model)])
    final = float("nan") if diverged else T.evaluate(task, model)
    hook = getattr(net, "hook_state", None)
    sent = None if hook is None else hook.compression_stats()  # this rank's bytes, start included
    if hasattr(opt, "comm_stats"):  # ZeroOneAdam counts its own bytes; against fp32 ring allreduces
        numel = sum(q.numel() for q in model.parameters())
        sent = {"bytes_sent": opt.comm_stats()["bytes_sent"],
                "bytes_uncompressed": round((diverged or steps) * ring_allreduce_bytes(4 * numel, world))}
    return {"task": task.name, "method": method, "lr": lr, "final": final, "init": init, "diverged": diverged,
            "bytes_sent": None if sent is None else sent["bytes_sent"],
            "bytes_uncompressed": None if sent is None else sent["bytes_uncompressed"],
            "first_update_ratio": first_ratio, "frozen_at": frozen_at, "param_max_at_first_update": first_pmax,
            "max_param": None if diverged else max(float(p.detach().abs().max()) for p in model.parameters()),
            **({"trajectory": trajectory + [[steps, final]]} if every else {})}


def rank_main(rank, world, a, out_path, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    results = []
    for name in a.tasks:
        task = T.make_task(name, quick=a.quick, seed=a.seed, grid=a.grid, steps=a.steps)
        batches = task.batch
        for method in a.methods:
            lrs = [lr for lr in task.grids[FAMILY[method]] if not a.lrs or any(math.isclose(lr, x) for x in a.lrs)]
            for lr, rep in itertools.product(lrs, range(a.repeats)):
                task.batch = in_order(batches, rep)
                t0 = time.perf_counter()
                r = one_run(rank, world, task, method, lr, a)
                r["seconds"] = time.perf_counter() - t0
                r["repeat"] = rep
                results.append(r)
                if rank == 0:
                    print(f"  {name:<14}{LABEL[method]:<16}lr {lr:<7g}"
                          + (f" order {rep}" if a.repeats > 1 else "") + f" final {r['final']:.4f}"
                          + (f"  DIVERGED at step {r['diverged']}" if r["diverged"] else "")
                          + (f"  first compressed update {r['first_update_ratio']:.3g} lr"
                             if r["first_update_ratio"] is not None else "")
                          + f"  ({r['seconds']:.1f} s)"
                          + ("\n      val loss by step: " + " ".join(f"{st}:{v:.4f}" for st, v in r["trajectory"])
                             if "trajectory" in r else ""), flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(fn, ranks: int, *args):
    """Run ``fn(rank, ranks, *args, out_path, init_file)`` on `ranks` spawned processes and
    return what rank 0 wrote to out_path (JSON)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "results.json")
        mp.start_processes(fn, args=(ranks, *args, out, os.path.join(d, "init")), nprocs=ranks, start_method="spawn")
        with open(out) as f:
            return json.load(f)
