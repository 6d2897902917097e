"""Elastic resume: what redistributing the error feedback (lbcomm.load_sharded, the default)
saves against resetting it (elastic=False) when a 1-bit optimizer resumes mid-compression
with another number of ranks.

bench/convergence.py's byte LM and data. For each (old, new) world size pair: OneBitAdam
trains on `old` ranks, saves every rank's shard halfway through the compression stage and
runs on uninterrupted (the reference); the checkpoint is then resumed on `new` ranks twice,
with the error feedback redistributed and reset, with the same global batches and lr
schedule. Printed: the final validation loss of each run and each resume's penalty
against the reference.

    python -m bench.elastic_resume                     # 4 -> 2 and 2 -> 4
    python -m bench.elastic_resume --quick             # smoke test
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lbcomm

from .cli_options import json_options
from .convergence import ByteLM, evaluate, lm_loss, load_corpus, lr_factor, make_optimizer, sample


def rank_main(rank, world, a, mode, ckpt, data_path, init_file, out_path):
    """mode "train": steps 0..steps, saving at a.save_at; "redistribute" / "reset": resume."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    data = torch.load(data_path)
    per_rank = a.batch // world
    val = sample(data["val"], a.final_eval_seqs, a.ctx, seed=10**6 + 1)[rank::world]
    torch.manual_seed(a.seed)
    model = ByteLM(a.d_model, a.layers, a.heads, a.ctx)
    opt = make_optimizer("onebit_adam", model.parameters(), a, a.block)
    peak = [g["lr"] for g in opt.param_groups]
    start = 0
    if mode != "train":
        lbcomm.load_sharded(ckpt, opt, model, elastic=mode == "redistribute")
        start = a.save_at
    after = []
    for step in range(start, a.steps):
        if mode == "train" and step == a.save_at:
            lbcomm.save_sharded(ckpt, opt, model)
        for g, lr in zip(opt.param_groups, peak):
            g["lr"] = lr * lr_factor(step, a.steps, a.warmup)
        seqs = sample(data["train"], a.batch, a.ctx, seed=a.seed * 100003 + step)[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, seqs)
        loss.backward()
        opt.step()
        if step >= a.save_at:
            t = loss.detach().double().view(1)
            dist.all_reduce(t)
            after.append(t.item() / world)
    final = evaluate(model, val)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"final": final, "train_after": after}, f)
    dist.destroy_process_group()


def launch(world, a, mode, ckpt, data_path, d):
    init, out = os.path.join(d, f"init-{mode}-{world}"), os.path.join(d, f"out-{mode}-{world}.json")
    mp.start_processes(rank_main, args=(world, a, mode, ckpt, data_path, init, out), nprocs=world,
                       start_method="spawn")
    with open(out) as f:
        return json.load(f)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.elastic_resume", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: a few steps")
    p.add_argument("--pairs", default="4:2,2:4", help="old:new world sizes, comma separated")
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--batch", type=int, default=64, help="global batch (sequences), split over the ranks")
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--freeze-frac", type=float, default=0.25)
    p.add_argument("--save-frac", type=float, default=0.5, help="checkpoint step as a fraction of the steps")
    p.add_argument("--adam-lr", type=float, default=4e-3)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--block", type=int, default=lbcomm.config.DEFAULT_BLOCK_SIZE)
    p.add_argument("--final-eval-seqs", type=int, default=512)
    p.add_argument("--train-mb", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--onebit-options", default="", type=json_options,
                   help="JSON dict of extra OneBitAdam options, e.g. '{\"max_update\": \"auto\"}'")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.batch, a.final_eval_seqs, a.train_mb = 24, 32, 64, 1.0
    a.freeze = max(1, round(a.freeze_frac * a.steps))
    a.save_at = max(a.freeze + 1, round(a.save_frac * a.steps))
    a.warmup = max(1, a.steps // 10)
    pairs = [tuple(int(x) for x in s.split(":")) for s in a.pairs.split(",")]
    for old, new in pairs:
        if a.batch % old or a.batch % new:
            p.error(f"--batch {a.batch} must be a multiple of {old} and {new}")
    train, val, _, _ = load_corpus(int(a.train_mb * 2**20), 2**20)
    n = sum(q.numel() for q in ByteLM(a.d_model, a.layers, a.heads, a.ctx).parameters())
    print(f"OneBitAdam on a {n:,}-parameter byte LM, {a.steps} steps, freeze_step {a.freeze}, checkpoint at step "
          f"{a.save_at}, global batch {a.batch}, block_size {a.block}")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        data_path = os.path.join(d, "data.pt")
        torch.save({"train": train, "val": val}, data_path)
        for old, new in pairs:
            ckpt = os.path.join(d, f"ckpt-{old}")
            ref = launch(old, a, "train", ckpt, data_path, d)
            res = {m: launch(new, a, m, ckpt, data_path, d) for m in ("redistribute", "reset")}
            rows.append((old, new, ref, res))
            k = min(10, a.steps - a.save_at)
            first = {m: sum(r["train_after"][:k]) / k for m, r in res.items()}
            ref_first = sum(ref["train_after"][:k]) / k
            print(f"\n{old} -> {new} ranks")
            print(f"  uninterrupted on {old}: final val loss {ref['final']:.4f}  (train loss, {k} steps after the "
                  f"checkpoint: {ref_first:.4f})")
            for m, r in res.items():
                print(f"  resumed, {m:<12}: final val loss {r['final']:.4f}  penalty {r['final'] - ref['final']:+.4f}"
                      f"  (train loss, {k} steps after: {first[m]:.4f}, {first[m] - ref_first:+.4f})")
            pen = {m: r["final"] - ref["final"] for m, r in res.items()}
            if pen["reset"] > 0:
                print(f"  redistribution removes {100 * (1 - pen['redistribute'] / pen['reset']):.0f} % of the reset's "
                      "final-loss penalty")
    return rows


if __name__ == "__main__":
    main()
