"""Small, fast, offline convergence tasks with different failure modes of 1-bit compression.

Every task generates its data from a fixed seed (the byte LM reads the Python standard
library, as bench/convergence.py does), and hands out global batches by step number, so
every optimizer sees exactly the same samples in the same order from the same weights.

    rare_features  multi-hot inputs whose features are active with heavy-tailed frequency
                   (most in a handful of samples), ReLU MLP: rarely active features
    dead_relu      dense inputs, ReLU MLP whose hidden units start with negative biases
                   (many nearly dead units)
    zipf_embed     bag of tokens drawn with Zipf frequency from a large vocabulary,
                   embedding table + linear head: rows rarely or never seen
    tabular        a vision-like task: 12x12 images of class templates with noise and
                   random shifts, a small conv net
    conv           a small CNN as users run them (Conv2d + GroupNorm + ReLU + pooling,
                   linear head) on 3-channel 16x16 images: each class a mixture of
                   smooth random textures, shifted, flipped, rescaled and noisy
    byte_lm        the byte-level transformer LM of bench/convergence.py, small

A task is a `Task`: make_model(), batch(step) -> the global batch, val (held-out set),
loss(model, batch), and an lr grid per optimizer family.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


__all__ = ["Task", "TASKS", "make_task", "lr_factor", "SCHEDULES", "schedule_factor"]

# lr grids per optimizer family, shared by every task (best of grid is reported)
GRIDS = {
    "adam": [1e-3, 3e-3, 1e-2, 3e-2],
    "lamb": [3e-3, 1e-2, 3e-2, 1e-1],
    "sgd": [0.03, 0.1, 0.3, 1.0],
    "lars": [0.3, 1.0, 3.0, 10.0],  # with trust_coefficient 0.02: steps of 0.6 % .. 20 % of ||w||
}


@dataclass
class Task:
    name: str
    make_model: Callable[[], nn.Module]
    batch: Callable[[int], Tuple[torch.Tensor, ...]]  # step -> global batch (tensors split along dim 0)
    val: Tuple[torch.Tensor, ...]
    loss: Callable[[nn.Module, Tuple[torch.Tensor, ...]], torch.Tensor]
    steps: int
    global_batch: int
    grids: Dict[str, List[float]] = field(default_factory=lambda: dict(GRIDS))
    weight_decay: float = 0.01
    beta2: float = 0.999


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10 % (as in bench/convergence.py)."""
    if step < warmup:
        return (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


# lr schedules of bench/suite.py (--schedule), the same for both twins: the factor of the lr at a step
SCHEDULES = {
    "cosine": "linear warmup over the first 10 % of the steps, cosine decay to 10 % (the default)",
    "constant": "the lr of the grid at every step",
    "long_warmup": "linear warmup over the first half of the steps (the lr doubles after the freeze at 25 %), "
                   "then cosine decay to 10 %",
    "cosine_zero": "linear warmup over the first 10 % of the steps, cosine decay to zero",
    "linear": "linear warmup over the first 10 % of the steps, linear decay to zero",
}


def schedule_factor(schedule: str, step: int, total: int) -> float:
    """The lr factor of `schedule` (a key of SCHEDULES) at `step` of `total`."""
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return lr_factor(step, total, max(1, total // 10))
    if schedule == "long_warmup":
        return lr_factor(step, total, max(1, total // 2))
    if schedule in ("cosine_zero", "linear"):
        warmup = max(1, total // 10)
        if step < warmup:
            return (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine_zero" else 1.0 - frac
    raise ValueError(f"unknown schedule {schedule!r}: one of {', '.join(SCHEDULES)}")


def rank_step(task, opt, lr: float, schedule: str, step: int, rank: int, world: int) -> Tuple[torch.Tensor, ...]:
    """One step's set-up on one rank: every param group's lr at `step` of the task's
    schedule, and this rank's slice of the step's global batch (the same samples in every
    run, whatever the optimizer)."""
    cur = lr * schedule_factor(schedule, step, task.steps)
    for g in opt.param_groups:
        g["lr"] = cur
    batch = task.batch(step)
    per = batch[0].shape[0] // world
    return tuple(t[rank * per:(rank + 1) * per] for t in batch)


def _ce(model, b):
    return F.cross_entropy(model(b[0]), b[1])


def _sampler(n: int, global_batch: int, seed: int, *tensors):
    def batch(step: int):
        g = torch.Generator().manual_seed(seed * 100003 + step)
        idx = torch.randint(0, n, (global_batch,), generator=g)
        return tuple(t[idx] for t in tensors)
    return batch


def _mlp(d_in, hidden, d_out, bias_init=None, seed=0):
    def make():
        torch.manual_seed(seed)
        layers, d = [], d_in
        for h in hidden:
            lin = nn.Linear(d, h)
            if bias_init is not None:
                nn.init.normal_(lin.bias, bias_init[0], bias_init[1])
            layers += [lin, nn.ReLU()]
            d = h
        layers.append(nn.Linear(d, d_out))
        return nn.Sequential(*layers)
    return make


# ---------------------------------------------------------------------- rare features
def rare_features(seed=0, steps=240, global_batch=128, n_train=8192, n_val=2048, d=1024, classes=8):
    g = torch.Generator().manual_seed(seed)
    freq = 0.25 * (torch.arange(d, dtype=torch.float64) + 1) ** -1.1  # heavy tail: most features rare
    freq = freq[torch.randperm(d, generator=g)]
    teacher = torch.randn(d, classes, generator=g) * 1.5

    def draw(n):
        x = (torch.rand(n, d, generator=g, dtype=torch.float64) < freq).float()
        logits = x @ teacher + 0.5 * torch.randn(n, classes, generator=g)
        return x, logits.argmax(1)

    xt, yt = draw(n_train)
    xv, yv = draw(n_val)
    return Task("rare_features", _mlp(d, [64], classes, seed=seed), _sampler(n_train, global_batch, seed, xt, yt),
                (xv, yv), _ce, steps, global_batch)


# ---------------------------------------------------------------------- dead ReLU units
def dead_relu(seed=0, steps=240, global_batch=128, n_train=8192, n_val=2048, d=32, classes=6):
    g = torch.Generator().manual_seed(seed + 1)
    w1, w2 = torch.randn(d, 64, generator=g), torch.randn(64, classes, generator=g)

    def draw(n):
        x = torch.randn(n, d, generator=g)
        logits = torch.relu(x @ w1 / math.sqrt(d)) @ w2 + 0.3 * torch.randn(n, classes, generator=g)
        return x, logits.argmax(1)

    xt, yt = draw(n_train)
    xv, yv = draw(n_val)
    # hidden biases around -1 (inputs of unit variance): half the units fire for under 5 % of the inputs
    return Task("dead_relu", _mlp(d, [128, 128], classes, bias_init=(-1.0, 0.5), seed=seed),
                _sampler(n_train, global_batch, seed, xt, yt), (xv, yv), _ce, steps, global_batch)


# ---------------------------------------------------------------------- heavy-tailed embedding
class BagModel(nn.Module):
    def __init__(self, vocab, dim, classes):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, classes))
        nn.init.normal_(self.emb.weight, std=0.1)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


def zipf_embed(seed=0, steps=240, global_batch=128, n_train=8192, n_val=2048, vocab=8192, length=12, classes=8,
               dim=16):
    g = torch.Generator().manual_seed(seed + 2)
    p = (torch.arange(vocab, dtype=torch.float64) + 1) ** -1.05
    p = (p / p.sum())[torch.randperm(vocab, generator=g)]
    token_class = torch.randn(vocab, classes, generator=g) * 2.0

    def draw(n):
        tok = torch.multinomial(p, n * length, replacement=True, generator=g).view(n, length)
        logits = token_class[tok].sum(1) + 0.5 * torch.randn(n, classes, generator=g)
        return tok, logits.argmax(1)

    tt, yt = draw(n_train)
    tv, yv = draw(n_val)

    def make():
        torch.manual_seed(seed)
        return BagModel(vocab, dim, classes)

    return Task("zipf_embed", make, _sampler(n_train, global_batch, seed, tt, yt), (tv, yv), _ce, steps,
                global_batch)


# ---------------------------------------------------------------------- vision-like
class SmallCNN(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 3 * 3, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(x.flatten(1))


def tabular(seed=0, steps=240, global_batch=128, n_train=8192, n_val=2048, classes=10, size=12):
    g = torch.Generator().manual_seed(seed + 3)
    templates = (torch.rand(classes, size, size, generator=g) < 0.25).float()

    def draw(n):
        y = torch.randint(0, classes, (n,), generator=g)
        x = templates[y]
        x = torch.stack([torch.roll(x[i], shifts=(int(a), int(b)), dims=(0, 1))
                         for i, (a, b) in enumerate(torch.randint(-2, 3, (n, 2), generator=g).tolist())])
        x = x * (0.5 + torch.rand(n, 1, 1, generator=g)) + 0.6 * torch.randn(n, size, size, generator=g)
        return x.unsqueeze(1), y

    xt, yt = draw(n_train)
    xv, yv = draw(n_val)

    def make():
        torch.manual_seed(seed)
        return SmallCNN(classes)

    return Task("tabular", make, _sampler(n_train, global_batch, seed, xt, yt), (xv, yv), _ce, steps, global_batch)


# ---------------------------------------------------------------------- CNN with GroupNorm
class GroupNormCNN(nn.Module):
    """Three Conv2d + GroupNorm + ReLU blocks (pooling after the first two), global average
    pooling, a linear head: the layer types of the image classifiers users train."""

    def __init__(self, classes, channels=(16, 32, 32), groups=4):
        super().__init__()
        layers, c_in = [], 3
        for j, c in enumerate(channels):
            layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.GroupNorm(groups, c), nn.ReLU()]
            if j < len(channels) - 1:
                layers.append(nn.MaxPool2d(2))
            c_in = c
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def conv(seed=0, steps=240, global_batch=128, n_train=8192, n_val=2048, classes=10, size=16, modes=2):
    """Class-conditional images from the seed: each class a mixture of `modes` smooth random
    3-channel textures (noise blurred twice, each normalized to zero mean and unit variance,
    so the class is in the spatial pattern, not in the brightness), drawn with a random
    circular shift, horizontal flip and gain, plus pixel noise of the textures' scale. Of the
    GroupNorm CNN's tensors, the two larger conv weights (4,608 and 9,216 elements) are above
    the default exact_numel: the 1-bit optimizers compress them and average the rest exactly."""
    g = torch.Generator().manual_seed(seed + 4)
    kernel = torch.ones(3, 1, 3, 3) / 9
    base = torch.randn(classes * modes, 3, size, size, generator=g)
    for _ in range(2):
        base = F.conv2d(F.pad(base, (1, 1, 1, 1), mode="circular"), kernel, groups=3)
    base = (base - base.mean((1, 2, 3), keepdim=True)) / base.std((1, 2, 3), keepdim=True)

    def draw(n):
        y = torch.randint(0, classes, (n,), generator=g)
        k = y * modes + torch.randint(0, modes, (n,), generator=g)
        shifts = torch.randint(-3, 4, (n, 2), generator=g).tolist()
        x = torch.stack([torch.roll(base[j], shifts=(a, b), dims=(1, 2)) for j, (a, b) in zip(k.tolist(), shifts)])
        flip = torch.rand(n, generator=g) < 0.5
        x[flip] = x[flip].flip(-1)
        x = x * (0.4 + 0.8 * torch.rand(n, 1, 1, 1, generator=g)) + 1.0 * torch.randn(x.shape, generator=g)
        return x, y

    xt, yt = draw(n_train)
    xv, yv = draw(n_val)

    def make():
        torch.manual_seed(seed)
        return GroupNormCNN(classes)

    return Task("conv", make, _sampler(n_train, global_batch, seed, xt, yt), (xv, yv), _ce, steps, global_batch)


# ---------------------------------------------------------------------- byte LM
def byte_lm(seed=0, steps=240, global_batch=32, ctx=32, d_model=32, layers=1, heads=2):
    from .convergence import ByteLM, load_corpus, lm_loss, sample  # the one implementation of the LM

    train, val, _, _ = load_corpus(2 * 2**20, 2**18)
    val_seqs = sample(val, 256, ctx, seed=10**6)

    def batch(step):
        return (sample(train, global_batch, ctx, seed=seed * 100003 + step),)

    def make():
        torch.manual_seed(seed)
        return ByteLM(d_model, layers, heads, ctx)

    grids = dict(GRIDS)
    return Task("byte_lm", make, batch, (val_seqs,), lambda m, b: lm_loss(m, b[0]), steps, global_batch, grids,
                beta2=0.99)


TASKS = {"rare_features": rare_features, "dead_relu": dead_relu, "zipf_embed": zipf_embed, "tabular": tabular,
         "conv": conv, "byte_lm": byte_lm}


def fine_grid(grid: List[float]) -> List[float]:
    """The grid with the geometric midpoint of each pair of neighbours inserted (3.16x steps
    become 1.8x): the best of a coarse grid also measures where between its points a
    method's best lr falls, and two twins whose best lrs differ by 1.7x land on different
    sides of a point."""
    out = []
    for a, b in zip(grid, grid[1:]):
        out += [a, float(f"{math.sqrt(a * b):.2g}")]
    return out + grid[-1:]


def make_task(name: str, quick: bool = False, seed: int = 0, grid: str = "coarse",
              steps: Optional[int] = None) -> Task:
    """grid: "coarse" (GRIDS, 4 lrs per family) or "fine" (`fine_grid` of it, 7 lrs);
    steps: the run's length (default: the task's, 80 with `quick`)."""
    if grid not in ("coarse", "fine"):
        raise ValueError(f"grid must be 'coarse' or 'fine', not {grid!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 8):
        raise ValueError(f"steps must be an int >= 8, not {steps!r}")
    kw = dict(seed=seed)
    if quick:
        kw["steps"] = 80
    if steps is not None:
        kw["steps"] = steps
    task = TASKS[name](**kw)
    if grid == "fine":
        task.grids = {k: fine_grid(v) for k, v in task.grids.items()}
    return task


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, chunk: int = 1024) -> float:
    """Mean loss over the whole held-out set."""
    n = task.val[0].shape[0]
    total = 0.0
    for i in range(0, n, chunk):
        part = tuple(t[i:i + chunk] for t in task.val)
        total += float(task.loss(model, part)) * part[0].shape[0]
    return total / n
