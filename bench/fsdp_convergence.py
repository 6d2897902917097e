"""OneBitAdam on FSDP2 against HSDP + AdamW, same samples, same start.

The byte-level transformer and the data of bench/convergence.py (Python's standard library
source, held-out files for validation), on 4 local gloo ranks as 2 nodes x 2 ranks
(a 2-D DeviceMesh ("node", "local")). Runs, each from the same initial weights on the
same batches:

    hsdp_adamw        fully_shard(mesh=2-D mesh) (FSDP's native HSDP: reduce-scatter in
                      the node, fp32 all-reduce across nodes) + torch.optim.AdamW
    onebit_hsdp       fully_shard(mesh=mesh["local"]) + lbcomm.fsdp.onebit_hsdp (1-bit
                      all-reduce hook across nodes) + torch.optim.AdamW
    fsdp_onebit_adam  fully_shard(mesh=mesh["local"]) + lbcomm.fsdp.onebit_optimizer(...,
                      lbcomm.OneBitAdam): fp32 mean across nodes in the warmup, then the
                      sharded momentum compressed across nodes

Printed: the final validation loss of each run and its ratio to hsdp_adamw (target for
fsdp_onebit_adam: within 2 %), and the mean wall time per training step after the first 5
(loopback links on a shared machine: not a network measurement; step times on shaped links
are `lbcomm-bench train --nodes 2 --ranks-per-node 2 --bandwidth 1gbit`).

    python -m bench.fsdp_convergence            # 300 steps
    python -m bench.fsdp_convergence --quick    # smoke test
"""
from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lbcomm

from .cli_options import json_options
from .convergence import ByteLM, evaluate, lm_loss, load_corpus, lr_factor, sample

RUNS = ("hsdp_adamw", "onebit_hsdp", "fsdp_onebit_adam")
NODES, PER_NODE = 2, 2


def build(run, a, mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(a.seed)
    model = ByteLM(a.d_model, a.layers, a.heads, a.ctx)
    shard_mesh = mesh if run == "hsdp_adamw" else mesh["local"]
    for blk in model.blocks:
        fully_shard(blk, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    common = dict(lr=a.lr, betas=(0.9, a.beta2), eps=1e-8, weight_decay=a.weight_decay)
    if run == "fsdp_onebit_adam":
        opt = lbcomm.fsdp.onebit_optimizer(model, mesh, lbcomm.OneBitAdam, freeze_step=a.freeze, **common)
    else:
        if run == "onebit_hsdp":
            opts = dict(a.hsdp_options)
            comm = lbcomm.CommConfig(**{k: opts.pop(k) for k in ("block_size", "exact_numel", "nonfinite")
                                        if k in opts})
            lbcomm.fsdp.onebit_hsdp(model, mesh, comm=comm, **opts)
        opt = torch.optim.AdamW(model.parameters(), **common)
    return model, opt


def rank_main(rank, world, a, data_path, init_file, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("node", "local"))
    train, val = torch.load(data_path)
    per_rank = a.batch // world
    val_seqs = sample(val, a.final_eval_seqs, a.ctx, seed=10**6)[rank::world]
    results = {}
    for run in a.runs:
        model, opt = build(run, a, mesh)
        times = []
        for step in range(a.steps):
            seqs = sample(train, a.batch, a.ctx, seed=a.seed * 10**5 + step)[rank * per_rank:(rank + 1) * per_rank]
            for g in opt.param_groups:
                g["lr"] = a.lr * lr_factor(step, a.steps, max(1, a.steps // 10))
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            lm_loss(model, seqs).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        results[run] = {"val": evaluate(model, val_seqs), "step_s": sum(times[5:]) / max(1, len(times) - 5)}
        del model, opt
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.fsdp_convergence",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: a few steps")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64, help="global batch (sequences), split over the 4 ranks")
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--freeze-frac", type=float, default=0.25, help="freeze_step as a fraction of the steps")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--final-eval-seqs", type=int, default=512)
    p.add_argument("--train-mb", type=float, default=6.0)
    p.add_argument("--only", default="", help=f"comma list of {','.join(RUNS)} (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hsdp-options", default="", type=json_options,
                   help="JSON dict of onebit_hsdp's options, e.g. '{\"start_iter\": 75}'")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.final_eval_seqs, a.train_mb = 20, 64, 1.0
    a.runs = [r for r in RUNS if not a.only or r in a.only.split(",")]
    a.freeze = max(1, int(a.steps * a.freeze_frac))
    return a


def main(argv=None):
    a = parse_args(argv)
    world = NODES * PER_NODE
    train, val, _, _ = load_corpus(int(a.train_mb * 2**20), 2**20)
    with tempfile.TemporaryDirectory() as d:
        data_path, out_path = os.path.join(d, "data.pt"), os.path.join(d, "out.pt")
        torch.save((train, val), data_path)
        t0 = time.time()
        mp.start_processes(rank_main, args=(world, a, data_path, os.path.join(d, "init"), out_path), nprocs=world,
                           start_method="spawn")
        res = torch.load(out_path)
    print(f"{NODES} nodes x {PER_NODE} ranks (gloo, loopback), {a.steps} steps, global batch {a.batch}, "
          f"freeze_step {a.freeze}, lr {a.lr}, {time.time() - t0:.0f} s")
    base = res.get("hsdp_adamw")
    for run in a.runs:
        r = res[run]
        ratio = f"{r['val'] / base['val']:.4f}" if base else "-"
        print(f"  {run:18s} val loss {r['val']:.4f}   ratio to hsdp_adamw {ratio}   {1e3 * r['step_s']:.1f} ms/step")


if __name__ == "__main__":
    main()
