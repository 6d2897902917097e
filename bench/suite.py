"""Convergence suite: every task of bench/tasks.py, real optimizers on real gloo ranks.

For each task and each pair (full precision vs 1-bit)

    AdamW (gradients allreduced)          vs  lbcomm.OneBitAdam
    lbcomm.Lamb                           vs  lbcomm.OneBitLamb
    DDP + torch.optim.SGD(momentum 0.9)   vs  DDP + lbcomm.onebit_hook + the same SGD
    DDP + torch.optim.SGD(momentum 0.9)   vs  the same with OneBitHookState(momentum=0.9,
                                              normalize="adaptive"): the hook for SGD momentum
    lbcomm.Lars                           vs  DDP + lbcomm.onebit_hook + lbcomm.Lars
    AdamW                                 vs  DDP + lbcomm.onebit_hook + AdamW (adamw_hook, on request)
    AdamW                                 vs  lbcomm.ZeroOneAdam (zeroone, on request)

every lr of the task's small grid is run from the same initial weights on the same samples
(4 gloo ranks, each its quarter of the global batch; variance frozen / compression started
after 25 % of the steps; the lr schedule of --schedule, by default 10 % linear warmup and
cosine decay, both twins alike). Printed: best-of-grid final validation loss per method, the
ratio of each 1-bit method to its twin (target: within 5 %, 1 % on the byte LM), the lrs
at which a 1-bit method diverged while its twin did not (target: none), the largest
first compressed update per coordinate in units of lr, and the same-lr ratios: 1-bit /
twin at every lr of the grid (a user who keeps the twin's lr) and the worst such cell per
task, against the same targets. Written: a PNG of the best-of-grid ratios.

    python -m bench.suite                     # all tasks, the fine lr grids: about 15 minutes on 2 cores
    python -m bench.suite --grid coarse       # 4 lrs per grid instead of 7 (the figures of earlier rounds)
    python -m bench.suite --quick             # 3 tasks, short runs, coarse grids: the regression guard
    python -m bench.suite --onebit-options '{"mask_threshold": 1e-3}'   # options of both 1-bit optimizers
    python -m bench.suite --tasks dead_relu --repeats 3   # each lr's loss: the mean over 3 batch orders
    python -m bench.suite --schedule long_warmup --methods lamb,onebit_lamb
                                              # the lr still rising for a quarter of the run after the freeze
    python -m bench.suite --methods lars,lars_hook --lars-options '{"exclude_over": 4096}'
                                              # Lars with the tensors of > 4096 elements off the trust ratio
    python -m bench.suite --report bench/results/suite_fine_adam_rescale_cap_seed{0,1,2}.json
                                              # the tables of saved runs (--json), without running; with
                                              # several, also their same-lr cells together (worst over the
                                              # seeds, cells over target, and those where the twin converged)
"""
from __future__ import annotations

import argparse
import datetime
import dataclasses
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
from lbcomm.common import ring_allreduce_bytes

from .cli_options import construct, json_options, optimizer_options
from . import tasks as T
from .convergence import average_grads, zeroone_local_step_scaler

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
COMM_FIELDS = {f.name for f in dataclasses.fields(lbcomm.CommConfig)}  # hook options that go to comm=
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
        comm = lbcomm.CommConfig(**{k: opts.pop(k) for k in list(opts) if k in COMM_FIELDS})
        ddp.hook_state = lbcomm.OneBitHookState(freeze_of(task, a, hook=True), **opts, comm=comm)
        ddp.register_comm_hook(ddp.hook_state, lbcomm.onebit_hook)
    if method == "lars_hook":  # onebit_hook averages the gradients: Lars does not average them again
        return ddp, lars(grads_averaged=True)
    if method == "adamw_hook":
        return ddp, torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=wd)
    return ddp, torch.optim.SGD(model.parameters(), lr=lr, momentum=SGD_MOMENTUM)


def _freeze_at(text: str):
    return "auto" if text == "auto" else float(text)


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
        cur = lr * T.schedule_factor(schedule, step, steps)
        for g in opt.param_groups:
            g["lr"] = cur
        batch = task.batch(step)
        per = batch[0].shape[0] // world
        part = tuple(t[rank * per:(rank + 1) * per] for t in batch)
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


def is_diverged(r) -> bool:
    """Non-finite, or the run ended worse than the initial model."""
    return bool(r["diverged"]) or not math.isfinite(r["final"]) or r["final"] > r["init"]


def over_orders(results):
    """One record per (task, method, lr): the final loss is the mean over its batch orders
    (``--repeats``), non-finite if any order diverged."""
    groups = {}
    for r in results:
        groups.setdefault((r["task"], r["method"], r["lr"]), []).append(r)
    out = []
    for rs in groups.values():
        finals = [r["final"] for r in rs]
        ratios = [r["first_update_ratio"] for r in rs if r["first_update_ratio"] is not None]
        out.append({**rs[0], "final": sum(finals) / len(finals), "finals": finals,
                    "diverged": next((r["diverged"] for r in rs if r["diverged"]), None),
                    "first_update_ratio": max(ratios) if ratios else None})
    return out


def summarize(results):
    """{task: {method: (best final, lr, [lrs diverged while the twin did not])}}."""
    results = over_orders(results)
    out = {}
    for t in dict.fromkeys(r["task"] for r in results):
        out[t] = {}
        for m in dict.fromkeys(r["method"] for r in results):
            rs = [r for r in results if r["task"] == t and r["method"] == m]
            ok = [r for r in rs if not is_diverged(r)]
            best = min(ok, key=lambda r: r["final"]) if ok else None
            twin = {r["lr"]: is_diverged(r) for r in results if r["task"] == t and r["method"] == TWIN.get(m)}
            bad = [r["lr"] for r in rs if is_diverged(r) and m in TWIN and not twin.get(r["lr"], True)]
            first = max((r["first_update_ratio"] for r in rs if r["first_update_ratio"] is not None), default=None)
            out[t][m] = (best["final"] if best else float("inf"), best["lr"] if best else None, bad, first)
    return out


def same_lr(results):
    """{task: {method: {"cells": [[lr, ratio or None, mark], ...], "worst": ratio, "worst_lr": lr}}}
    for every 1-bit method whose twin ran: the ratio final / twin's final at the same lr, at
    every lr of the grid. mark "twin-div": the twin diverged at that lr (ratio None, not
    counted); "div": the 1-bit method diverged where the twin did not (ratio inf, counted)."""
    results = over_orders(results)
    by = {(r["task"], r["method"], r["lr"]): r for r in results}
    out = {}
    for t in dict.fromkeys(r["task"] for r in results):
        for m in dict.fromkeys(r["method"] for r in results):
            base = TWIN.get(m)
            lrs = [r["lr"] for r in results if r["task"] == t and r["method"] == m]
            if base is None or not any((t, base, lr) in by for lr in lrs):
                continue
            cells = []
            for lr in lrs:
                mine, twin = by[(t, m, lr)], by.get((t, base, lr))
                if twin is None:
                    continue
                if is_diverged(twin):
                    cells.append([lr, None, "twin-div"])
                elif is_diverged(mine):
                    cells.append([lr, math.inf, "div"])
                else:
                    cells.append([lr, mine["final"] / twin["final"], ""])
            counted = [c for c in cells if c[1] is not None]
            worst = max(counted, key=lambda c: c[1]) if counted else None
            out.setdefault(t, {})[m] = {"cells": cells, "worst": worst[1] if worst else None,
                                        "worst_lr": worst[0] if worst else None}
    return out


CONVERGED_LEFT = 0.2  # the twin "converged" at an lr: at most this share of its init-to-best drop left


def target_of(task: str) -> float:
    """The same-lr and best-of-grid target of a task: 1 % on the byte LM, 5 % elsewhere."""
    return 1.01 if task == "byte_lm" else 1.05


def twin_left(results):
    """{(task, method, lr): share of the method's drop from the initial loss to its best-of-grid
    loss still left at that lr} (0: the best lr of the grid; 1: no better than at init). The
    same-lr ratio is a lag where this is large: the loss is still falling steeply at the end,
    so a 1-bit run a few steps behind ends measurably higher."""
    best = summarize(results)  # best-of-grid final per task and method (inf: every lr diverged)
    out = {}
    for r in over_orders(results):
        b = best[r["task"]][r["method"]][0]
        if not is_diverged(r) and r["init"] > b:
            out[(r["task"], r["method"], r["lr"])] = (r["final"] - b) / (r["init"] - b)
    return out


def same_lr_over_runs(runs):
    """The same-lr cells of several saved runs (seeds) together: {task: {method: {"worst",
    "worst_lr", "worst_run", "cells", "over", "converged", "over_converged"}}}; "over": cells
    beyond the task's target; "converged"/"over_converged": the same among the cells where
    the twin has at most CONVERGED_LEFT of its drop left (`twin_left`)."""
    out = {}
    for k, results in enumerate(runs):
        left = twin_left(results)
        for t, row in same_lr(results).items():
            for m, cell_row in row.items():
                agg = out.setdefault(t, {}).setdefault(m, {"worst": None, "worst_lr": None, "worst_run": None,
                                                           "cells": 0, "over": 0, "converged": 0,
                                                           "over_converged": 0})
                for lr, ratio, _mark in cell_row["cells"]:
                    if ratio is None:
                        continue
                    over = not ratio <= target_of(t)
                    conv = left.get((t, TWIN[m], lr), math.inf) <= CONVERGED_LEFT
                    agg["cells"] += 1
                    agg["over"] += over
                    agg["converged"] += conv
                    agg["over_converged"] += over and conv
                    if agg["worst"] is None or ratio > agg["worst"]:
                        agg["worst"], agg["worst_lr"], agg["worst_run"] = ratio, lr, k
    return out


def report_over_runs(runs, paths, a):
    """The same-lr cells of several saved runs together (`same_lr_over_runs`), one table."""
    s = same_lr_over_runs(runs)
    tasks_ = list(s)
    pairs = [(m, b) for m, b in TWIN.items() if m in a.methods and b in a.methods]
    print(f"\n== same-lr ratio over {len(runs)} runs: " + ", ".join(paths))
    print(f"worst cell (run #, lr); cells over the target / cells; the same where the twin converged (at most "
          f"{CONVERGED_LEFT:g} of its init-to-best drop left)")

    def cell(m, t):
        g = s[t].get(m)
        if g is None or g["worst"] is None:
            return "-"
        return (f"{_worst_text(g['worst'])} (#{g['worst_run']} @{format(g['worst_lr'], 'g')}) "
                f"{g['over']}/{g['cells']}, {g['over_converged']}/{g['converged']}")

    _pair_table(pairs, tasks_, cell, 24, 33)
    return s


def _worst_text(w) -> str:
    return "D" if not math.isfinite(w) else f"{w:.3f}"


def _pair_table(pairs, tasks_, cell, label_w: int, col_w: int) -> None:
    """Print one row per (1-bit method, twin) pair and one column per task: cell(m, t)."""
    print(f"{'pair':<{label_w}}" + "".join(f"{t:>{col_w}}" for t in tasks_))
    for m, base in pairs:
        print(f"{LABEL[m] + ' / ' + LABEL[base]:<{label_w}}" + "".join(f"{cell(m, t):>{col_w}}" for t in tasks_))


def _ratio_cell(ratio, mark) -> str:
    if mark == "twin-div":
        return "t"
    if mark == "div":
        return "D"
    return f"{ratio:.3f}"


def report_same_lr(results, a):
    """The same-lr table: every lr of the grid, then the worst cell per task; returns the
    cells over target."""
    s = same_lr(results)
    tasks_ = list(s)
    misses = []
    pairs = [(m, b) for m, b in TWIN.items() if m in a.methods and b in a.methods]
    if not pairs or not tasks_:
        return misses
    print(f"\nsame-lr ratio 1-bit / twin at every lr of the grid (both twins at that lr; schedule "
          f"{getattr(a, 'schedule', 'cosine')}); t: the twin diverged there (not counted), "
          "D: the 1-bit method diverged where the twin did not")
    for m, base in pairs:
        print(f"  {LABEL[m]} / {LABEL[base]}")
        for t in tasks_:
            if m not in s[t]:
                continue
            row = s[t][m]
            cells = " ".join(f"{format(lr, 'g')}:{_ratio_cell(r, mark)}" for lr, r, mark in row["cells"])
            print(f"    {t:<14}{cells}")
    left = twin_left(results)
    print(f"  the twins' share of their init-to-best drop left at each lr (a large share: still far from "
          f"converged, where a lag shows most; <= {CONVERGED_LEFT:g} counts as converged)")
    for base in dict.fromkeys(b for _, b in pairs):
        for t in tasks_:
            cells = [(lr, left.get((t, base, lr))) for lr in sorted({r["lr"] for r in results
                                                                      if r["task"] == t and r["method"] == base})]
            print(f"    {LABEL[base]:<8}{t:<14}" + " ".join(
                f"{format(lr, 'g')}:{'-' if x is None else format(x, '.2f')}" for lr, x in cells))
    print("\nworst same-lr ratio per task (the lr of the worst cell)")

    def cell(m, t):
        row = s[t].get(m)
        return "-" if row is None or row["worst"] is None else \
            f"{_worst_text(row['worst'])} @{format(row['worst_lr'], 'g')}"

    _pair_table(pairs, tasks_, cell, 30, 22)
    for m, _ in pairs:
        for t in tasks_:
            row = s[t].get(m)
            w = None if row is None else row["worst"]
            if w is not None and not w <= target_of(t):
                misses.append(f"{LABEL[m]} on {t}: same-lr ratio "
                              + ("diverged" if not math.isfinite(w) else f"{w:.3f}")
                              + f" at lr {format(row['worst_lr'], 'g')} (target {target_of(t)})")
    return misses


def report(results, a):
    s = summarize(results)
    tasks_ = list(s)
    print(f"\nbest-of-grid final validation loss, {a.ranks} gloo ranks; ratio = 1-bit / its full-precision twin")
    print(f"{'pair':<30}" + "".join(f"{t:>16}" for t in tasks_))
    failures = []
    for m, base in TWIN.items():
        if m not in a.methods or base not in a.methods:
            continue
        cells = []
        for t in tasks_:
            mine, twin = s[t][m], s[t][base]
            ratio = mine[0] / twin[0]
            target = target_of(t)
            cell = f"{ratio:.3f}" if math.isfinite(ratio) else "all-div"
            if mine[2]:
                cell += f" d{len(mine[2])}"
            if not ratio <= target or mine[2]:
                failures.append(f"{LABEL[m]} on {t}: ratio {ratio:.3f} (target {target})"
                                + (f", diverged at lr {mine[2]} where {LABEL[base]} did not" if mine[2] else ""))
            cells.append(cell)
        print(f"{LABEL[m] + ' / ' + LABEL[base]:<30}" + "".join(f"{c:>16}" for c in cells))
    print("(dN: diverged at N lrs of the grid where the twin did not; diverged = non-finite or worse than at init)")
    print("\nlargest first compressed update of one coordinate over the grid, in units of the current lr")
    for m in ("onebit_adam", "onebit_lamb") + HOOKS:
        if m in a.methods:
            print(f"  {LABEL[m]:<16}" + "".join(
                f"{(format(s[t][m][3], '.3g') if s[t][m][3] is not None else '-'):>16}" for t in tasks_))
    hooks = [m for m in HOOKS + ("zeroone",) if m in a.methods]
    if hooks:
        print("\nbytes sent per rank / an fp32 ring allreduce's, whole run (start included), at the best lr")
        for m in hooks:
            cells = []
            for t in tasks_:
                r = [r for r in results if r["task"] == t and r["method"] == m and r["lr"] == s[t][m][1]]
                ok = r and r[0].get("bytes_sent") and r[0].get("bytes_uncompressed")
                cells.append(f"1/{r[0]['bytes_uncompressed'] / r[0]['bytes_sent']:.1f}" if ok else "-")
            print(f"  {LABEL[m]:<16}" + "".join(f"{c:>16}" for c in cells))
    print("\nbest lr per method: " + "; ".join(
        f"{t}: " + ", ".join(f"{LABEL[m]} {s[t][m][1]}" for m in a.methods) for t in tasks_))
    failures += report_same_lr(results, a)
    if failures:
        print("\nMISSED TARGETS:\n  " + "\n  ".join(failures))
    else:
        print("\nevery 1-bit method meets its targets on every task")
    return failures


def plot(results, a, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; no plot written to {path}")
        return
    s = summarize(results)
    tasks_ = list(s)
    pairs = [(m, b) for m, b in TWIN.items() if m in a.methods and b in a.methods]
    fig, ax = plt.subplots(figsize=(9, 4), layout="constrained")
    w = 0.8 / max(1, len(pairs))
    for j, (m, b) in enumerate(pairs):
        ys = [min(s[t][m][0] / s[t][b][0], 3.0) for t in tasks_]
        ax.bar([i + j * w for i in range(len(tasks_))], ys, w, label=f"{LABEL[m]} / {LABEL[b]}")
    ax.axhline(1.05, color="grey", ls=":", lw=1)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + w * (len(pairs) - 1) / 2 for i in range(len(tasks_))], tasks_)
    ax.set_ylabel("best-of-grid val loss ratio (capped at 3)")
    ax.set_ylim(0.9, max(1.2, ax.get_ylim()[1]))
    ax.legend(fontsize=8)
    ax.set_title(f"1-bit / full precision, {a.ranks} gloo ranks" + (f", options {a.onebit_options}"
                                                                    if a.onebit_options else ""))
    fig.savefig(path, dpi=110)
    print(f"ratio plot written to {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.suite",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"tasks {', '.join(QUICK_TASKS)} with short runs")
    p.add_argument("--tasks", default="", help=f"comma list of {', '.join(T.TASKS)} (default: all)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=None,
                   help="each run's length (default: the task's, 240; 80 with --quick); the freeze and "
                   "ZeroOneAdam's local_step_scaler scale with it")
    p.add_argument("--seed", type=int, default=0, help="the tasks' seed (data, initial weights)")
    p.add_argument("--grid", choices=("coarse", "fine"), default=None,
                   help="the lr grids of bench/tasks.py (coarse: 4 lrs, 3.16x apart) or with their "
                   "geometric midpoints (fine: 7 lrs; the default, coarse with --quick): the coarse grid's "
                   "best also measures where between its points each method's best lr falls (README, 'The lr grid')")
    p.add_argument("--schedule", choices=tuple(T.SCHEDULES), default="cosine",
                   help="the lr schedule of every run, both twins alike: "
                   + "; ".join(f"{k}: {v}" for k, v in T.SCHEDULES.items()).replace("%", "%%"))
    p.add_argument("--freeze-at", type=_freeze_at, default=0.25,
                   help="the 1-bit methods' freeze (ZeroOneAdam's var_freeze_step, the hooks' start) at this "
                   "fraction of each run (default: 0.25); with --schedule long_warmup, 0.5 freezes at the end "
                   "of the lr warmup; 'auto': the optimizers' freeze_step='auto' (the hooks at 0.25)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every (task, method, lr) this many times, each with another order of the same "
                   "batches (same data, initial weights), and rank the lrs by the mean final loss: for tasks "
                   "whose top lrs are chaotic, where one run's final loss carries a few %% of luck")
    p.add_argument("--onebit-options", default="", type=json_options,
                   help="JSON dict of extra OneBitAdam/OneBitLamb options")
    p.add_argument("--zeroone-options", default="", type=json_options,
                   help="JSON dict of extra ZeroOneAdam options (zeroone), e.g. '{\"var_decay\": \"update\"}'")
    p.add_argument("--hook-options", default="", type=json_options,
                   help="JSON dict of extra OneBitHookState options (sgd_hook, sgd_mom_hook (on top of its "
                   "momentum=0.9, normalize='adaptive'), lars_hook, adamw_hook)")
    p.add_argument("--lars-options", default="", type=json_options,
                   help="JSON dict of extra lbcomm.Lars options (lars, lars_hook); \"exclude_over\": N excludes the "
                   "tensors of more than N elements from the trust ratio")
    p.add_argument("--lrs", default="", help="comma list: run only these lrs of each grid (default: the whole grid)")
    p.add_argument("--trajectory", type=int, default=0, metavar="K",
                   help="also record (and print) the validation loss every K steps of every run")
    p.add_argument("--json", default="", help="write the raw results here")
    p.add_argument("--plot", default="", help="PNG of the ratio table")
    p.add_argument("--report", nargs="+", default=[], metavar="JSON",
                   help="print the tables of runs saved with --json instead of running; with several (e.g. one per "
                   "seed), also their same-lr cells together: the worst over all runs and the cells over target")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    if a.freeze_at != "auto" and not 0 < a.freeze_at < 1:
        p.error(f"--freeze-at must be a fraction of the run in (0, 1), got {a.freeze_at}")
    over = a.lars_options.get("exclude_over", 0)
    if isinstance(over, bool) or not isinstance(over, int) or over < 0:
        p.error(f"--lars-options: exclude_over must be an int >= 0, got {over!r}")
    if a.trajectory < 0:
        p.error(f"--trajectory must be >= 0, got {a.trajectory}")
    try:
        a.lrs = [float(x) for x in a.lrs.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lrs: a comma list of numbers, got {a.lrs!r}")
    if a.steps is not None and a.steps < 8:
        p.error(f"--steps must be >= 8, got {a.steps}")
    if a.grid is None:
        a.grid = "coarse" if a.quick else "fine"
    a.tasks = a.tasks.split(",") if a.tasks else list(QUICK_TASKS if a.quick else T.TASKS)
    a.methods = [m for m in a.methods.split(",") if m]
    unknown = [m for m in a.methods if m not in METHODS + EXTRA_METHODS] + [t for t in a.tasks if t not in T.TASKS]
    if unknown:
        p.error(f"unknown method or task: {unknown}")
    if a.lrs:
        grids = [lr for t in a.tasks for g in T.make_task(t, quick=a.quick, grid=a.grid).grids.values() for lr in g]
        missing = [x for x in a.lrs if not any(math.isclose(x, lr) for lr in grids)]
        if missing:
            p.error(f"--lrs: {missing} not in the {a.grid} grid of {', '.join(a.tasks)}")
    return a


def spawn_ranks(fn, ranks: int, *args):
    """Run ``fn(rank, ranks, *args, out_path, init_file)`` on `ranks` spawned processes and
    return what rank 0 wrote to out_path (JSON)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "results.json")
        mp.start_processes(fn, args=(ranks, *args, out, os.path.join(d, "init")), nprocs=ranks, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def main(argv=None):
    a = parse_args(argv)
    if a.report:
        runs = []
        for path in a.report:
            with open(path) as f:
                saved = json.load(f)
            print(f"\n== {path} ({saved['args'].get('onebit_options') or 'default options'})")
            args = argparse.Namespace(**{**vars(a), **saved["args"]})
            report(saved["results"], args)
            runs.append((saved["results"], args))
        if len(runs) > 1:  # e.g. the seeds of one configuration: their cells together
            methods = [m for m in runs[0][1].methods if all(m in r[1].methods for r in runs)]
            report_over_runs([r[0] for r in runs], a.report, argparse.Namespace(methods=methods))
        return None, None
    t0 = time.perf_counter()
    results = spawn_ranks(rank_main, a.ranks, a)
    failures = report(results, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results, "same_lr": same_lr(results)}, f)
    if a.plot:
        plot(results, a, a.plot)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return results, failures


if __name__ == "__main__":
    main()
