"""DCT model parallelism: a recommendation model split over two ranks, the dense exchange
at the boundary against DCT's thresholded one (lbcomm.dct_mp.DCTBoundary).

The zipf_embed task of bench/tasks.py (BagModel: an embedding table of the Zipf-drawn
tokens, averaged per sample, then an MLP head): rank 0 holds the embedding table, rank 1
the head; the averaged embeddings cross the boundary forward, their gradients backward,
through the torch transport (counted by a CountingTransport). Every configuration trains
from the same weights on the same batches, each side with torch.optim.SGD(momentum 0.9)
at the same lr. Printed: the final validation loss (evaluated with a dense exchange) and
its ratio to the dense run's, the bytes per step both ways and the dense run's over them,
and the share of activations sent.

    python -m bench.dct_mp                                # densities 0.5, 0.1, 0.02, without and with residual
    python -m bench.dct_mp --densities 0.05 --steps 100
"""
from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lbcomm.comm import get_transport
from lbcomm.comm.counting import CountingTransport
from lbcomm.dct_mp import DCTBoundary

from . import tasks as T
from .suite import spawn_ranks


def one_run(rank, task, kw, a):
    model = task.make_model()  # both ranks build it from the task's seed; each keeps its part
    part = model.emb if rank == 0 else model.head
    opt = torch.optim.SGD(part.parameters(), lr=a.lr, momentum=0.9)
    raw = get_transport(backend="torch")
    tr = CountingTransport(raw)
    link = DCTBoundary(tr, **kw)
    dim = model.emb.embedding_dim
    for step in range(task.steps):
        for g in opt.param_groups:
            g["lr"] = a.lr * T.schedule_factor("cosine", step, task.steps)
        tok, y = task.batch(step)
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            x = model.emb(tok).mean(1)
            link.send(x)
            x.backward(link.recv_grad())
        else:
            x = link.recv((tok.shape[0], dim))
            F.cross_entropy(model.head(x), y).backward()
            link.send_grad(x.grad)
        opt.step()
    with torch.no_grad():  # the model itself: a dense exchange, not counted
        tok, y = task.val
        if rank == 0:
            raw.send_v(model.emb(tok).mean(1).contiguous().view(-1).view(torch.uint8), 1)
            final = None
        else:
            x = raw.recv_v(0).view(torch.float32).view(tok.shape[0], dim)
            final = float(F.cross_entropy(model.head(x), y))
    return {"final": final, "bytes": tr.bytes_sent, "fraction": link.sent_fraction, "steps": task.steps}


def rank_main(rank, world, a, out_path, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    task = T.make_task("zipf_embed", quick=a.quick)
    if a.steps:
        task.steps = a.steps
    configs = [("dense", {"density": None})]
    for d in a.densities:
        configs += [(f"dct {d}", {"density": d, "refresh_every": a.refresh_every, "residual": False}),
                    (f"dct {d} residual", {"density": d, "refresh_every": a.refresh_every, "residual": True})]
    results = []
    for name, kw in configs:
        t0 = time.perf_counter()
        r = one_run(rank, task, kw, a)
        both = [torch.zeros(2, dtype=torch.float64) for _ in range(2)]  # every rank's bytes and fraction
        dist.all_gather(both, torch.tensor([r["bytes"], r["fraction"]], dtype=torch.float64))
        r.update(name=name, bytes=sum(float(b[0]) for b in both), fraction=float(both[0][1]),
                 seconds=time.perf_counter() - t0)
        results.append(r)
        if rank == 1:
            print(f"  {name:<24} final {r['final']:.4f}  {r['bytes'] / r['steps']:.0f} B/step ({r['seconds']:.1f} s)",
                  flush=True)
    if rank == 1:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.dct_mp", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--densities", default="0.5,0.1,0.02", help="comma list of DCT densities")
    p.add_argument("--refresh-every", type=int, default=50, help="steps between threshold refreshes")
    p.add_argument("--lr", type=float, default=0.3, help="SGD lr of both parts")
    p.add_argument("--steps", type=int, default=0, help="steps per run (default: the task's)")
    p.add_argument("--quick", action="store_true", help="the task's short run (80 steps)")
    a = p.parse_args(argv)
    a.densities = [float(x) for x in a.densities.split(",") if x]
    return a


def main(argv=None):
    a = parse_args(argv)
    t0 = time.perf_counter()
    # the results file is written by rank 1, which holds the loss
    results = spawn_ranks(rank_main, 2, a)
    base = results[0]
    print(f"\nzipf_embed split over 2 ranks (embedding | MLP head), SGD momentum 0.9 lr {a.lr}, refresh_every "
          f"{a.refresh_every}; bytes: both directions, both ranks")
    print(f"{'exchange':<26}{'final':>8}{'/ dense':>9}{'B/step':>10}{'dense / it':>12}{'sent frac':>11}")
    for r in results:
        print(f"{r['name']:<26}{r['final']:>8.4f}{r['final'] / base['final']:>9.3f}{r['bytes'] / r['steps']:>10.0f}"
              f"{base['bytes'] / r['bytes']:>11.1f}x{r['fraction']:>11.4f}")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return results


if __name__ == "__main__":
    main()
