"""Checkpoints in the version-1 optimizer format (the flat buffers under the "lbcomm" key,
written by lbcomm before the optimizer core was split), kept in tests/data/checkpoint_v1.

Run once, with the lbcomm that writes that format, to (re)create the files:

    PYTHONPATH=$PWD python tests/old_checkpoints.py

Per optimizer (OneBitAdam, OneBitLamb, Lamb) two gloo ranks train a tiny model for SAVE_AT
steps (past the freeze of the 1-bit ones), save with `lbcomm.save_sharded`, then take
NEXT more steps and record the parameters after each. `test_checkpoint` loads the shards
with the current lbcomm and checks that the continuation is bitwise the recorded one.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import lbcomm

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "checkpoint_v1")
SAVE_AT, NEXT, FREEZE = 6, 4, 3
KINDS = ("OneBitAdam", "OneBitLamb", "Lamb")


def model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))


def optimizer(kind: str, params):
    kw = dict(lr=1e-2, weight_decay=0.01)
    if kind == "Lamb":
        return lbcomm.Lamb(params, **kw)
    return getattr(lbcomm, kind)(params, freeze_step=FREEZE, block_size=32, **kw)


def step(net: nn.Module, opt, rank: int, t: int) -> None:
    g = torch.Generator().manual_seed(100 * t + rank)
    x = torch.randn(8, 6, generator=g)
    y = torch.randint(0, 3, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    opt.step()


def _write(rank, p):
    for kind in KINDS:
        net = model()
        opt = optimizer(kind, net.parameters())
        for t in range(SAVE_AT):
            step(net, opt, rank, t)
        assert kind == "Lamb" or opt.frozen
        lbcomm.save_sharded(os.path.join(DATA, kind), opt, net, extra={"step": SAVE_AT})
        after = []
        for t in range(SAVE_AT, SAVE_AT + NEXT):
            step(net, opt, rank, t)
            after.append([q.detach().clone() for q in net.parameters()])
        torch.save(after, os.path.join(DATA, kind, f"expected-{rank}.pt"))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dist_util import run_ranks

    run_ranks(_write, 2)
    print(f"wrote {DATA}")
