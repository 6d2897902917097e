"""A 1-bit optimizer's compression-stage step alone (OneBitAdam, or KIND: OneBitLamb, with
"/wd" LAMB's usual weight decay 0.01 and with "/decoded" norm_samples=0, the live ratio
on the decoded norm without the estimate (OneBitLamb/wd/decoded: both), or
OneBitAdam/nocap: without max_update's bound, so without the capped decode): P gloo
ranks, one thread each, the parameter shapes of `lbcomm-bench train`'s model (13.8M), STEPS
steps timed (median wall and CPU per step) and rank 0's profiled with cProfile, the top 25
functions by own time written to OUT. OneBitAdam uses only what every lbcomm release has, so
it compares checkouts: run it as a script from outside the checkouts, each on PYTHONPATH in turn.

    PYTHONPATH=/path/to/checkout python onebit_adam_profile.py P STEPS OUT [KIND]
"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def shapes():
    """The parameter shapes of lbcomm-bench train's model (its "small" preset, 13.8M)."""
    from lbcomm.cli.train import MODEL_PRESETS, TinyLM

    c = MODEL_PRESETS["small"]
    return [p.shape for p in TinyLM(c["vocab"], c["d_model"], c["layers"], c["heads"], c["seq_len"] + 1).parameters()]


def main(rank, p, steps, out, kind):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p)
    import lbcomm
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes()]
    if kind == "OneBitAdam/nocap":  # needs a release with OneBitOptions
        opt = lbcomm.OneBitAdam(params, lr=1e-3, freeze_step=2, options=lbcomm.OneBitOptions(max_update=None))
    elif kind.startswith("OneBitLamb/"):
        group = {"params": params, **({"norm_samples": 0} if kind.endswith("/decoded") else {})}
        opt = lbcomm.OneBitLamb([group], lr=1e-3, freeze_step=2, weight_decay=0.01 if "/wd" in kind else 0.0)
    else:
        opt = getattr(lbcomm, kind)(params, lr=1e-3, freeze_step=2)
    g = torch.Generator().manual_seed(rank)
    for t in range(4):
        for q in params:
            q.grad = torch.randn(q.shape, generator=g) * 1e-3
        opt.step()
    times, cpus = [], []
    prof = cProfile.Profile()
    for t in range(steps):
        for q in params:
            q.grad = torch.randn(q.shape, generator=g) * 1e-3
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if rank == 0:
            prof.enable()
        opt.step()
        if rank == 0:
            prof.disable()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    times.sort()
    cpus.sort()
    if rank == 0:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        with open(out, "w") as f:
            f.write(f"{kind}: {sum(q.numel() for q in params)} params, {p} ranks, median step "
                    f"{1e3 * times[len(times) // 2]:.1f} ms, cpu {1e3 * cpus[len(cpus) // 2]:.1f} ms\n" + s.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    p, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    kind = sys.argv[4] if len(sys.argv) > 4 else "OneBitAdam"
    kinds = ("OneBitAdam", "OneBitLamb", "OneBitLamb/decoded", "OneBitLamb/wd", "OneBitLamb/wd/decoded",
             "OneBitAdam/nocap")
    if kind not in kinds:
        sys.exit(f"KIND: one of {', '.join(kinds)}, not {kind!r}")
    mp.spawn(main, args=(p, steps, out, kind), nprocs=p)
