"""Single-process simulation of p ranks for the robustness study of the compression stage.

A study tool, not a maintained benchmark (its conclusions: bench/studies.md; the shipped
rules are measured with `python -m bench.suite`): candidate rules that make the compression stage of the 1-bit optimizers
and of the 1-bit gradient hook safe, measured on every task of bench/tasks.py over the lr
grid. One model, p data shards: each step computes every rank's local gradient on its
quarter of the global batch, then runs the optimizer math below on flat fp32 vectors with
a vectorized compressed allreduce (the algorithm of lbcomm/compressed.py; checked against
lbcomm.testing.kernels by ``--check``, as tests/test_robustness.py does). Deterministic, no processes, cheap.

Rules (``rule=``) of OneBitAdam / OneBitLamb in the compression stage, with
m the decoded momentum, d = sqrt(v^) + eps the frozen denominator, b1c = 1 - b1^t:

    published   the paper (mask: v <= 1e-10 mean(v))
    mask1e-3    the published rule with mask_threshold 1e-3 (the published algorithm's tunable threshold)
    clip        u = clamp(m / (b1c d), -1, 1): no coordinate moves faster than lr per step
                (|E g| <= sqrt(E g^2): the largest stationary Adam step)
    clipmax     u = clamp(m / (b1c d), -U, U), U = (1-b1) / sqrt((1-b2)(1-b1^2/b2)): the
                largest |m^/sqrt(v^)| Adam can produce for any gradient sequence (7.27 at
                betas (0.9, 0.999), 2.35 at (0.9, 0.99))
    floor       d <- max(d, 0.1 rms_block(d)): denominator floored relative to its block
    precond     compress m / d instead of m, decode, multiply by d: every block then holds
                update-sized numbers, so the compression noise of a coordinate is the
                block's update RMS, never lr scale / sqrt(v)
    precond_clip  both
    clipwarm    u = clamp(m^ / d, -U_p, U_p), U_p = max_i |m^_i / d_i| of tensor p at the freeze
                (the largest full-precision step of that tensor in the last warmup step)
    clipallK    U_p = K x the largest |m^ / d| of tensor p over the whole warmup (running max)
    clipcoordK  per coordinate: K x its own largest |m^ / d| over the warmup
    uclip       compress clamp(m_local / d, -1, 1) (masked coordinates 0), clamp the decoded
                direction to +-1, m = d x decoded: a coordinate's compressed update is
                at most its block's RMS update (and at most lr); no k_p scaling for LAMB
    meanabs     block scale mean|y| instead of rms(y) (L2-optimal scale for signs)

    _vsl        the frozen denominator rescaled per tensor: v^ x q^_t / q^_freeze, q^ the
                bias-corrected EMA (beta2) of the ranks' mean squared local gradient of the tensor
                from step 1 (OneBitAdam(rescale_variance=True)); _vslc: the factor at most 1;
                _vso: q from the averaged gradient (an oracle: not available after the freeze);
                _vsm: q from the decoded momentum; _vsf / _vsfc: q from the freeze on, relative
                to its first compressed step

OneBitLamb's layer coefficient (suffixes of a LAMB rule; default c_frz x f, the paper's):
    _live       LAMB's own trust ratio clamp(||w|| / ||u||) of every compressed step
    _wn         c_frz x f x ||w|| / ||w at the freeze|| (LAMB's c grows with ||w||)
    _nof        no variance factor f (c_frz alone)

The hook (SGD momentum on compressed gradients): scale rule, block size, start fraction, and
``norm``: per-coordinate normalization by the full-precision start's gradient RMS
(OneBitHookState(normalize="warmup"), the default). Parts of a hook rule name:

    mom         compress each rank's momentum (mu 0.9, started from the start's momentum)
                and hand SGD m^_t - mu m^_{t-1} (OneBitHookState(momentum=0.9))
    fact        weights re-estimated every step from an EMA (beta 0.9; fact99: 0.99, fact5:
                0.5) of the ranks' mean squares of what is compressed, factored per matrix
                into rows x columns; error feedback rescaled by w_old / w_new
                (OneBitHookState(normalize="adaptive"))
    _avgwarm    the EMA started from the averaged gradients of the start (else the ranks'
                mean squares); _cold: not started, first value at the first compressed step
    _zm         momentum started from zero instead of the start's momentum
    _kN         weights re-estimated every N steps only; _norescale: errors not rescaled
    _fX         floor X x the unit's RMS of the weights (default 0.1); _bN: block size N
                (also for the optimizers' rules)
    _exN        the parameters of at most N elements averaged exactly, their errors kept at
                zero (CommConfig(exact_numel=N)); also for the optimizers' rules
                (clipwarm_ex4096); _exlayerK: only parameter K of the flat order; _exvec: the
                vectors only

    python -m bench.robust_sim --check                 # the simulated allreduce vs lbcomm.testing.kernels
    python -m bench.robust_sim --tasks all --json out   # the whole study (minutes)

The simulation lives in bench/robust_sim_comm.py (the ranks' allreduce, the flat model)
and bench/robust_sim_optim.py (the optimizers and their rules); this module runs the
study, prints its table and re-exports their names.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import Dict, List, Optional

import torch

from . import tasks as T
from .robust_sim_comm import Compressor, Flat, check_against_reference, exact_mask, rank_grads
from .robust_sim_optim import SimOneBit, SimSGD, adam_bound, factored

__all__ = ["Compressor", "Flat", "check_against_reference", "exact_mask", "rank_grads", "SimOneBit", "SimSGD",
           "adam_bound", "factored", "ADAM_RULES", "LAMB_RULES", "HOOK_RULES", "FAMILY", "TWIN", "run", "study",
           "diverged", "table", "main"]

ADAM_RULES = ["published", "mask1e-3", "clip", "clipmax", "floor", "precond", "precond_clip", "meanabs"]
LAMB_RULES = ["published", "mask1e-3", "clip", "clipmax", "precond", "precond_clip", "precond_clipmax"]
HOOK_RULES = ["rms", "meanabs", "rms_b256", "rms_start50", "meanabs_start50", "norm", "norm_b256", "norm_start50",
              "mom", "mom_norm", "fact99", "mom_fact99", "mom_fact", "mom_fact5", "mom_fact99_avgwarm"]


# ---------------------------------------------------------------------- one run
FAMILY = {"adamw": "adam", "onebit_adam": "adam", "lamb": "lamb", "onebit_lamb": "lamb", "sgd": "sgd",
          "sgd_hook": "sgd"}
TWIN = {"onebit_adam": "adamw", "onebit_lamb": "lamb", "sgd_hook": "sgd"}


def run(task, method: str, lr: float, rule: str = "published", p: int = 4, freeze_frac: float = 0.25,
        eval_every: int = 0) -> Dict:
    model = task.make_model()
    flat = Flat(model, reverse=method.startswith("sgd"))
    steps = task.steps
    freeze = max(2, round(freeze_frac * steps))
    kw = dict(betas=(0.9, task.beta2), wd=task.weight_decay)
    if method in ("adamw", "onebit_adam", "lamb", "onebit_lamb"):
        opt = SimOneBit(flat, p, lr=lr, lamb="lamb" in method, freeze=freeze if "onebit" in method else None,
                        rule=rule, **kw)
    else:
        start = freeze
        if "start50" in rule:
            start = round(0.5 * steps)
        opt = SimSGD(flat, p, lr=lr, hook=method == "sgd_hook", rule=rule, start=start)
    theta = flat.get()
    init = T.evaluate(task, model)
    curve, diverged = [(0, init)], None
    warm = max(1, steps // 10)
    for step in range(steps):
        grads, _ = rank_grads(task, model, flat, step, p)
        try:
            theta = opt.step(theta, grads, lr * T.lr_factor(step, steps, warm))
        except FloatingPointError:
            diverged = step + 1
            break
        if not torch.isfinite(theta).all():
            diverged = step + 1
            break
        flat.set(theta)
        if eval_every and (step + 1) % eval_every == 0:
            curve.append((step + 1, T.evaluate(task, model)))
    final = float("nan") if diverged else T.evaluate(task, model)
    if not math.isfinite(final):
        diverged = diverged or steps
    return {"task": task.name, "method": method, "lr": lr, "rule": rule, "final": final, "init": init,
            "diverged": diverged, "curve": curve, "max_param": float(theta.abs().max()) if not diverged else None,
            "first_update_ratio": getattr(opt, "first_update_ratio", None)}


def study(task_names: List[str], quick: bool, rules: Dict[str, List[str]], out: Optional[str],
          seed: int = 0, grid: str = "coarse") -> List[Dict]:
    results = []
    for name in task_names:
        task = T.make_task(name, quick=quick, seed=seed, grid=grid)
        for method in ("adamw", "onebit_adam", "lamb", "onebit_lamb", "sgd", "sgd_hook"):
            for rule in rules.get(method, []):
                for lr in task.grids[FAMILY[method]]:
                    t0 = time.perf_counter()
                    r = run(task, method, lr, rule)
                    r["seconds"] = time.perf_counter() - t0
                    results.append(r)
                    print(f"{name:<14}{method:<12}{rule:<16}lr {lr:<7g} final {r['final']:.4f}"
                          f"{'  DIVERGED@' + str(r['diverged']) if r['diverged'] else ''}"
                          f"  first-upd/lr {r['first_update_ratio'] if r['first_update_ratio'] is not None else '-'}"
                          f"  ({r['seconds']:.1f}s)", flush=True)
                    if out:
                        with open(out, "w") as f:
                            json.dump(results, f)
    return results


def diverged(r) -> bool:
    """Diverged: non-finite, or ended worse than the initial model."""
    return bool(r["diverged"]) or not math.isfinite(r["final"]) or r["final"] > r["init"]


def table(results: List[Dict]) -> str:
    """Best-of-grid ratio of each 1-bit method and rule to its full-precision twin, and the
    lrs at which the 1-bit method diverged while the twin did not."""
    lines = []
    tasks_ = sorted({r["task"] for r in results}, key=list(T.TASKS).index)
    combos = []
    for r in results:
        if r["method"] in TWIN and (r["method"], r["rule"]) not in combos:
            combos.append((r["method"], r["rule"]))
    lines.append(f"{'method':<12}{'rule':<17}" + "".join(f"{t:>15}" for t in tasks_))
    for method, rule in combos:
        cells = []
        for t in tasks_:
            mine = [r for r in results if r["task"] == t and r["method"] == method and r["rule"] == rule]
            twin = [r for r in results if r["task"] == t and r["method"] == TWIN[method]]
            if not mine or not twin:
                cells.append("-")
                continue
            best = min((r["final"] for r in mine if not diverged(r)), default=float("inf"))
            best0 = min((r["final"] for r in twin if not diverged(r)), default=float("inf"))
            tw = {r["lr"]: diverged(r) for r in twin}
            bad = sum(1 for r in mine if diverged(r) and not tw.get(r["lr"], True))
            cells.append(f"{best / best0:.4f}" + (f" d{bad}" if bad else "") if math.isfinite(best) else "all-div")
        lines.append(f"{method:<12}{rule:<17}" + "".join(f"{c:>15}" for c in cells))
    lines.append("(ratio: best-of-grid final val loss / twin's; dN: N lrs diverged where the twin did not)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.robust_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--tasks", default="all")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--adam-rules", default=",".join(ADAM_RULES))
    ap.add_argument("--lamb-rules", default=",".join(LAMB_RULES))
    ap.add_argument("--hook-rules", default=",".join(HOOK_RULES))
    ap.add_argument("--seed", type=int, default=0, help="the tasks' seed (data, initial weights)")
    ap.add_argument("--grid", choices=("coarse", "fine"), default="coarse")
    ap.add_argument("--json", default="")
    ap.add_argument("--table-only", default="", help="print the table of a saved --json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.check:
        print(f"simulated allreduce vs lbcomm.testing.kernels: max abs difference {check_against_reference():.3g}")
        return
    if a.table_only:
        with open(a.table_only) as f:
            print(table(json.load(f)))
        return
    names = list(T.TASKS) if a.tasks == "all" else a.tasks.split(",")
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    rules = {"adamw": ["-"], "lamb": ["-"], "sgd": ["-"], "onebit_adam": split(a.adam_rules),
             "onebit_lamb": split(a.lamb_rules), "sgd_hook": split(a.hook_rules)}
    rules = {k: v for k, v in rules.items() if v}
    results = study(names, a.quick, rules, a.json, a.seed, a.grid)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
