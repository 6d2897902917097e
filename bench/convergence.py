"""Convergence of the 1-bit optimizers against their full-precision twins.

A small byte-level transformer language model is trained on the source text of Python's
own standard library (every machine has it offline: os.path.dirname(os.__file__)), with a
held-out split of whole files, on 4 local gloo ranks with large global batches. Every
optimizer sees exactly the same samples in the same order from the same initial weights:

    AdamW (torch, gradients allreduced)  vs  lbcomm.OneBitAdam and lbcomm.ZeroOneAdam
    lbcomm.Lamb                          vs  lbcomm.OneBitLamb

with the variance frozen after 25 % of the steps (--freeze-frac). The 1-bit optimizers also
run with block_size=None (the published single-scale scheme) and several block sizes, to
choose lbcomm.config.DEFAULT_BLOCK_SIZE; ZeroOneAdam (0/1 Adam) runs at the default block size with
var_freeze_step = freeze_step. Printed: the final validation loss of each run, the ratio to
its full-precision twin (target: within 1 %), the block-size table with the bytes each rank
sends per step, the bytes and communication rounds each rank really sent per step (counted
by lbcomm.comm.counting.CountingTransport; over the whole run and over the steps after
freeze_step), and the optimizer-state bytes per parameter; written: a PNG of the
validation-loss curves.

    python -m bench.convergence            # the full run: about 4 minutes on 2 idle cores
    python -m bench.convergence --quick    # smoke test: about 1 minute

The pieces: bench/byte_lm.py (corpus, model), bench/state_bytes.py (optimizer memory),
bench/convergence_run.py (the optimizers, one rank's runs) and bench/convergence_report.py
(the tables, the plot); this module is the CLI and re-exports their names.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import lbcomm

from .byte_lm import Block, ByteLM, evaluate, lm_loss, load_corpus, sample
from .cli_options import json_options
from .convergence_report import plot, report, traffic_report
from .convergence_run import (BASELINE, KINDS, LABEL, TWIN, average_grads, lr_factor, make_optimizer, rank_main,
                              spawn_ranks, zeroone_local_step_scaler)
from .state_bytes import MAX_STATE_DEPTH, state_bytes

__all__ = ["parse_args", "main", "Block", "ByteLM", "evaluate", "lm_loss", "load_corpus", "sample", "plot", "report",
           "traffic_report", "BASELINE", "KINDS", "LABEL", "TWIN", "average_grads", "lr_factor", "make_optimizer",
           "rank_main", "spawn_ranks", "zeroone_local_step_scaler", "MAX_STATE_DEPTH", "state_bytes"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.convergence",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: a few steps, a small model")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=64, help="global batch (sequences), split over the ranks")
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--freeze-frac", type=float, default=0.25, help="freeze_step as a fraction of the steps")
    p.add_argument("--adam-lr", type=float, default=4e-3)
    p.add_argument("--lamb-lr", type=float, default=1.5e-2)
    p.add_argument("--beta2", type=float, default=0.99,
                   help="beta2 of every optimizer (0.95 makes OneBitLamb's max-based factor unstable here)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--blocks", default="none,256,2048,16384",
                   help="block sizes of the 1-bit runs ('none': the single-scale scheme)")
    p.add_argument("--only", default="", help="comma list of adamw,onebit_adam,zeroone,lamb,onebit_lamb (default: all)")
    p.add_argument("--var-update-scaler", type=int, default=32,
                   help="ZeroOneAdam's kappa (paper: 16; 32 measured 0.5 points better on this run)")
    p.add_argument("--local-step-scaler", type=int, default=None,
                   help="ZeroOneAdam's alpha (default: 0.12 x --steps, scaled to the run as the paper's 32678 is "
                        "to ~10^5 steps; 48 at 400 steps keeps the bytes after freeze_step under half of "
                        "OneBitAdam's with every parameter compressed, 64 does not)")
    p.add_argument("--local-step-clipper", type=int, default=16, help="ZeroOneAdam's H (the paper's default)")
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--eval-seqs", type=int, default=128)
    p.add_argument("--final-eval-seqs", type=int, default=1024)
    p.add_argument("--train-mb", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "convergence.png"),
                   help="PNG to write ('' for none)")
    p.add_argument("--json", default="", help="also write the raw results here")
    p.add_argument("--zeroone-options", default="", type=json_options,
                   help="JSON dict of extra ZeroOneAdam options, e.g. "
                   "'{\"var_decay\": \"update\"}' (the paper's variance decay)")
    p.add_argument("--onebit-options", default="", type=json_options,
                   help="JSON dict of extra OneBitAdam/OneBitLamb options, e.g. "
                   "'{\"max_update\": \"auto\"}'")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.batch, a.eval_every, a.eval_seqs, a.final_eval_seqs, a.train_mb = 20, 32, 10, 32, 64, 1.0
        a.blocks = "none,2048"
        if a.local_step_scaler is None:  # every interval stays 1: ZeroOneAdam must equal OneBitAdam here
            a.local_step_scaler = 48
    a.blocks = [None if b.strip().lower() == "none" else int(b) for b in a.blocks.split(",") if b.strip()]
    a.freeze = max(1, round(a.freeze_frac * a.steps))
    if a.local_step_scaler is None:
        a.local_step_scaler = zeroone_local_step_scaler(a.steps)
    a.warmup = max(1, a.steps // 10)
    if a.batch % a.ranks:
        p.error(f"--batch {a.batch} must be a multiple of --ranks {a.ranks}")
    return a


def main(argv=None):
    a = parse_args(argv)
    kinds = [k for k in KINDS if not a.only or k in a.only.split(",")]
    runs = [(k, b) for k in kinds
            for b in (a.blocks if k in BASELINE else [lbcomm.config.DEFAULT_BLOCK_SIZE] if k in TWIN else [None])]
    train, val, root, nfiles = load_corpus(int(a.train_mb * 2**20), 2**20)
    n_params = sum(p.numel() for p in ByteLM(a.d_model, a.layers, a.heads, a.ctx).parameters())
    print(f"corpus: {root} ({nfiles} files): {train.numel():,} train bytes, {val.numel():,} held-out bytes")
    print(f"model: {n_params:,} parameters; {len(runs)} runs of {a.steps} steps on {a.ranks} gloo ranks "
          f"(freeze_step {a.freeze}, lbcomm {'with' if lbcomm.ops.HAS_EXTENSION else 'WITHOUT'} its C++ kernels)")
    t0 = time.perf_counter()
    results = spawn_ranks(rank_main, a.ranks, (a, runs), train, val)
    for r in results:
        r["curve"] = [tuple(c) for c in r["curve"]]
    report(results, a, a.plot)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items()}, "results": results}, f)
    cpu = sum(r["cpu_seconds"] for r in results)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s wall; training used {cpu:.0f} CPU seconds over all ranks "
          f"(~{cpu / min(a.ranks, os.cpu_count() or 1):.0f} s of wall time on {min(a.ranks, os.cpu_count() or 1)} "
          "otherwise idle cores)")


if __name__ == "__main__":
    main()
