"""Same-lr parity on tasks the defaults were never tuned on, run the way a user runs it.

Launched by torchrun over gloo; each rank trains on its share of every global batch. The
twins are what a user has today: `torch.optim.AdamW` under `DistributedDataParallel`, and
`lbcomm.Lamb` (torch has no LAMB), which averages its own gradients. The 1-bit optimizers
replace them with no DDP wrapper, at the same lr, betas, weight decay and lr schedule (a
`LambdaLR`: linear warmup over 10 % of the steps, cosine decay to 10 %), the freeze
(`freeze_step`, ZeroOneAdam's `var_freeze_step`) at 25 % of the steps. Every run starts
from the same weights and reads the same batches.

The tasks are none of bench/tasks.py's, on which the defaults were chosen:

    prose_lm   a character-level GRU language model on English prose (the Python
               documentation's topic texts, `pydoc_data.topics`)
    digits     a ReLU MLP on 10x10 renderings of a 5x7 digit font, shifted, thickened
               and noisy
    recsys     click prediction from user and item embeddings, items drawn with Zipf
               popularity (most item rows rarely or never seen), an MLP on top

Printed per task, pair and lr: the twin's final held-out loss, the 1-bit optimizer's, and
their ratio, per seed; a cell is marked when the twin has more than 20 % of the task's
best drop left there (it does not train at that lr, the suite's rule), and D when a run
diverged.

    torchrun --standalone --nproc-per-node 4 -m bench.heldout --seeds 0,1,2 --json heldout.json
    torchrun --standalone --nproc-per-node 2 -m bench.heldout --tasks digits --pairs onebit_adam --seeds 0
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lbcomm

from . import tasks as T
from .cli_options import construct, json_options, optimizer_options
from .convergence import zeroone_local_step_scaler

GRIDS = {"adam": [1e-3, 3e-3, 1e-2, 3e-2], "lamb": [3e-3, 1e-2, 3e-2, 1e-1]}
PAIRS = {"onebit_adam": ("adamw", "adam"), "zeroone": ("adamw", "adam"), "onebit_lamb": ("lamb", "lamb")}
CONVERGED = 0.2  # the twin's drop left, relative to the best run's on the task, at most this


# ---------------------------------------------------------------------- tasks (bench.tasks.Task)
class CharGRU(nn.Module):
    def __init__(self, vocab=128, dim=48, hidden=128):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(vocab, dim), nn.GRU(dim, hidden, batch_first=True), \
            nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.head(self.rnn(self.emb(x))[0])


def prose_lm(seed, steps=300, batch=32, ctx=48):
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    data = torch.tensor([min(ord(c), 127) for c in text], dtype=torch.long)
    cut = int(0.9 * len(data))
    train, held = data[:cut], data[cut:]

    def windows(src, n, g):
        start = torch.randint(0, len(src) - ctx - 1, (n,), generator=g)
        return torch.stack([src[s:s + ctx + 1] for s in start.tolist()])

    val = windows(held, 256, torch.Generator().manual_seed(10**6))

    def loss(model, b):
        x = b[0]
        return F.cross_entropy(model(x[:, :-1]).reshape(-1, 128), x[:, 1:].reshape(-1))

    def make():
        torch.manual_seed(seed)
        return CharGRU()

    return T.Task("prose_lm", make, lambda step: (windows(train, batch, torch.Generator().manual_seed(
        seed * 100003 + step)),), (val,), loss, steps, batch)


FONT = ["01110 10001 10011 10101 11001 10001 01110", "00100 01100 00100 00100 00100 00100 01110",
        "01110 10001 00001 00010 00100 01000 11111", "11111 00010 00100 00010 00001 10001 01110",
        "00010 00110 01010 10010 11111 00010 00010", "11111 10000 11110 00001 00001 10001 01110",
        "00110 01000 10000 11110 10001 10001 01110", "11111 00001 00010 00100 01000 01000 01000",
        "01110 10001 10001 01110 10001 10001 01110", "01110 10001 10001 01111 00001 00010 01100"]


def digits(seed, steps=300, batch=128, n_train=32768, n_val=2048):
    g = torch.Generator().manual_seed(seed + 7)
    glyphs = torch.tensor([[[int(c) for c in row] for row in f.split()] for f in FONT], dtype=torch.float32)

    def draw(n):
        y = torch.randint(0, 10, (n,), generator=g)
        canvas = torch.zeros(n, 10, 10)
        off = torch.randint(0, 4, (n, 2), generator=g)
        for i, (a, b) in enumerate(off.tolist()):
            canvas[i, a:a + 7, b:b + 5] = glyphs[y[i]]
        thick = torch.rand(n, generator=g) < 0.5  # half of them in a bolder stroke
        canvas[thick] = torch.clamp(canvas[thick] + torch.roll(canvas[thick], 1, dims=2), max=1.0)
        canvas = canvas * (0.4 + torch.rand(n, 1, 1, generator=g)) + 0.5 * torch.randn(n, 10, 10, generator=g)
        return canvas.flatten(1), y

    xt, yt = draw(n_train)
    xv, yv = draw(n_val)

    def make():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(100, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))

    return T.Task("digits", make, T._sampler(n_train, batch, seed, xt, yt), (xv, yv), T._ce, steps, batch)


class TwoTower(nn.Module):
    def __init__(self, users, items, dim=16):
        super().__init__()
        self.user, self.item = nn.Embedding(users, dim), nn.Embedding(items, dim)
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 64), nn.ReLU(), nn.Linear(64, 1))
        nn.init.normal_(self.user.weight, std=0.1)
        nn.init.normal_(self.item.weight, std=0.1)

    def forward(self, pair):
        u, i = self.user(pair[:, 0]), self.item(pair[:, 1])
        return self.mlp(torch.cat([u, i, u * i], 1)).squeeze(1)


def recsys(seed, steps=300, batch=256, users=1000, items=6000, n_train=65536, n_val=8192):
    g = torch.Generator().manual_seed(seed + 11)
    pop = (torch.arange(items, dtype=torch.float64) + 1) ** -1.1
    pop = (pop / pop.sum())[torch.randperm(items, generator=g)]
    fu, fi = torch.randn(users, 8, generator=g), torch.randn(items, 8, generator=g)
    bias = 1.5 * torch.randn(items, generator=g)

    def draw(n):
        u = torch.randint(0, users, (n,), generator=g)
        i = torch.multinomial(pop, n, replacement=True, generator=g)
        logit = (fu[u] * fi[i]).sum(1) / math.sqrt(8) * 3.0 + bias[i]
        return torch.stack([u, i], 1), (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()

    pt, yt = draw(n_train)
    pv, yv = draw(n_val)

    def make():
        torch.manual_seed(seed)
        return TwoTower(users, items)

    return T.Task("recsys", make, T._sampler(n_train, batch, seed, pt, yt), (pv, yv),
                  lambda m, b: F.binary_cross_entropy_with_logits(m(b[0]), b[1]), steps, batch)


TASKS = {"prose_lm": prose_lm, "digits": digits, "recsys": recsys}


# ---------------------------------------------------------------------- one run
def one_run(task, method, lr, rank, world, options=None):
    """(initial, final) held-out loss of one run; `options` (JSON dict) go to the 1-bit optimizer."""
    model = task.make_model()
    freeze = task.steps // 4
    kw = dict(lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    extra = optimizer_options(options or {}, nonfinite="raise")
    net = model
    if method == "adamw":
        net = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), **kw)
    elif method == "lamb":
        opt = lbcomm.Lamb(model.parameters(), **kw, comm=lbcomm.CommConfig(nonfinite="raise"))
    elif method == "onebit_adam":
        opt = construct(lbcomm.OneBitAdam, model.parameters(), **kw, freeze_step=freeze, **extra)
    elif method == "onebit_lamb":
        opt = construct(lbcomm.OneBitLamb, model.parameters(), **kw, freeze_step=freeze, **extra)
    else:
        opt = construct(lbcomm.ZeroOneAdam, model.parameters(), **kw, var_freeze_step=freeze,
                        **{"local_step_scaler": zeroone_local_step_scaler(task.steps), **extra})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: T.schedule_factor("cosine", s, task.steps))
    init = T.evaluate(task, model)
    for step in range(task.steps):
        b = task.batch(step)
        per = b[0].shape[0] // world
        part = tuple(t[rank * per:(rank + 1) * per] for t in b)
        opt.zero_grad(set_to_none=True)
        task.loss(net, part).backward()
        try:
            opt.step()
        except lbcomm.NonFiniteError:
            return init, float("nan")
        sched.step()
    final = T.evaluate(task, model)
    return init, final if math.isfinite(final) else float("nan")


# ---------------------------------------------------------------------- report
def table(results, tasks, pairs, seeds, lrs=None):
    lines = []
    for t in tasks:
        runs = [r for r in results if r["task"] == t and math.isfinite(r["final"])]
        if not runs:
            continue
        for pair in pairs:
            twin, family = PAIRS[pair]
            lines.append(f"\n{t}: {pair} / {twin} at the same lr, seeds {','.join(map(str, seeds))}")
            for lr in lrs or GRIDS[family]:
                cells = []
                for s in seeds:
                    by = {r["method"]: r for r in results if r["task"] == t and r["seed"] == s and r["lr"] == lr}
                    if twin not in by or pair not in by:
                        continue
                    best = min(r["final"] for r in runs if r["seed"] == s)
                    tw, ob = by[twin]["final"], by[pair]["final"]
                    left = (tw - best) / max(by[twin]["init"] - best, 1e-12) if math.isfinite(tw) else math.inf
                    mark = "" if left <= CONVERGED else "*"
                    cells.append(f"{tw:.4f} {ob:.4f} {'D' if not math.isfinite(ob) else f'{ob / tw:.3f}'}{mark}"
                                 if math.isfinite(tw) else "twin D")
                lines.append(f"  lr {lr:g}: " + " | ".join(cells))
    lines.append("\ncells: twin loss, 1-bit loss, ratio; *: the twin has over 20 % of the task's best drop left")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {', '.join(TASKS)}")
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"comma list of {', '.join(PAIRS)}")
    p.add_argument("--seeds", default="0", help="comma list of seeds (weights and batches)")
    p.add_argument("--steps", type=int, default=300, help="steps per run")
    p.add_argument("--options", default={}, type=json_options,
                   help="JSON dict of options for the 1-bit optimizers (hyperparameters and CommConfig fields), "
                        "e.g. '{\"exact_numel\": 1000000000}'")
    p.add_argument("--lrs", default="", help="comma list of lrs in place of the grids")
    p.add_argument("--json", default="", help="write every run's losses to this file")
    a = p.parse_args(argv)
    tasks, pairs = a.tasks.split(","), a.pairs.split(",")
    for name in tasks:
        if name not in TASKS:
            p.error(f"unknown task {name!r}: one of {', '.join(TASKS)}")
    for name in pairs:
        if name not in PAIRS:
            p.error(f"unknown pair {name!r}: one of {', '.join(PAIRS)}")
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
        lrs = [float(x) for x in a.lrs.split(",")] if a.lrs else None
    except ValueError as e:
        p.error(f"--seeds takes integers and --lrs numbers, comma-separated: {e}")
    if lrs and not all(math.isfinite(x) and x > 0 for x in lrs):
        p.error(f"--lrs must be positive: {a.lrs}")
    if a.steps < 8:
        p.error(f"--steps must be at least 8 (the freeze is at 25 % of them): {a.steps}")
    if "RANK" not in os.environ:
        p.error("run it under torchrun: torchrun --standalone --nproc-per-node 4 -m bench.heldout ...")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    methods = list(dict.fromkeys(m for pair in pairs for m in (PAIRS[pair][0], pair)))
    results = []
    for name in tasks:
        for seed in seeds:
            task = TASKS[name](seed, steps=a.steps)
            for m in methods:
                family = "lamb" if m in ("lamb", "onebit_lamb") else "adam"
                for lr in lrs or GRIDS[family]:
                    init, final = one_run(task, m, lr, rank, world, a.options)
                    results.append({"task": name, "seed": seed, "method": m, "lr": lr, "init": init, "final": final})
                    if rank == 0:
                        print(f"{name} seed {seed} {m} lr {lr:g}: {init:.4f} -> {final:.4f}", flush=True)
    if rank == 0:
        print(table(results, tasks, pairs, seeds, lrs))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"world": world, "steps": a.steps, "runs": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
