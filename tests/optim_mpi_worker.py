"""The optimizers end to end on one backend: tests/test_optim_mpi.py runs `train` in spawned
gloo ranks (backend="torch") and this file under plain mpirun (backend="mpi"):

    mpirun --allow-run-as-root --oversubscribe -np 3 python tests/optim_mpi_worker.py OUT_DIR

Gradients are set directly, on a 2^-16 grid with |g| < 4: the sum over 3 ranks is exact in
any order, so the warmup mean, and everything after it, must be bitwise the same on both
backends (the compressed allreduce is deterministic on both). Each rank also saves a
sharded checkpoint (the barrier goes through the transport), resumes from it in a fresh
optimizer and continues.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lbcomm  # noqa: E402

KINDS = ("OneBitAdam", "OneBitLamb", "Lamb")
STEPS, SAVE_AT, FREEZE = 10, 7, 3


def model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 4))


def make(kind: str, params, backend: str):
    if kind == "Lamb":
        return lbcomm.Lamb(params, lr=1e-2, weight_decay=0.01, comm=lbcomm.CommConfig(backend=backend))
    return getattr(lbcomm, kind)(params, lr=1e-2, weight_decay=0.01, freeze_step=FREEZE,
                                 comm=lbcomm.CommConfig(backend=backend, block_size=32, exact_numel=0))


def step(net: nn.Module, opt, rank: int, t: int) -> None:
    g = torch.Generator().manual_seed(31 * t + rank)
    for q in net.parameters():
        q.grad = ((torch.rand(q.shape, generator=g) * 2 - 1) * 65536).round_() / 65536 * (1 + rank)
    opt.step()


def train(rank: int, p: int, backend: str, ckpt: str):
    torch.set_num_threads(1)
    out = {}
    for kind in KINDS:
        net = model()
        opt = make(kind, net.parameters(), backend)
        params = []
        for t in range(STEPS):
            if t == SAVE_AT:
                lbcomm.save_sharded(os.path.join(ckpt, kind), opt, net, extra={"step": t}, backend=backend)
            step(net, opt, rank, t)
            params.append([q.detach().clone() for q in net.parameters()])
        net2 = model()
        opt2 = make(kind, net2.parameters(), backend)
        info = lbcomm.load_sharded(os.path.join(ckpt, kind), opt2, net2, backend=backend)
        resumed = []
        for t in range(info["extra"]["step"], STEPS):
            step(net2, opt2, rank, t)
            resumed.append([q.detach().clone() for q in net2.parameters()])
        comp = getattr(opt, "compression_state", None)
        out[kind] = {"params": params, "resumed": resumed, "exact": info["exact"],
                     "frozen": opt.frozen, "transport": type(opt.transport).__name__,
                     "worker_error": None if comp is None else comp.worker_error.clone()}
    return out


def main(out_dir: str) -> int:
    from lbcomm.comm import get_transport

    tr = get_transport(backend="mpi")
    rank, p = tr.rank, tr.world_size
    try:
        payload = {"ok": train(rank, p, "mpi", os.path.join(out_dir, "ckpt"))}
    except BaseException:
        payload = {"error": traceback.format_exc()}
    torch.save(payload, os.path.join(out_dir, f"{rank}.pt"))
    return 0 if "ok" in payload else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
