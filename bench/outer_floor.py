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

``--fault A:B`` simulates the fault race's fault on the same task: the last replica is absent
from rounds A to B-1 and rejoins at round B, healed from replica 0 (its weights and inner
state; its first Delta is replica 0's). At each membership change the error feedback goes
by one of these rules (--fold), to find what the fault costs the 1-bit exchange and why:

* ``lbcomm``: as `lbcomm.ft.FaultTolerantLocalUpdates` does, e' = (p'/p) e + p' s on the
  span a survivor served, s' = 0, a joiner at zero;
* ``reset``: every error to zero (what the survivors owed is dropped);
* ``settle``: what the survivors owed is added to that round's mean at once, errors to zero;
* ``gather``: worker errors scaled by p'/p, server errors moved to the new partition (what
  an all-gather of them would do);
* ``oracle``: ``lbcomm`` plus the leaver's share, which no real run can keep;
* ``refold`` / ``nudge``: nobody leaves; at rounds A and B the errors are folded as by
  ``lbcomm`` / multiplied by 1 + 1e-6 (how sensitive the final loss is to any change).

Printed: each variant without and with the fault, and the ratio; --tail N averages the
held-out loss over the last N rounds (the final loss alone moves by a few % with any change),
--seed picks the replicas' batches.

    python -m bench.outer_floor --variants fold --block-sizes 32 --fault 30:60 --tail 20 --seed 1
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


def _fold(worker, server, old, new, nc, rule):
    """The error feedback of members `old` carried to members `new` (replica ids), and what
    the survivors owed (the mean of their folded errors), to be paid at once (rule "settle")
    or None."""
    p0, p1 = len(old), len(new)
    m0, m1 = R.chunk_size(nc, p0), R.chunk_size(nc, p1)
    out_w, out_s = {}, {}
    owed = torch.zeros(nc)
    lost = torch.zeros(nc)
    for i in old:
        if i not in new:
            lo = min(nc, old.index(i) * m0)
            hi = min(nc, lo + m0)
            lost += worker[i].reshape(-1)[:nc] / p0
            lost[lo:hi] += server[i][:hi - lo]
    if rule == "nudge":  # a perturbation of one part in a million: how chaotic is the final loss?
        return {i: w * (1 + 1e-6) for i, w in worker.items()}, server, None
    if rule == "gather":  # server errors moved to the new partition (one all-gather), worker errors scaled
        full = torch.zeros(max(p0 * m0, p1 * m1))
        for i in old:
            if i in new:
                lo = old.index(i) * m0
                full[lo:lo + m0] = server[i]
        full[nc:] = 0
        for i in new:
            e = torch.zeros(p1 * m1)
            if i in old:
                e[:nc] = worker[i].reshape(-1)[:nc] * (p1 / p0)
            j = new.index(i)
            out_w[i], out_s[i] = e.view(p1, m1), full[j * m1:(j + 1) * m1].clone()
        return out_w, out_s, None
    for i in new:
        e = torch.zeros(p1 * m1)
        if rule == "oracle" and i == new[0]:
            e[:nc] += p1 * lost
        if i in old and rule != "reset":
            lo = min(nc, old.index(i) * m0)
            hi = min(nc, lo + m0)
            e[:nc] = worker[i].reshape(-1)[:nc] * (p1 / p0)
            e[lo:hi] += p1 * server[i][:hi - lo]
            owed += e[:nc] / p1
        out_w[i], out_s[i] = e.view(p1, m1), torch.zeros(m1)
    if rule == "settle":
        return {i: torch.zeros_like(w) for i, w in out_w.items()}, out_s, owed
    return out_w, out_s, None


def run(variant: str, block_size: int, a, fault=None) -> float:
    """The final held-out loss of one variant (with `fault` (A, B): the last replica is out
    of rounds A..B-1)."""
    p, H, beta = a.replicas, a.sync_every, a.outer_momentum

    def members(k):
        out = a.fold in ("refold", "nudge")
        return [r for r in range(p) if out or not (fault and r == p - 1 and fault[0] <= k < fault[1])]
    torch.manual_seed(0)
    base = mlp()
    models = [mlp() for _ in range(p)]
    for m in models:
        m.load_state_dict(base.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=a.lr) for m in models]
    anchor = torch.cat([q.detach().reshape(-1) for q in base.parameters()])
    nc = next(base.parameters()).numel()  # the compressed tensor; the rest is exact
    chunk = R.chunk_size(nc, p)
    worker = {r: torch.zeros(p, chunk) for r in range(p)}
    server = {r: torch.zeros(chunk) for r in range(p)}
    now = list(range(p))
    buf = torch.zeros_like(anchor)
    owed = None
    xe, ye = data(999, 1024)
    tail = []
    for t in range(1, a.steps + 1):
        f = 0.5 * (1 + math.cos(math.pi * t / a.steps)) if a.schedule == "cosine" else 1.0
        k = -(-t // H)  # this step's round
        for r in members(k):
            for g in opts[r].param_groups:
                g["lr"] = a.lr * f
            x, y = data(10_000 * (r + 1) + 1_000_000 * a.seed + t - 1)
            loss = torch.nn.functional.mse_loss(models[r](x), y)
            opts[r].zero_grad()
            loss.backward()
            opts[r].step()
        if t % H:
            continue
        new = members(k)
        if new != now or (a.fold in ("refold", "nudge") and fault and k in fault):
            for j in set(new) - set(now):  # heals from replica 0: its weights and inner state
                models[j].load_state_dict(models[0].state_dict())
                opts[j].load_state_dict(opts[0].state_dict())
            worker, server, owed = _fold(worker, server, now, new, nc, a.fold)
            now = new
        deltas = [anchor - torch.cat([q.detach().reshape(-1) for q in models[r].parameters()]) for r in now]
        sent = [d + beta * buf for d in deltas] if variant == "fold" else deltas
        mean = torch.stack(sent).mean(0)
        if variant != "fp32":
            mean[:nc], ws, ss = R.compressed_allreduce([s[:nc] for s in sent], [worker[r] for r in now],
                                                       [server[r] for r in now], block_size)
            worker, server = dict(zip(now, ws)), dict(zip(now, ss))
            if owed is not None:  # paid at once: the owed errors are part of this round's mean
                mean[:nc] += owed
                owed = None
        g = mean - beta * buf if variant == "fold" else mean
        buf = beta * buf + g
        anchor = anchor - a.outer_lr * (g + beta * buf)  # Nesterov
        for m in models:
            write(m, anchor)
        if a.tail and t > a.steps - a.tail * H:  # the held-out loss of each of the last rounds
            write(base, anchor)
            with torch.no_grad():
                tail.append(float(torch.nn.functional.mse_loss(base(xe), ye)))
    if a.tail:
        return sum(tail) / len(tail)
    write(base, anchor)
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
    ap.add_argument("--seed", type=int, default=0, help="of the replicas' batches")
    ap.add_argument("--tail", type=int, default=0, help="report the mean held-out loss of the last TAIL rounds "
                                                        "(default: 0, the final loss)")
    ap.add_argument("--fault", default="", help="A:B, the last replica out of rounds A..B-1 (see above)")
    ap.add_argument("--fold", default="lbcomm", help="with --fault: the error rule (see above)",
                    choices=("lbcomm", "reset", "settle", "gather", "oracle", "refold", "nudge"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.fault:
        fault = tuple(int(x) for x in a.fault.split(":"))
        print("| variant | block size | without the fault | with it | ratio |")
        print("|---|---|---|---|---|")
        for v, b in [("fp32", 0)] + [(v, int(x)) for v in a.variants.split(",") for x in a.block_sizes.split(",")]:
            clean, hit = run(v, b, a), run(v, b, a, fault)
            print(f"| {v} | {b or '-'} | {clean:.5f} | {hit:.5f} | {hit / clean:.3f} |", flush=True)
        return
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
