"""Same-lr parity: a 1-bit optimizer against its full-precision twin at the twin's lr.

OneBitLamb vs Lamb (or OneBitAdam / ZeroOneAdam vs AdamW, --pair) on a small MLP
regression (a random two-layer teacher plus noise), the global batch split over a few gloo
ranks, the same initial weights and samples for every run. Each variant of
the 1-bit optimizer changes one setting at a time (the comm settings and hyperparameters of
VARIANTS, or its own JSON) and is run at the twin's lr; printed: the final validation loss,
its ratio to the twin's, and per parameter tensor the step size relative to the weights,
||theta_t - theta_{t-1}|| / (lr ||theta_{t-1}||), averaged over the compression stage, for the
twin and the 1-bit run (LAMB's live trust ratio makes it exactly 1 when unclamped; OneBitLamb's
with trust_ratio="frozen" its coefficient c_frz f sets it), and for OneBitLamb c_frz and the mean factor f.
--suite-tasks runs Lamb, OneBitLamb (its default, the live trust ratio) and OneBitLamb with
trust_ratio="frozen" on tasks of bench/tasks.py instead. Findings: bench/studies.md.

    python -m bench.parity                                   # OneBitLamb vs Lamb, every variant, 2 ranks
    python -m bench.parity --lrs 0.003,0.01,0.03 --variants default,max_update_off
    python -m bench.parity --pair zeroone --lrs 0.001,0.003  # ZeroOneAdam vs AdamW (onebit_adam: OneBitAdam)
    python -m bench.parity --variant-json '{"factor_range": [1.0, 1.0]}'
    python -m bench.parity --trajectory 10                   # also every 10th step's loss and step sizes
    python -m bench.parity --suite-tasks rare_features,zipf_embed   # live vs frozen trust ratio on suite tasks
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import warnings

import torch
import torch.distributed as dist

import lbcomm

from .cli_options import json_options, optimizer_options
from .convergence import average_grads, zeroone_local_step_scaler
from .suite import spawn_ranks

# one setting changed at a time (optimizer hyperparameters and CommConfig fields alike)
VARIANTS = {
    "onebit_lamb": {
        "default": {},  # the MLP's tensors are all <= exact_numel=4096: averaged exactly, nothing compressed
        "max_update_off": {"max_update": None},
        # trust_ratio="frozen" (the published coefficient c_frz f) and its settings
        "frozen": {"trust_ratio": "frozen"},
        "frozen_factor_one": {"trust_ratio": "frozen", "factor_range": [1.0, 1.0]},  # f = 1: lr c_frz u
        "frozen_factor_free": {"trust_ratio": "frozen", "factor_range": [1e-6, 1e6], "factor_threshold": 1e6},
        "frozen_coeff_last": {"trust_ratio": "frozen", "coeff_beta": 0.0},  # c_frz: the last warmup ratio
        "frozen_max_update_off": {"trust_ratio": "frozen", "max_update": None},
        "compressed": {"exact_numel": 0},  # every tensor through the 1-bit allreduce
        "compressed_block_none": {"exact_numel": 0, "block_size": None},
        "compressed_max_update_off": {"exact_numel": 0, "max_update": None},
        "compressed_frozen": {"exact_numel": 0, "trust_ratio": "frozen"},
    },
    "onebit_adam": {  # the reference: OneBitAdam on the same case
        "default": {},
        "compressed": {"exact_numel": 0},
        "compressed_max_update_off": {"exact_numel": 0, "max_update": None},
    },
    "zeroone": {  # the MLP's tensors are all <= exact_numel: averaged exactly at the default
        "default": {},
        "compressed": {"exact_numel": 0},  # every tensor compressed (ZeroOneAdam's previous behaviour)
        "max_update_off": {"max_update": None},
        "no_local_steps": {"local_step_clipper": 1},
        "var_decay_update": {"var_decay": "update"},
        "no_local_max_update_off": {"local_step_clipper": 1, "max_update": None},
    },
}
TWIN = {"onebit_lamb": "lamb", "onebit_adam": "adamw", "zeroone": "adamw"}


def make_data(seed, n_train=4096, n_val=1024, d_in=16, hidden=64):
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(d_in, hidden, generator=g) / math.sqrt(d_in), torch.randn(hidden, 1, generator=g)

    def draw(n):
        x = torch.randn(n, d_in, generator=g)
        return x, torch.tanh(x @ w1) @ w2 / math.sqrt(hidden) + 0.05 * torch.randn(n, 1, generator=g)
    return draw(n_train), draw(n_val)


def make_model(seed, d_in=16, hidden=64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


def lr_at(a, step):
    from .tasks import schedule_factor
    return schedule_factor(a.schedule, step, a.steps)


def build(a, name, model, lr, opts):
    wd, betas = a.weight_decay, (0.9, 0.999)
    if name == "lamb":
        return lbcomm.Lamb(model.parameters(), lr=lr, betas=betas, weight_decay=wd)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=wd)
    if name == "onebit_lamb":
        kw = optimizer_options(opts)
        group = {"params": list(model.parameters())}
        if "factor_threshold" in kw:  # a param-group option of OneBitLamb
            group["factor_threshold"] = kw.pop("factor_threshold")
        return lbcomm.OneBitLamb([group], lr=lr, betas=betas, weight_decay=wd, freeze_step=a.freeze, **kw)
    if name == "onebit_adam":
        return lbcomm.OneBitAdam(model.parameters(), lr=lr, betas=betas, weight_decay=wd, freeze_step=a.freeze,
                                 **optimizer_options(opts))
    opts = {"local_step_scaler": zeroone_local_step_scaler(a.steps), **opts}
    return lbcomm.ZeroOneAdam(model.parameters(), lr=lr, betas=betas, weight_decay=wd, var_freeze_step=a.freeze,
                              **optimizer_options(opts))


def one_run(rank, world, a, data, name, lr, opts):
    (xt, yt), (xv, yv) = data
    model = make_model(a.seed)
    opt = build(a, name, model, lr, opts)
    params = list(model.parameters())
    per = a.batch // world
    traj, rel_sum, rel_n, fs = [], [0.0] * len(params), 0, []
    for step in range(a.steps):
        cur = lr * lr_at(a, step)
        for g in opt.param_groups:
            g["lr"] = cur
        idx = torch.randint(0, xt.shape[0], (a.batch,), generator=torch.Generator().manual_seed(a.seed * 7919 + step))
        x, y = xt[idx][rank * per:(rank + 1) * per], yt[idx][rank * per:(rank + 1) * per]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if name == "adamw":
            average_grads(model, world)
        before = [p.detach().clone() for p in params]
        opt.step()
        rel = [float((p.detach() - b).norm() / (cur * b.norm())) for p, b in zip(params, before)]
        if step >= a.freeze:  # the compression stage (steps freeze+1 .. steps, 1-based)
            rel_sum = [s + r for s, r in zip(rel_sum, rel)]
            rel_n += 1
            if name == "onebit_lamb":
                fs.append(opt._vectors["last_factor"].tolist())
        if a.trajectory and (step + 1) % a.trajectory == 0:
            with torch.no_grad():
                traj.append({"step": step + 1, "val": float(torch.nn.functional.mse_loss(model(xv), yv)),
                             "rel_step": rel})
    with torch.no_grad():
        final = float(torch.nn.functional.mse_loss(model(xv), yv))
    out = {"final": final, "rel_step": [s / max(1, rel_n) for s in rel_sum], "trajectory": traj}
    if name == "onebit_lamb":
        out["c_frz"] = opt._vectors["lamb_coeff_freeze"].tolist()
        out["f_mean"] = [sum(col) / len(col) for col in zip(*fs)] if fs else None
    return out


def rank_main(rank, world, a, runs, out_path, init_file):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*averaged exactly in fp32, not compressed.*")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    data = make_data(a.seed)
    results = []
    for name, lr, label, opts in runs:
        r = one_run(rank, world, a, data, name, lr, dict(opts))
        results.append({"optimizer": name, "lr": lr, "variant": label, "options": opts, **r})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def suite_rank_main(rank, world, a, out_path, init_file):
    """--suite-tasks: Lamb, OneBitLamb and OneBitLamb(trust_ratio="frozen") through
    bench.suite.one_run on the suite's tasks (short runs, coarse lamb grid, the suite's
    defaults otherwise)."""
    from types import SimpleNamespace

    from . import suite
    from . import tasks as T

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*averaged exactly in fp32, not compressed.*")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    ns = SimpleNamespace(onebit_options=a.suite_options, hook_options={}, zeroone_options={}, schedule=a.schedule_suite)
    frozen = {"onebit_lamb": functools.partial(lbcomm.OneBitLamb, trust_ratio="frozen")}
    results = []
    for name in a.suite_tasks:
        task = T.make_task(name, quick=True, seed=a.seed)
        for method, label, classes in (("lamb", "lamb", None), ("onebit_lamb", "onebit_lamb", None),
                                       ("onebit_lamb", "onebit_lamb_frozen", frozen)):
            for lr in task.grids["lamb"]:
                r = suite.one_run(rank, world, task, method, lr, ns, classes)
                results.append({**r, "method": label, "diverged": r["diverged"] or suite.is_diverged(r)})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def suite_report(results, a):
    print(f"\nOneBitLamb / Lamb at the same lr on the suite's tasks (quick runs, {a.ranks} gloo ranks, schedule "
          f"{a.schedule_suite}, seed {a.seed}, options {a.suite_options or 'default'}); default: the live trust ratio, "
          "frozen: trust_ratio='frozen'; t: Lamb diverged, D: this one did")
    for t in dict.fromkeys(r["task"] for r in results):
        base = {r["lr"]: r for r in results if r["task"] == t and r["method"] == "lamb"}
        for m in ("onebit_lamb", "onebit_lamb_frozen"):
            cells = []
            for r in (r for r in results if r["task"] == t and r["method"] == m):
                b = base[r["lr"]]
                cell = "t" if b["diverged"] else "D" if r["diverged"] else f"{r['final'] / b['final']:.3f}"
                cells.append(f"{r['lr']:g}:{cell}")
            print(f"  {t:<14}{'frozen' if m.endswith('frozen') else 'default':<9}" + " ".join(cells))


def fmt(xs):
    return "[" + " ".join(f"{x:.3g}" for x in xs) + "]"


def report(results, a):
    twin = TWIN[a.pair]
    print(f"\n{a.pair} vs {twin} at the same lr: MLP regression, {a.ranks} gloo ranks, {a.steps} steps, "
          f"freeze after step {a.freeze}, schedule {a.schedule}, seed {a.seed}")
    print("rel step per tensor (w1 b1 w2 b2 w3 b3) = mean over the compression stage of ||dtheta|| / (lr ||theta||)")
    for lr in a.lrs:
        base = next(r for r in results if r["optimizer"] == twin and r["lr"] == lr)
        print(f"\nlr {lr:g}: {twin} final {base['final']:.4f}  rel step {fmt(base['rel_step'])}")
        for r in results:
            if r["optimizer"] != a.pair or r["lr"] != lr:
                continue
            ratio = r["final"] / base["final"]
            extra = ""
            if r.get("c_frz") is not None:
                extra = f"  c_frz {fmt(r['c_frz'])}" + (f"  mean f {fmt(r['f_mean'])}" if r["f_mean"] else "")
            print(f"  {r['variant']:<28} final {r['final']:.4f}  ratio {ratio:6.3f}  rel step {fmt(r['rel_step'])}"
                  + extra)
        if a.trajectory:
            print(f"  trajectory every {a.trajectory} steps: val loss | rel step of that step, mean over tensors")
            for r in [base] + [r for r in results if r["optimizer"] == a.pair and r["lr"] == lr]:
                print(f"    {r['variant']:<28}" + " ".join(f"{t['val']:.4f}" for t in r["trajectory"]) + " | "
                      + " ".join(f"{sum(t['rel_step']) / len(t['rel_step']):.2f}" for t in r["trajectory"]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.parity", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--pair", choices=tuple(TWIN), default="onebit_lamb")
    p.add_argument("--lrs", default="", help="comma list of lrs (default: 0.01 for onebit_lamb, 0.001 for the Adams)")
    p.add_argument("--variants", default="", help=f"comma list of the pair's VARIANTS (default: all): "
                   f"{'; '.join(k + ': ' + ','.join(v) for k, v in VARIANTS.items())}")
    p.add_argument("--variant-json", default="", type=json_options, help="one more variant: these options")
    p.add_argument("--lr-scale", type=float, default=None,
                   help="one more variant: the default 1-bit optimizer at this multiple of the twin's lr")
    p.add_argument("--ranks", type=int, default=None, help="gloo ranks (default: 2; 4 with --suite-tasks)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--freeze", type=int, default=20, help="freeze_step / var_freeze_step")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--schedule", choices=("constant", "cosine", "long_warmup"), default="constant",
                   help="the lr schedule, both alike (bench.tasks.SCHEDULES; cosine: 10 %% linear warmup, "
                   "cosine decay to 10 %%)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trajectory", type=int, default=0, metavar="K", help="print every K-th step's val loss")
    p.add_argument("--suite-tasks", default="", help="instead of the MLP: these tasks of bench/tasks.py (short "
                   "runs, the coarse lamb grid, 4 ranks by default) with Lamb, OneBitLamb and its frozen trust ratio")
    p.add_argument("--schedule-suite", default="cosine", help="--suite-tasks: the schedule (bench.tasks.SCHEDULES)")
    p.add_argument("--suite-options", default="", type=json_options,
                   help="--suite-tasks: JSON options of both OneBitLamb runs, as bench.suite's --onebit-options")
    p.add_argument("--json", default="", help="write the results here")
    a = p.parse_args(argv)
    a.suite_tasks = [t for t in a.suite_tasks.split(",") if t]
    if a.suite_tasks:
        from .tasks import SCHEDULES, TASKS
        bad = [t for t in a.suite_tasks if t not in TASKS] + ([a.schedule_suite] if a.schedule_suite not in SCHEDULES
                                                              else [])
        if bad:
            p.error(f"unknown task or schedule: {bad}")
    if a.ranks is None:
        a.ranks = 4 if a.suite_tasks else 2
    a.lrs = [float(x) for x in a.lrs.split(",")] if a.lrs else [0.01 if a.pair == "onebit_lamb" else 0.001]
    names = a.variants.split(",") if a.variants else list(VARIANTS[a.pair])
    unknown = [n for n in names if n not in VARIANTS[a.pair]]
    if unknown:
        p.error(f"unknown variants for {a.pair}: {unknown}")
    a.variant_list = [(n, VARIANTS[a.pair][n]) for n in names]
    if a.variant_json:
        a.variant_list.append((json.dumps(a.variant_json), a.variant_json))
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.suite_tasks:
        results = spawn_ranks(suite_rank_main, a.ranks, a)
        suite_report(results, a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "results": results}, f)
        return results
    runs = []
    for lr in a.lrs:
        runs.append((TWIN[a.pair], lr, TWIN[a.pair], {}))
        runs += [(a.pair, lr, label, opts) for label, opts in a.variant_list]
        if a.lr_scale:
            runs.append((a.pair, lr * a.lr_scale, f"default at {a.lr_scale:g}x lr", {}))
    results = spawn_ranks(rank_main, a.ranks, a, runs)
    for r in results:  # the scaled-lr run is reported under its twin's lr
        if r["variant"].startswith("default at "):
            r["lr"] = r["lr"] / a.lr_scale
    report(results, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items()}, "results": results}, f)
    return results


if __name__ == "__main__":
    main()
