"""How far OneBitLamb's sampled clean-norm pass moves its estimate: `lbcomm-bench train`'s
model (the "small" preset, 13.8M parameters, eight fixed batches per rank) trained by
OneBitLamb (weight decay 0.01, freeze at step 10) on P gloo ranks; at every compressed step
the estimate of each parameter above `lamb_norm.PASS_BUDGET` is computed twice from the
same state, over all of it and sampled (every k-th block, the default), and the ratio
sampled / whole of the estimated squared norm is recorded (MODE "compare"). Training goes
on from the whole pass. Prints, per parameter size, k and the ratio's median and extremes
over the steps and parameters; the norm's own error is about half the squared norm's.
MODE "sampled" / "whole": a plain run with the default budget / with every parameter
passed over whole, for the loss alone (the mean of the last 10 steps' training loss).

    python -m bench.estimate_sampling [P] [STEPS] [LR] [MODE]
"""
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, p, steps, lr, mode, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p)
    import lbcomm
    from lbcomm.cli.train import MODEL_PRESETS, TinyLM
    from lbcomm.optim import lamb_norm

    c = MODEL_PRESETS["small"]
    torch.manual_seed(0)
    model = TinyLM(c["vocab"], c["d_model"], c["layers"], c["heads"], c["seq_len"] + 1)
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, c["vocab"], (4, c["seq_len"] + 1), generator=gen) for _ in range(8)]
    opt = lbcomm.OneBitLamb(model.parameters(), lr=lr, weight_decay=0.01, freeze_step=10)
    norms = opt._norms  # a measurement: the estimate computed twice from one state
    default, whole = lamb_norm.PASS_BUDGET, 1 << 62
    ratios = {}

    def both(L, segs, bounds):
        ml = opt.flat_state.buffers["exp_avg_local"]
        before = ml.clone()
        lamb_norm.PASS_BUDGET = default
        sampled, _ = lamb_norm.LambNorms.track_and_estimate(norms, L, segs, bounds)
        ml.copy_(before)
        lamb_norm.PASS_BUDGET = whole
        full, est = lamb_norm.LambNorms.track_and_estimate(norms, L, segs, bounds)
        lamb_norm.PASS_BUDGET = default
        for i in est:
            k = lamb_norm.pass_every(L.numels[i], False)
            if k > 1 and float(full[i]) > 0:
                ratios.setdefault((L.numels[i], k), []).append(float(sampled[i]) / float(full[i]))
        return full, est

    if mode == "compare":
        norms.track_and_estimate = both
    elif mode == "whole":
        lamb_norm.PASS_BUDGET = whole
    losses = []
    for t in range(steps):
        opt.zero_grad()
        loss = model(batches[t % 8])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if rank == 0:
        lines = [f"OneBitLamb, {sum(q.numel() for q in model.parameters())} parameters, {p} ranks, lr {lr}, "
                 f"{steps} steps, {mode}: loss {losses[0]:.4f} -> mean of the last 10 "
                 f"{statistics.fmean(losses[-10:]):.4f}, pass budget {lamb_norm.PASS_BUDGET}"]
        if mode == "compare":
            lines.append("numel      k  samples  ratio sampled/whole: median  min    max")
        every = []
        for (n, k), r in sorted(ratios.items()):
            every += r
            lines.append(f"{n:8d} {k:5d} {len(r):7d}  {statistics.median(r):26.4f} {min(r):6.4f} {max(r):6.4f}")
        if every:
            dev = sorted(abs(x - 1) for x in every)
            lines.append(f"all: {len(every)} estimates, |ratio - 1| median {statistics.median(dev):.4f}, "
                         f"90th percentile {dev[int(0.9 * (len(dev) - 1))]:.4f}, max {dev[-1]:.4f}")
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    p = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    lr = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-3
    mode = sys.argv[4] if len(sys.argv) > 4 else "compare"
    if mode not in ("compare", "sampled", "whole"):
        raise SystemExit(f"MODE must be compare, sampled or whole, got {mode!r}")
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"estimate_sampling_{os.getpid()}.txt")
    mp.spawn(run, args=(p, steps, lr, mode, out), nprocs=p)
    with open(out) as f:
        print(f.read(), end="")
    os.remove(out)
