"""The 1-bit outer exchange of local updates at a noise floor, simulated in one process.

bench/ft_race.py's task (a 32-256-1 tanh MLP regressing tanh(x w) + 0.05 noise, AdamW
1e-3 inner steps, 4 replicas with their own batches, outer Nesterov SGD lr 0.7, momentum
0.9, H inner steps per round) trained to its noise floor, without processes or torchft:
the replicas are simulated, the first weight (8,192 elements) goes through the pure-torch
compressed allreduce of `lbcomm.testing.kernels` (the error feedback kept across rounds, as
lbcomm does), the other tensors are averaged exactly (as `exact_numel` does). Printed: the
final held-out loss of each variant and its ratio to the fp32 exchange of the same run.

Variants: ``fp32`` (DiLoCo's exchange), ``fold`` (what lbcomm sends: the outer momentum
u = beta b + Delta), ``delta`` (Delta itself, momentum applied after the exchange), each
1-bit one at every --block-sizes.

    python -m bench.outer_floor
    python -m bench.outer_floor --sync-every 30 --block-sizes 2048,256,32
    python -m bench.outer_floor --schedule cosine
"""
from __future__ import annotations

import argparse
import math

import torch

from lbcomm.testing import kernels as R

DIM, HIDDEN = 32, 256


def data(seed: int, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(7))
    x = torch.randn(n, DIM, generator=g)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def write(model, flat):
    o = 0
    for q in model.parameters():
        q.data.copy_(flat[o:o + q.numel()].view_as(q))
        o += q.numel()


def run(variant: str, block_size: int, a) -> float:
    """The final held-out loss of one variant."""
    p, H, beta = a.replicas, a.sync_every, a.outer_momentum
    torch.manual_seed(0)
    base = mlp()
    models = [mlp() for _ in range(p)]
    for m in models:
        m.load_state_dict(base.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=a.lr) for m in models]
    anchor = torch.cat([q.detach().reshape(-1) for q in base.parameters()])
    nc = next(base.parameters()).numel()  # the compressed tensor; the rest is exact
    chunk = -(-nc // p)
    worker = [torch.zeros(p, chunk) for _ in range(p)]
    server = [torch.zeros(chunk) for _ in range(p)]
    buf = torch.zeros_like(anchor)
    for t in range(1, a.steps + 1):
        f = 0.5 * (1 + math.cos(math.pi * t / a.steps)) if a.schedule == "cosine" else 1.0
        for r in range(p):
            for g in opts[r].param_groups:
                g["lr"] = a.lr * f
            x, y = data(10_000 * (r + 1) + t - 1)
            loss = torch.nn.functional.mse_loss(models[r](x), y)
            opts[r].zero_grad()
            loss.backward()
            opts[r].step()
        if t % H:
            continue
        deltas = [anchor - torch.cat([q.detach().reshape(-1) for q in m.parameters()]) for m in models]
        sent = [d + beta * buf for d in deltas] if variant == "fold" else deltas
        mean = torch.stack(sent).mean(0)
        if variant != "fp32":
            mean[:nc], worker, server = R.compressed_allreduce([s[:nc] for s in sent], worker, server, block_size)
        g = mean - beta * buf if variant == "fold" else mean
        buf = beta * buf + g
        anchor = anchor - a.outer_lr * (g + beta * buf)  # Nesterov
        for m in models:
            write(m, anchor)
    write(base, anchor)
    xe, ye = data(999, 1024)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(base(xe), ye))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.outer_floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--steps", type=int, default=900, help="inner steps")
    ap.add_argument("--sync-every", type=int, default=10, help="H")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW's (inner) lr")
    ap.add_argument("--schedule", choices=("constant", "cosine"), default="constant", help="of the inner lr")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--block-sizes", default="2048,256,32", help="comma-separated, for the 1-bit variants")
    ap.add_argument("--variants", default="fold,delta", help="1-bit variants: fold, delta")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ref = run("fp32", 0, a)
    print(f"fp32: final held-out loss {ref:.5f}")
    print("| variant | block size | final loss | / fp32 |")
    print("|---|---|---|---|")
    for v in a.variants.split(","):
        for b in (int(x) for x in a.block_sizes.split(",")):
            loss = run(v, b, a)
            print(f"| {v} | {b} | {loss:.5f} | {loss / ref:.3f} |", flush=True)


if __name__ == "__main__":
    main()
