"""Large-batch schedules and the gradient noise scale.

The corpus, model and sample stream of bench/convergence.py (the byte-level LM on the
Python standard library, 4 gloo ranks): a base run at global batch B0 for T steps, then
runs at 4x and 16x B0 that see the same samples in the same order (step s of a run at k B0
takes base batches k s .. k s + k - 1 of the stream, split over the ranks):

    family     base run (B0)          at k B0
    SGD        momentum SGD           linear scaling (lr x k, warmup of the same samples);
                                      AdaScale (lbcomm.stats.AdaScale: lr x gain, the base
                                      schedule read at the scale-invariant step tau, stop
                                      at tau = T)
    LARS       lbcomm.Lars            sqrt scaling + LEGW (lbcomm.schedules)
    LAMB       lbcomm.Lamb            sqrt scaling (Lamb, and OneBitLamb with its variance
                                      frozen after 25 % of the steps)

Printed: for every run the samples it needed until its held-out loss first reached its
family's base-run final loss (in multiples of the base run's samples; target for AdaScale
at 4x: <= 1.1), and the measured gradient noise scale B_simple = tr(Sigma)/|G|^2 over
training (lbcomm.stats, exact in the base runs). OneBitLamb's compression stage feeds its
statistics from a coordinate sample (the exact mean is never formed); the bench also
averages the exact gradient beside it to report that estimator's deviation from exact.
Written: bench/results/large_batch.png (samples to the target loss by batch, the noise
scale over training) and, with --json, the raw curves.

    python -m bench.large_batch            # all runs (about 15 minutes on 2 loaded cores)
    python -m bench.large_batch --quick    # smoke test
"""
import argparse
import datetime
import json
import math
import os
import time

import torch
import torch.distributed as dist

import lbcomm
from lbcomm.stats import AdaScale, GradientNoiseScale, allreduce_gradients_

from .plotting import pyplot
from .convergence import ByteLM, evaluate, lm_loss, load_corpus, lr_factor, sample, spawn_ranks

FAMILY = {"sgd": "sgd", "sgd_linear": "sgd", "adascale_sgd": "sgd", "lars": "lars", "lars_legw": "lars",
          "lamb": "lamb", "lamb_sqrt": "lamb", "onebit_lamb": "lamb"}
LABEL = {"sgd": "SGD (base)", "sgd_linear": "SGD linear scaling", "adascale_sgd": "AdaScale(SGD)",
         "lars": "Lars (base)", "lars_legw": "Lars sqrt+LEGW", "lamb": "Lamb (base)", "lamb_sqrt": "Lamb sqrt",
         "onebit_lamb": "OneBitLamb sqrt"}
BASES = ("sgd", "lars", "lamb")


def batch_at(data, a, step, scale, rank, world):
    """This rank's share of step `step` at `scale` x the base batch: base batches
    scale*step .. scale*step + scale - 1 of convergence.py's stream."""
    seqs = torch.cat([sample(data, a.batch, a.ctx, seed=a.seed * 100003 + scale * step + j) for j in range(scale)])
    per = seqs.shape[0] // world
    return seqs[rank * per:(rank + 1) * per]


def exact_average(model, world):
    """Bench-only: the exact mean gradient's squared norm and the mean local squared norm
    (one extra fp32 allreduce), to compare the compression stage's sampled estimate with."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [torch.stack([g.float().square().sum() for g in grads])
                                                             .sum().reshape(1)])
    dist.all_reduce(flat)
    flat.div_(world)
    return flat[-1:], flat[:-1].square().sum()


def run(kind, scale, a, data, rank, world, val, target):
    torch.manual_seed(a.seed)
    model = ByteLM(a.d_model, a.layers, a.heads, a.ctx)
    B = a.batch * scale
    T = a.steps  # base steps
    steps = max(1, T // scale)  # the same samples as the base run
    warm = max(1, a.warmup // scale)  # the base warmup's samples
    stats = GradientNoiseScale(B // world, beta=a.beta, log_every=0)
    exact = None
    adascale = None
    sched = None
    common = dict(weight_decay=a.weight_decay)
    if kind in ("sgd", "sgd_linear", "adascale_sgd"):
        lr = a.sgd_lr * (scale if kind == "sgd_linear" else 1)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, **common)
        if kind == "adascale_sgd":
            adascale = AdaScale(opt, stats, base_batch=a.batch, batch=B)
            steps = max(1, int(a.adascale_budget * T / scale))
    elif kind in ("lars", "lars_legw"):
        lr = lbcomm.schedules.scaled_lr(a.lars_lr, a.batch, B, "sqrt")
        opt = lbcomm.Lars(model.parameters(), lr=lr, momentum=0.9, trust_coefficient=a.trust, **common)
        opt.gradient_stats = stats
        # LEGW: the base warmup in steps of this batch, grown linearly in epochs; where that
        # would be more than half of this run's steps (16x here), grown by sqrt(k) instead
        rule = "linear" if a.warmup <= steps // 2 else "sqrt"
        sched = lbcomm.schedules.LEGW(opt, base_warmup_steps=a.warmup / scale, batch_scale=scale,
                                      total_steps=steps, rule=rule, decay="cosine")
    else:
        lr = lbcomm.schedules.scaled_lr(a.lamb_lr, a.batch, B, "sqrt")
        kw = dict(betas=(0.9, a.beta2), eps=1e-8, **common)
        if kind == "onebit_lamb":
            opt = lbcomm.OneBitLamb(model.parameters(), lr=lr, freeze_step=max(1, steps // 4), **kw)
            exact = GradientNoiseScale(B // world, beta=a.beta, log_every=0)
        else:
            opt = lbcomm.Lamb(model.parameters(), lr=lr, **kw)
        opt.gradient_stats = stats
    peak = [g["lr"] for g in opt.param_groups]
    every = max(1, a.eval_every // scale)
    curve = [(0, evaluate(model, val))]
    noise, dev = [], []
    reached = None
    tau = 0.0
    t0 = time.perf_counter()
    step = 0
    while step < steps:
        if sched is None:
            f = lr_factor(tau, T, a.warmup) if adascale is not None else lr_factor(step, steps, warm)
            for g, lr0 in zip(opt.param_groups, peak):
                g["lr"] = lr0 * f
        seqs = batch_at(data, a, step, scale, rank, world)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, seqs)
        loss.backward()
        frozen = getattr(opt, "frozen", False)
        if exact is not None:
            local, gsq = exact_average(model, world)
            exact.observe(local, world, gsq)
        if kind in ("sgd", "sgd_linear", "adascale_sgd"):
            allreduce_gradients_(model.parameters(), stats)
        (adascale or opt).step()
        if sched is not None:
            sched.step()
        step += 1
        tau = adascale.scale_invariant_steps if adascale is not None else step * scale
        noise.append((step * B, stats.noise_scale, stats.grad_sq, stats.trace_sigma,
                      adascale.gain if adascale is not None else None))
        if exact is not None and frozen:
            dev.append((stats.grad_sq, stats.trace_sigma, stats.noise_scale, exact.grad_sq, exact.trace_sigma,
                        exact.noise_scale))
        if step % every == 0 or step == steps or (adascale is not None and tau >= T):
            v = evaluate(model, val)
            curve.append((step * B, v))
            if target is not None and reached is None and v <= target:
                reached = step * B
        if adascale is not None and tau >= T:
            break
    return dict(kind=kind, scale=scale, batch=B, steps=step, samples=step * B, curve=curve, noise=noise,
                final=curve[-1][1], reached=reached, seconds=time.perf_counter() - t0, tau=tau, deviation=dev)


def rank_main(rank, world, a, plan, data_path, init_file, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    data = torch.load(data_path)
    val = sample(data["val"], a.eval_seqs, a.ctx, seed=10**6)[rank::world]
    results, targets = [], {}
    for kind, scale in plan:
        fam = FAMILY[kind]
        r = run(kind, scale, a, data["train"], rank, world, val, targets.get(fam))
        if kind in BASES:
            targets[fam] = r["final"]
            r["reached"] = r["samples"]
        results.append(r)
        if rank == 0:
            base = a.steps * a.batch
            got = f"{r['reached'] / base:.2f}x" if r["reached"] else "not reached"
            print(f"  {LABEL[kind]:<20} {scale:>3}x batch {r['batch']:>5}: final {r['final']:.4f}, base loss {got} "
                  f"({r['samples'] / base:.2f}x samples run, {r['seconds']:.0f} s)", flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def report(results, a):
    base = a.steps * a.batch
    finals = {r["kind"]: r["final"] for r in results if r["kind"] in BASES}
    print(f"\nsamples to reach the base run's final held-out loss, in multiples of the base run's {base:,} samples "
          f"(B0 = {a.batch} sequences of {a.ctx} bytes, {a.steps} steps, {a.ranks} ranks)")
    scales = sorted({r["scale"] for r in results if r["scale"] > 1})
    print(f"{'method':<22}" + "".join(f"{f'{s}x (B={s * a.batch})':>22}" for s in scales))
    for kind in LABEL:
        if kind in BASES:
            continue
        cells = []
        for s in scales:
            r = next((x for x in results if x["kind"] == kind and x["scale"] == s), None)
            if r is None:
                cells.append("-")
                continue
            fam = finals.get(FAMILY[kind])
            cells.append(f"{r['reached'] / base:.2f}x" if r["reached"] else
                         f"no ({r['final'] / fam:.3f} of loss)" if fam else "no")
        if any(c != "-" for c in cells):
            print(f"{LABEL[kind]:<22}" + "".join(f"{c:>22}" for c in cells))
    print("base runs' final losses: " + ", ".join(f"{LABEL[k]} {v:.4f}" for k, v in finals.items()))
    for r in results:
        if r["kind"] == "adascale_sgd":
            gains = [n[4] for n in r["noise"] if n[4] is not None]
            print(f"AdaScale(SGD) at {r['scale']}x: mean gain {sum(gains) / len(gains):.2f} over {r['steps']} steps, "
                  f"tau {r['tau']:.0f} of {a.steps}, {r['samples'] / base:.2f}x samples"
                  + ("" if r["tau"] >= a.steps else " (stopped at the sample budget)"))
    print("\ngradient noise scale B_simple = tr(Sigma)/|G|^2 (sequences), measured in the base runs (EMA "
          f"{a.beta}), at 10 / 25 / 50 / 100 % of training:")
    for r in results:
        if r["kind"] in BASES:
            pts = [r["noise"][max(0, int(f * len(r["noise"])) - 1)][1] for f in (0.1, 0.25, 0.5, 1.0)]
            print(f"  {LABEL[r['kind']]:<14}" + " ".join(f"{x:>9.0f}" for x in pts))
    for r in results:
        if r["deviation"]:
            d = torch.tensor(r["deviation"], dtype=torch.float64)
            rel = (d[:, :3] - d[:, 3:]) / d[:, 3:].abs()
            n = sum(p.numel() for p in ByteLM(a.d_model, a.layers, a.heads, a.ctx).parameters())
            print(f"\nOneBitLamb {r['scale']}x compression stage ({len(d)} steps): sampled vs exact statistics "
                  f"(sketch of 4096 of the {n:,} coordinates), relative deviation of the smoothed values, mean (bias) / mean |.|:")
            for i, name in enumerate(("|G|^2", "tr(Sigma)", "B_simple")):
                print(f"  {name:<10} {float(rel[:, i].mean()):+.3f} / {float(rel[:, i].abs().mean()):.3f}")


def plot(results, a, path):
    plt = pyplot(path)
    if plt is None:
        return
    base = a.steps * a.batch
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), layout="constrained")
    ax = axes[0]
    finals = {r["kind"]: r["final"] for r in results if r["kind"] in BASES}
    for kind in LABEL:
        rs = sorted((r for r in results if r["kind"] == kind), key=lambda r: r["scale"])
        if kind in BASES or not rs:
            continue
        xs, ys = [], []
        for r in rs:  # held-out loss after the base run's samples, relative to the base run's final loss
            at = [v for x, v in r["curve"] if x <= base]
            xs.append(r["batch"])
            ys.append(at[-1] / finals[FAMILY[kind]] if at and math.isfinite(at[-1]) else float("nan"))
        ax.plot(xs, ys, "o-", label=LABEL[kind])
        for x, y, r in zip(xs, ys, rs):
            if r["reached"]:
                ax.annotate(f"{r['reached'] / base:.2f}x", (x, y), fontsize=7)
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global batch (sequences)")
    ax.set_ylabel("loss after the base samples / base loss")
    ax.set_title("(b) held-out loss after the base run's samples\n(1 = as good as the base run; NaN runs left out)",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax = axes[1]
    for r in results:
        xs, ys = zip(*r["curve"])
        ax.plot([x / base for x in xs], ys, lw=2 if r["kind"] in BASES else 1,
                label=f"{LABEL[r['kind']]} {r['scale']}x")
    lo = min(r["final"] for r in results)
    ax.set_ylim(lo - 0.1, lo + 1.5)
    ax.set_xlabel("samples / base samples")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title("held-out loss")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    ax = axes[2]
    for r in results:
        if r["kind"] in BASES or r["kind"] == "adascale_sgd":
            xs = [n[0] / base for n in r["noise"]]
            ax.plot(xs, [n[1] for n in r["noise"]], label=f"{LABEL[r['kind']]} {r['scale']}x")
    for s in sorted({r["scale"] for r in results}):
        ax.axhline(s * a.batch, color="grey", ls=":", lw=1)
        ax.text(0.01, s * a.batch, f" {s}x B0", color="grey", fontsize=8, va="bottom",
                transform=ax.get_yaxis_transform())
    ax.set_yscale("log")
    ax.set_xlabel("samples / base samples")
    ax.set_ylabel("B_simple (sequences)")
    ax.set_title("(c) measured gradient noise scale")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(f"byte-level LM on the Python stdlib, {a.ranks} gloo ranks, base batch {a.batch}x{a.ctx} bytes, "
                 f"{a.steps} base steps")
    fig.savefig(path, dpi=110)
    print(f"\nplots written to {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.large_batch",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=640, help="base-run steps")
    p.add_argument("--batch", type=int, default=32, help="base global batch (sequences)")
    p.add_argument("--scales", default="4,16")
    p.add_argument("--only", default="", help="comma list of methods (default: all): " + ",".join(LABEL))
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--sgd-lr", type=float, default=0.3)
    p.add_argument("--lars-lr", type=float, default=3.0)
    p.add_argument("--trust", type=float, default=0.02, help="Lars trust_coefficient")
    p.add_argument("--lamb-lr", type=float, default=1.5e-2)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--beta", type=float, default=0.95, help="EMA of the gradient statistics")
    p.add_argument("--adascale-budget", type=float, default=2.0, help="AdaScale's sample budget (x base)")
    p.add_argument("--eval-every", type=int, default=32, help="base steps between evaluations")
    p.add_argument("--eval-seqs", type=int, default=256)
    p.add_argument("--train-mb", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "large_batch.png"))
    p.add_argument("--json", default="")
    p.add_argument("--replot", default="", help="only report and plot the results of a --json file")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.eval_every, a.eval_seqs, a.train_mb = 64, 16, 64, 1.0
    a.scales = [int(s) for s in a.scales.split(",")]
    a.warmup = max(1, a.steps // 10)
    if a.batch % a.ranks:
        p.error(f"--batch {a.batch} must be a multiple of --ranks {a.ranks}")
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.replot:
        with open(a.replot) as f:
            doc = json.load(f)
        report(doc["results"], a)
        if a.plot:
            plot(doc["results"], a, a.plot)
        return
    only = set(a.only.split(",")) if a.only else set(LABEL)
    plan = [(k, 1) for k in BASES if k in only or any(FAMILY[o] == k for o in only)]
    plan += [(k, s) for s in a.scales for k in LABEL if k not in BASES and k in only]
    train, val, root, nfiles = load_corpus(int(a.train_mb * 2**20), 2**20)
    print(f"corpus: {root} ({nfiles} files); {len(plan)} runs on {a.ranks} gloo ranks; base batch {a.batch}, "
          f"{a.steps} base steps; scales {a.scales}")
    t0 = time.perf_counter()
    results = spawn_ranks(rank_main, a.ranks, (a, plan), train, val)
    report(results, a)
    if a.plot:
        plot(results, a, a.plot)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s wall")


if __name__ == "__main__":
    main()
