"""What lbcomm.stats' per-step measurement costs against a training step, in one process.

The model and batch of ``lbcomm-bench train`` (TinyLM, preset "small" by default). In
alternating rounds: a plain training step (forward, backward, fused AdamW step), and the
same step followed by the statistics' local work on its gradients: ``measure(exact=True)``
(the squared norm, what `allreduce_gradients_`, the optimizers' warmup and `stats_hook`
compute; the hook's exact mode reads the result once more, timed as a second norm), and
``measure(exact=False)`` (a sample of 4096 coordinates alone, the compression stage and
``stats_hook(exact=False)``).
Their communication, one fp32 scalar or 4098 fp32 values in one allreduce per step, is
not in this figure: see ``lbcomm-bench train --methods
ddp_hook,ddp_stats,ddp_stats_sample,onebit_adam,onebit_adam_stats``.

    python bench/stats_cost.py [--preset small] [--rounds 10] [--steps 3]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from lbcomm.cli.train import MODEL_PRESETS, TinyLM  # noqa: E402
from lbcomm.stats import GradientNoiseScale  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=sorted(MODEL_PRESETS))
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = dict(MODEL_PRESETS[a.preset])
    if a.batch:
        cfg["batch"] = a.batch
    torch.manual_seed(0)
    model = TinyLM(cfg["vocab"], cfg["d_model"], cfg["layers"], cfg["heads"], cfg["seq_len"] + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq_len"] + 1))
    stats = GradientNoiseScale(cfg["batch"])
    grads = lambda: [q.grad for q in model.parameters()]  # noqa: E731

    def step():
        opt.zero_grad(set_to_none=True)
        model(tokens).backward()
        opt.step()

    variants = {
        "step": lambda: None,
        "exact": lambda: stats.measure(grads(), exact=True),
        "exact+result": lambda: (stats.measure(grads(), exact=True),
                                 torch.nn.utils.get_total_norm(grads(), 2.0).square()),
        "sample": lambda: stats.measure(grads(), exact=False),
    }
    times = {k: [] for k in variants}
    extra = {k: [] for k in variants}
    for _ in range(2):
        step()
    for _ in range(a.rounds):
        for k, f in variants.items():
            for _ in range(a.steps):
                t0 = time.perf_counter()
                step()
                t1 = time.perf_counter()
                f()
                t2 = time.perf_counter()
                times[k].append(t2 - t0)
                extra[k].append(t2 - t1)
    n = sum(q.numel() for q in model.parameters())
    base = statistics.median(times["step"])
    print(f"TinyLM preset {a.preset}: {n / 1e6:.2f}M parameters, batch {cfg['batch']} x {cfg['seq_len']} tokens, "
          f"{a.threads} thread(s); {a.rounds} alternating rounds x {a.steps} steps")
    print(f"{'variant':<14}{'step+stats ms':>15}{'stats ms':>10}{'stats / step':>14}")
    for k in variants:
        s = statistics.median(extra[k])
        print(f"{k:<14}{statistics.median(times[k]) * 1e3:>15.1f}{s * 1e3:>10.2f}{s / base:>13.2%}")


if __name__ == "__main__":
    main()
