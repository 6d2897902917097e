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

The pieces: bench/suite_runs.py (the methods, one run, the ranks) and bench/suite_report.py
(the tables); this module is the CLI and re-exports their names (`suite.one_run`, ...).
"""
from __future__ import annotations

import argparse
import json
import math
import time

from .cli_options import json_options
from . import tasks as T
from .suite_report import (CONVERGED_LEFT, is_diverged, over_orders, plot, report, report_over_runs, report_same_lr,
                           same_lr, same_lr_over_runs, summarize, target_of, twin_left)
from .suite_runs import (CLASSES, COMM_FIELDS, EXTRA_METHODS, FAMILY, HOOKS, LABEL, LARS_TRUST, METHODS, MOM_HOOK,
                         ORDER_STRIDE, QUICK_TASKS, SGD_MOMENTUM, TWIN, build, freeze_of, in_order, lars_options,
                         one_run, rank_main, spawn_ranks)

__all__ = ["parse_args", "main", "json_options",
           "CONVERGED_LEFT", "is_diverged", "over_orders", "plot", "report", "report_over_runs", "report_same_lr",
           "same_lr", "same_lr_over_runs", "summarize", "target_of", "twin_left",
           "CLASSES", "COMM_FIELDS", "EXTRA_METHODS", "FAMILY", "HOOKS", "LABEL", "LARS_TRUST", "METHODS", "MOM_HOOK",
           "ORDER_STRIDE", "QUICK_TASKS", "SGD_MOMENTUM", "TWIN", "build", "freeze_of", "in_order", "lars_options",
           "one_run", "rank_main", "spawn_ranks"]


def _freeze_at(text: str):
    return "auto" if text == "auto" else float(text)


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
