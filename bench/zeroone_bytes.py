"""What ZeroOneAdam's schedule sends over a run, per option that trades bytes for same-lr parity.

ZeroOneAdam saves bytes twice over OneBitAdam: 1-bit steps between its variance steps
before var_freeze_step, and local steps between synchronizations after it. Both cost
convergence at AdamW's lr on short runs (docs/optimizers.md, "Same hyperparameters as the
twin"); this prints each setting's bytes sent per rank (`comm_stats`, counted on the wire)
against fp32 ring allreduces of the gradients at every step, on real gloo ranks, with the
convergence suite's schedule by default (240 steps, var_freeze_step at 25 %,
local_step_scaler 0.12 x steps). The model is one linear layer of about `--numel`
parameters, so the bytes of the compressed steps dominate as in a large model.

    python -m bench.zeroone_bytes                      # 4 ranks, 240 steps, 1M parameters
    python -m bench.zeroone_bytes --steps 2400 --numel 4000000
"""
import argparse
import datetime
import json
import math
from types import SimpleNamespace

import torch

from .convergence import zeroone_local_step_scaler
from .suite import freeze_of, spawn_ranks

# name, ZeroOneAdam options: today's defaults, then the two savings switched off alone and together
SETTINGS = (("defaults", {}), ("no local steps (local_step_clipper=1)", {"local_step_clipper": 1}),
            ("variance steps to the freeze (var_update_scaler=1000)", {"var_update_scaler": 1000}),
            ("both (OneBitAdam's schedule)", {"var_update_scaler": 1000, "local_step_clipper": 1}))


def _rank(rank, world, a, out_path, init_file):
    import torch.distributed as dist

    import lbcomm
    from lbcomm.common import ring_allreduce_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    width = max(1, math.isqrt(a.numel))
    freeze = freeze_of(SimpleNamespace(steps=a.steps))  # the suite's var_freeze_step rule
    rows = []
    for name, options in SETTINGS:
        torch.manual_seed(0)
        model = torch.nn.Linear(width, width)
        opt = lbcomm.ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=freeze,
                                 local_step_scaler=zeroone_local_step_scaler(a.steps), **options)
        gen = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
        for _ in range(a.steps):
            opt.zero_grad()
            model(torch.randn(8, width, generator=gen)).square().mean().backward()
            opt.step()
        n = sum(p.numel() for p in model.parameters())
        stats = opt.comm_stats()
        rows.append({"setting": name, "options": options, "bytes_sent": stats["bytes_sent"],
                     "fp32_bytes": a.steps * ring_allreduce_bytes(4 * n, world),
                     "steps": {k: v for k, v in stats.items() if k.endswith("_steps")}})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"numel": n, "freeze": freeze, "rows": rows}, f)
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--numel", type=int, default=1 << 20, help="parameters, about (one square linear layer)")
    a = p.parse_args(argv)
    if a.ranks < 2 or a.steps < 4 or a.numel < 1:
        p.error("need --ranks >= 2, --steps >= 4, --numel >= 1")
    res = spawn_ranks(_rank, a.ranks, a)
    print(f"ZeroOneAdam, {a.ranks} ranks, {res['numel']} parameters, {a.steps} steps, var_freeze_step "
          f"{res['freeze']}; bytes sent per rank / fp32 ring allreduces at every step")
    for r in res["rows"]:
        s = r["steps"]
        print(f"  {r['setting']:<54} 1/{r['fp32_bytes'] / r['bytes_sent']:.2f}   variance {s['variance_steps']}, "
              f"1-bit {s['onebit_steps']}, local {s['local_steps']}, sync {s['sync_steps']}")
    return res


if __name__ == "__main__":
    main()
