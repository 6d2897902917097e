"""Worked example: an adaptive global batch size by the norm test (lbcomm.stats.BatchSizeController).

bench/convergence.py's byte-level LM and sample stream on 4 gloo ranks, trained with
lbcomm.Lamb for a fixed number of samples. Each step accumulates
``controller.accumulation_steps`` micro batches per rank, the optimizer averages the
gradients (and feeds ``optimizer.gradient_stats``), and ``controller.update()`` then
decides the next global batch: it grows when the norm test tr(Sigma)/B <= eta^2 |G|^2
fails. The learning rate follows the square-root rule of the current batch. Printed: the
batch schedule (step, samples seen, new batch, measured noise scale), the steps taken and
the final held-out loss, next to a run at the fixed starting batch with the same samples.

    python -m bench.adaptive_batch             # about 3 minutes on 2 loaded cores
    python -m bench.adaptive_batch --samples 4096 --eval-seqs 64   # smaller
"""
import argparse
import datetime
import json

import torch
import torch.distributed as dist

import lbcomm
from lbcomm.stats import BatchSizeController, GradientNoiseScale

from .convergence import ByteLM, evaluate, lm_loss, load_corpus, sample, spawn_ranks


def train(a, data, val, rank, world, adaptive):
    torch.manual_seed(a.seed)
    model = ByteLM(a.d_model, a.layers, a.heads, a.ctx)
    stats = GradientNoiseScale(a.micro, beta=0.9, log_every=0)
    ctl = BatchSizeController(stats, micro_batch=a.micro, world_size=world, eta=a.eta, max_batch=a.max_batch)
    base = ctl.global_batch
    opt = lbcomm.Lamb(model.parameters(), lr=a.lr, betas=(0.9, 0.99))
    opt.gradient_stats = stats
    seen, step, schedule = 0, 0, [(0, 0, base, float("nan"))]
    while seen < a.samples:
        B, acc = ctl.global_batch, ctl.accumulation_steps
        for g in opt.param_groups:  # square-root rule, with a short warmup in samples
            g["lr"] = lbcomm.schedules.scaled_lr(a.lr, base, B, "sqrt") * min(1.0, (seen + B) / a.warmup_samples)
        # the next B samples of convergence.py's stream of micro batches, this rank's share
        seqs = torch.cat([sample(data, base, a.ctx, seed=a.seed * 100003 + seen // base + j) for j in range(acc)])
        mine = seqs[rank::world]
        opt.zero_grad(set_to_none=True)
        for j in range(acc):
            (lm_loss(model, mine[j * a.micro:(j + 1) * a.micro]) / acc).backward()
        opt.step()
        seen += B
        step += 1
        if adaptive and ctl.update() != B:
            schedule.append((step, seen, ctl.global_batch, stats.noise_scale))
    return dict(steps=step, samples=seen, final=evaluate(model, val), schedule=schedule,
                noise=stats.noise_scale, last_batch=ctl.global_batch)


def rank_main(rank, world, a, data_path, init_file, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    data = torch.load(data_path)
    val = sample(data["val"], a.eval_seqs, a.ctx, seed=10**6)[rank::world]
    out = {"fixed": train(a, data["train"], val, rank, world, False),
           "adaptive": train(a, data["train"], val, rank, world, True)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.adaptive_batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--micro", type=int, default=4, help="sequences per rank and micro batch")
    p.add_argument("--samples", type=int, default=12288, help="training sequences in all")
    p.add_argument("--eta", type=float, default=1.0, help="the norm test's tolerance")
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-2, help="Lamb's lr at the starting batch")
    p.add_argument("--warmup-samples", type=int, default=1024)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--eval-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    train_data, val, root, _ = load_corpus(4 * 2**20, 2**20)
    out = spawn_ranks(rank_main, a.ranks, (a,), train_data, val)
    print(f"Lamb on {a.ranks} ranks, {a.samples} sequences of {a.ctx} bytes, start batch {a.micro * a.ranks}, "
          f"norm test eta {a.eta}, max batch {a.max_batch}")
    print(f"{'step':>6}{'samples seen':>14}{'new batch':>11}{'B_simple':>10}")
    for step, seen, batch, ns in out["adaptive"]["schedule"]:
        print(f"{step:>6}{seen:>14}{batch:>11}{ns:>10.1f}")
    for k in ("fixed", "adaptive"):
        r = out[k]
        print(f"{k:>9}: {r['steps']} steps, final batch {r['last_batch']}, held-out loss {r['final']:.4f}, "
              f"noise scale at the end {r['noise']:.1f}")


if __name__ == "__main__":
    main()
