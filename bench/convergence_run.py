"""The runs of bench/convergence.py: the optimizers under comparison and one gloo rank's
training of the byte LM (bench/byte_lm.py) with each of them.

Every run starts from the same weights and reads the same samples; the rank counts what
its optimizer sends per step (lbcomm.comm.counting.CountingTransport), the optimizer's
state bytes (bench/state_bytes.py) and the validation loss along the way. `spawn_ranks`
starts the ranks with the corpus on disk; `average_grads` (the full-precision twins' data
parallelism) and `zeroone_local_step_scaler` are shared with bench/suite.py and others.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lbcomm
from lbcomm.comm.counting import CountingTransport

from .byte_lm import ByteLM, evaluate, lm_loss, sample
from .cli_options import construct, optimizer_options
from .state_bytes import state_bytes

BASELINE = {"onebit_adam": "adamw", "onebit_lamb": "lamb"}  # the block-size sweeps
TWIN = {**BASELINE, "zeroone": "adamw"}
LABEL = {"adamw": "AdamW", "lamb": "Lamb", "onebit_adam": "OneBitAdam", "onebit_lamb": "OneBitLamb",
         "zeroone": "ZeroOneAdam"}
KINDS = ("adamw", "onebit_adam", "zeroone", "lamb", "onebit_lamb")


# ---------------------------------------------------------------------- optimizers
def make_optimizer(kind, params, a, block):
    common = dict(betas=(0.9, a.beta2), eps=1e-8, weight_decay=a.weight_decay)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=a.adam_lr, **common)
    # non-finite steps raise, as a diverged run should
    extra = optimizer_options(a.onebit_options, block_size=block, nonfinite="raise")
    if kind == "onebit_adam":
        return construct(lbcomm.OneBitAdam, params, lr=a.adam_lr, freeze_step=a.freeze, **common, **extra)
    if kind == "zeroone":
        return lbcomm.ZeroOneAdam(params, lr=a.adam_lr, var_freeze_step=a.freeze,
                                  var_update_scaler=a.var_update_scaler, local_step_scaler=a.local_step_scaler,
                                  local_step_clipper=a.local_step_clipper, **common,
                                  **optimizer_options(a.zeroone_options, block_size=block, nonfinite="raise"))
    if kind == "lamb":
        return lbcomm.Lamb(params, lr=a.lamb_lr, comm=lbcomm.CommConfig(nonfinite="raise"), **common)
    return construct(lbcomm.OneBitLamb, params, lr=a.lamb_lr, freeze_step=a.freeze, **common, **extra)


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10 %."""
    if step < warmup:
        return (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


def average_grads(model, world):
    """The full-precision baseline's data parallelism: one fp32 allreduce of all gradients."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    o = 0
    for g in grads:
        g.copy_(flat[o:o + g.numel()].view_as(g))
        o += g.numel()


# ---------------------------------------------------------------------- one rank
def rank_main(rank, world, a, runs, data_path, init_file, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    data = torch.load(data_path)
    per_rank = a.batch // world
    val_quick = sample(data["val"], a.eval_seqs, a.ctx, seed=10**6)[rank::world]
    val_final = sample(data["val"], a.final_eval_seqs, a.ctx, seed=10**6 + 1)[rank::world]
    results = []
    for kind, block in runs:
        torch.manual_seed(a.seed)
        model = ByteLM(a.d_model, a.layers, a.heads, a.ctx)
        opt = make_optimizer(kind, model.parameters(), a, block)
        if kind not in ("adamw", "zeroone"):  # count what lbcomm's optimizers send (ZeroOneAdam counts itself)
            opt._transport = CountingTransport(opt.transport)
        n = sum(p.numel() for p in model.parameters())
        traffic = []  # (bytes, rounds) this rank sent per step
        peak = [g["lr"] for g in opt.param_groups]
        curve, train, diverged = [(0, evaluate(model, val_quick))], [], None
        t0, c0 = time.perf_counter(), time.process_time()
        for step in range(a.steps):
            for g, lr in zip(opt.param_groups, peak):
                g["lr"] = lr * lr_factor(step, a.steps, a.warmup)
            seqs = sample(data["train"], a.batch, a.ctx, seed=a.seed * 100003 + step)
            seqs = seqs[rank * per_rank:(rank + 1) * per_rank]  # this rank's share of the global batch
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model, seqs)
            loss.backward()
            if kind == "adamw":
                average_grads(model, world)
            before = (opt.transport.bytes_sent, opt.transport.rounds) if kind != "adamw" else None
            try:
                opt.step()
            except lbcomm.NonFiniteError:  # raised on every rank at the same step: stop this run
                diverged = step + 1
                break
            if kind == "adamw":  # average_grads: one fp32 ring allreduce
                traffic.append((int(round(2 * (world - 1) / world * 4 * n)), 1))
            else:
                traffic.append((opt.transport.bytes_sent - before[0], opt.transport.rounds - before[1]))
            train.append(loss.item())
            if (step + 1) % a.eval_every == 0 and step + 1 < a.steps:
                curve.append((step + 1, evaluate(model, val_quick)))
        seconds = time.perf_counter() - t0
        cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
        dist.all_reduce(cpu)  # CPU seconds of all ranks: on an idle machine wall ~ cpu / cores
        if diverged:
            final = float("nan")
        else:
            curve.append((a.steps, evaluate(model, val_quick)))
            final = evaluate(model, val_final)
        resident, saved = state_bytes(opt, model)
        comp = getattr(opt, "compression_state", None)
        results.append({
            "kind": kind, "block": block, "final": final, "curve": curve, "train": train, "seconds": seconds,
            "cpu_seconds": cpu.item(),
            "params": n, "state_bytes": resident, "checkpoint_bytes": saved,
            # what the optimizer reports it sends (compressed call, exact_numel share, agreement)
            "sent_per_step": (opt.bytes_per_step()["total"] if hasattr(opt, "bytes_per_step") and kind != "zeroone"
                              else comp.bytes_per_call() if comp is not None else 2 * (world - 1) * 4 * n // world),
            "skipped": getattr(opt, "skipped_steps", 0), "diverged": diverged, "traffic": traffic,
            "steps_by_kind": opt.comm_stats() if kind == "zeroone" else None,
            "masked": getattr(opt, "masked_coordinates", 0),
        })
        if rank == 0:
            print(f"  {LABEL[kind]:<11} block={str(block):<6} final val loss {final:.4f}  ({seconds:.0f} s)"
                  + (f"  DIVERGED: non-finite momentum at step {diverged}" if diverged else ""), flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def zeroone_local_step_scaler(steps: int) -> int:
    """ZeroOneAdam's alpha scaled to a run of `steps` (48 at 400 steps), as the paper's 32678
    is to ~10^5 steps; shared with bench/suite.py."""
    return max(1, round(0.12 * steps))


def spawn_ranks(rank_main, world: int, extra: tuple, train: torch.Tensor, val: torch.Tensor):
    """Run `rank_main(rank, world, *extra, data_path, init_dir, out_path)` on `world` spawned
    gloo ranks with the corpus in `data_path`; returns what rank 0 wrote to `out_path` (JSON).
    Shared by the benchmarks built on this corpus."""
    with tempfile.TemporaryDirectory() as d:
        data_path, out_path = os.path.join(d, "data.pt"), os.path.join(d, "results.json")
        torch.save({"train": train, "val": val}, data_path)
        mp.start_processes(rank_main, args=(world, *extra, data_path, os.path.join(d, "init"), out_path),
                           nprocs=world, start_method="spawn")
        with open(out_path) as f:
            return json.load(f)
