"""Per-step trajectories of lbcomm.Lamb and lbcomm.OneBitLamb under a decaying lr (a probe).

Both run on `--ranks` gloo ranks as bench.suite runs them (`suite.build`, the same batches,
weights and schedule, the freeze at 25 %); each step logs, per parameter tensor:

    rel_step   ||delta theta|| / (lr ||theta||): the step in units of Lamb's (1 for Lamb's
               unclamped trust ratio)
    coef       the coefficient applied (Lamb's trust ratio; OneBitLamb's c of its trust_ratio)
    c_live, c_frozen   OneBitLamb's live ratio and its frozen coefficient c_frz f ("max" takes
               the larger)
    u0_share   ||u0|| / ||u||: the adaptive direction's share of the direction (the rest is
               the weight decay wd theta)
    frozen_var ||m^ / d_frozen|| / ||m^ / d_fresh||: the frozen variance against the one the
               compressed momentum implies (its implied gradients carry the 1-bit error
               times 1 / (1 - beta1), so this grows with the error, not with the gradients);
               the frozen variance alone is `--methods lamb_frozen_var`
    signal_step  (compressed tensors) the step along the clean direction u* (from the mean
               over the ranks of exp_avg_local, one extra allreduce), in units of lr ||theta||;
               true_signal: ||u*|| / ||u||
    signal     the live ratio's estimated clean norm / the decoded ||u|| (raw_signal: the
               estimate before its floors 0.1 ||u|| and norm_step_bound's)

and per step the lr, the error feedback's error_ratio (compression_stats()), and every K
steps the validation loss. A summary table is printed per window of K steps; the whole
record goes to --json.

    python -m bench.lamb_decay_probe --task conv --schedule cosine_zero --lr 0.03 --every 24
    python -m bench.lamb_decay_probe --onebit-options '{"trust_ratio": "live"}' --json /tmp/probe.json
    python -m bench.lamb_decay_probe --methods lamb_frozen_var   # Lamb with the variance frozen, no compression
    python -m bench.lamb_decay_probe --methods onebit_lamb --variant boost_decay
                          # the norm estimate's allowance max(1, tau lr / lr_peak^2), shrinking with the lr
    python -m bench.lamb_decay_probe --methods onebit_lamb --onebit-options '{"trust_ratio": "live"}' --variant projb
                          # the live ratio divides by u's length along the clean direction (the exact u*)
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.distributed as dist

import lbcomm
import lbcomm.optim.lamb as lamb_mod
import lbcomm.optim.onebit_lamb as olamb_mod
from lbcomm.optim import functional as Fn

from . import suite
from . import tasks as T


def kind_of(name: str, p) -> str:
    if p.dim() == 4:
        return "conv_w"
    if p.dim() == 2:
        return "head_w"
    return "norm" if name.startswith("features.") and ".weight" in name else "bias"


class FrozenVarianceLamb(lbcomm.Lamb):
    """Lamb whose variance (and its bias correction) stops at step `freeze`, the gradients
    still averaged exactly: OneBitLamb's frozen variance without its compression."""
    freeze = 0

    def _moments(self, seg, decay_steps=1):
        if seg.step <= self.freeze:
            return super()._moments(seg, decay_steps)
        b1 = self.param_groups[seg.group]["betas"][0]
        self._flat["exp_avg"][seg.lo:seg.hi].lerp_(self._grad_buf[seg.lo:seg.hi], 1 - b1)

    def _bias_corrections(self, group, seg):
        b1, b2 = group["betas"]
        return 1 - b1 ** seg.step, 1 - b2 ** min(seg.vstep, self.freeze)


def local_source(opt, L, scale=None):
    """The compressed call's input from each rank's own momentum: (b1 m_local + (1-b1) g) k
    instead of (b1 m + (1-b1) g) k with m the decoded momentum; the exact parameters keep
    the decoded m (equal on every rank, so their mean is exact either way)."""
    ml, m = opt._flat["exp_avg_local"], opt._flat["exp_avg"]
    weights = [1 - opt.param_groups[gi]["betas"][0] for gi in L.group_of]

    def source(lo, hi, buf):
        for i, a, b in L.overlapping(lo, hi):
            o = L.offsets[i]
            out = buf[o + a - lo:o + b - lo]
            g = L.grad(i)
            out.zero_() if g is None else out.copy_(g.reshape(-1)[a:b])
            torch.lerp(ml[o + a:o + b], out, weights[i], out=out)
            if scale is not None:
                out.mul_(scale[i])

    source.momentum = (m, weights, scale)
    return source


def probe(rank, world, a, method, out_path, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    task = T.make_task(a.task, seed=a.seed, steps=a.steps)
    sa = suite.parse_args(["--tasks", a.task, "--schedule", a.schedule]
                          + (["--onebit-options", json.dumps(a.onebit_options)] if a.onebit_options else []))
    model = task.make_model()
    names = {id(p): n for n, p in model.named_parameters()}
    kinds = {id(p): kind_of(n, p) for n, p in model.named_parameters()}
    net, opt = suite.build("lamb" if method == "lamb_frozen_var" else method, model, a.lr, task, world, sa)
    if method == "lamb_frozen_var":
        opt.__class__ = FrozenVarianceLamb
        opt.freeze = suite.freeze_of(task, sa)
    if a.variant == "local_source":
        opt._onebit.momentum_source = lambda L, scale=None: local_source(opt, L, scale)
    if a.variant.startswith("blend"):  # beta (rho m + (1 - rho) m_local) + (1 - beta) g, rho = (lr / lr_peak)^k
        k = float(a.variant[len("blend"):] or 1)
        orig_source = type(opt._onebit).momentum_source

        def blended(L, scale=None):
            src = orig_source(opt._onebit, L, scale)
            ml, m = opt._flat["exp_avg_local"], opt._flat["exp_avg"]
            g0 = opt.param_groups[0]
            rho = (g0["lr"] / max(g0.get("lr_peak", 0.0), g0["lr"])) ** k
            b1 = [opt.param_groups[gi]["betas"][0] for gi in L.group_of]

            def source(lo, hi, buf):
                src(lo, hi, buf)
                for i, x, y in L.overlapping(lo, hi):
                    o = L.offsets[i]
                    d = (ml[o + x:o + y] - m[o + x:o + y]).mul_((1 - rho) * b1[i])
                    if scale is not None:
                        d.mul_(scale[i])
                    buf[o + x - lo:o + y - lo].add_(d)

            source.momentum = src.momentum
            return source

        opt._onebit.momentum_source = blended
    rec = {}  # id(p) -> this step's record

    orig_step = lamb_mod.lamb_step_
    smooth = {}

    def step_wrap(p, u, coef, lr):
        wd = task.weight_decay
        un = float(u.norm())
        u0n = float((u - wd * p).norm())
        r = rec.setdefault(id(p), {})
        if a.variant.startswith("smooth") and "raw_signal" in r:  # compressed: EMA of the coefficient
            beta = float(a.variant[len("smooth"):] or 0.9)
            prev = smooth.get(id(p))
            coef = coef if prev is None else prev.mul(beta).add_(coef, alpha=1 - beta)
            r["c_raw"] = float(r.get("c_live", 0.0))
            smooth[id(p)] = coef.clone()
        r.update(coef=float(coef.reshape(-1)[0]), u0_share=u0n / un if un > 0 else 1.0)
        orig_step(p, u, coef, lr)

    lamb_mod.lamb_step_ = step_wrap
    olamb_mod.lamb_step_ = step_wrap
    orig_lamb_step = olamb_mod.OneBitLamb._lamb_step

    def lamb_step_wrap(self, L, seg, i, u, ratio_max, u0n, un, live):
        group = self.param_groups[seg.group]
        p = L.tensor(i)
        r = rec.setdefault(id(p), {})
        if "share" in raw:
            r["raw_signal"] = raw.pop("share")
        if live is not None:
            r["c_live"] = float(Fn.trust_ratio(live[:1], live[1:], *group["coeff_range"]))
            r["signal"] = float(live[1]) / max(float(u.norm()), 1e-30)
        m, v, vf = self._flat["exp_avg"], self._flat["exp_avg_sq"], self._flat["exp_avg_sq_fresh"]
        o, n = L.offsets[i], L.numels[i]
        bc2 = self._bias_corrections(group, seg)[1]
        d = v[o:o + n].div(bc2).sqrt_().add_(group["eps"])
        df = vf[o:o + n].div(bc2).sqrt_().add_(group["eps"])
        r["frozen_var"] = float(m[o:o + n].div(d).norm() / m[o:o + n].div(df).norm().clamp_min(1e-30))
        if "raw_signal" in r:  # compressed: the clean direction u* from the ranks' own momenta (probe only)
            bc1 = self._bias_corrections(group, seg)[0]
            ml = self._flat["exp_avg_local"][o:o + n].clone()
            dist.all_reduce(ml)
            ustar = ml.div_(dist.get_world_size() * bc1).div_(d).clamp_(-1.0, 1.0).view_as(p)
            ustar.add_(p, alpha=group["weight_decay"])
            us = float(ustar.norm())
            r["true_signal"] = us / max(float(u.norm()), 1e-30)
            r["_proj"] = float((u * ustar).sum()) / max(us, 1e-30)  # <u, u*/||u*||>, times c below
            if a.variant in ("clean", "proj", "projb", "projs") and live is not None:  # the live ratio's norm, from u*
                nu = us if a.variant == "clean" else r["_proj"]
                if a.variant == "projs":  # ||u*|| from 256 coordinates: sqrt(<u, u*> / rho), rho = sum z^2 / sum u z
                    gen = torch.Generator().manual_seed(1009 * step_no[0] + len(rec))
                    at = torch.randint(u.numel(), (256,), generator=gen)
                    z, uu = ustar.reshape(-1)[at].double(), u.reshape(-1)[at].double()
                    den, pp = float((uu * z).sum()), float((u * ustar).sum())
                    nu = (pp / (float(z.square().sum()) / den)) ** 0.5 if den > 0 and pp > 0 else float(live[1])
                live = live.clone()
                floor = 0.1 * float(u.norm())
                tau = group.get("norm_step_bound")
                if a.variant in ("projb", "projs") and tau is not None:
                    peak = max(group["lr"], group.get("lr_peak", 0.0))
                    floor = max(floor, float(u.norm()) / max(1.0, tau / peak))
                live[1] = max(nu, floor)
        orig_lamb_step(self, L, seg, i, u, ratio_max, u0n, un, live)
        if olamb_mod._mode(group) != "live":
            r["c_frozen"] = float(self._vectors["lamb_coeff_freeze"][i] * self._vectors["last_factor"][i])

    olamb_mod.OneBitLamb._lamb_step = lamb_step_wrap
    orig_est = olamb_mod.OneBitLamb._estimated_norm
    raw = {}

    def est_wrap(sq, un, group):  # the estimate before its floors, for the record of the next _lamb_step
        raw["share"] = float(sq.clamp_min(0).sqrt() / un.double().clamp_min(1e-30))
        if a.variant == "boost_decay":  # the allowance max(1, tau / lr_peak) shrinks with lr / lr_peak
            peak = max(group["lr"], group.get("lr_peak", 0.0))
            g = dict(group, norm_step_bound=group["norm_step_bound"] * group["lr"] / peak)
            return orig_est(sq, un, g)
        return orig_est(sq, un, group)

    olamb_mod.OneBitLamb._estimated_norm = staticmethod(est_wrap)
    steps, log = task.steps, []
    step_no = [0]
    for step in range(steps):
        step_no[0] = step + 1
        part = T.rank_step(task, opt, a.lr, a.schedule, step, rank, world)
        cur = opt.param_groups[0]["lr"]
        opt.zero_grad(set_to_none=True)
        task.loss(net, part).backward()
        before = [p.detach().clone() for p in model.parameters()]
        rec.clear()
        opt.step()
        row = {"step": step + 1, "lr": cur, "params": {}}
        for p, b in zip(model.parameters(), before):
            r = rec.get(id(p), {})
            bn = float(b.norm())
            if "_proj" in r:  # the step along the clean direction, in units of lr ||theta|| (Lamb: 1)
                r["signal_step"] = r["coef"] * r.pop("_proj") / bn if bn > 0 else 0.0
            r["rel_step"] = float((p.detach() - b).norm()) / (cur * bn) if cur > 0 and bn > 0 else 0.0
            r["norm"] = float(p.detach().norm())
            r["kind"] = kinds[id(p)]
            row["params"][names[id(p)]] = r
        if hasattr(opt, "compression_stats"):
            row["error_ratio"] = opt.compression_stats()["error_ratio"]
        if (step + 1) % a.every == 0 or step + 1 == steps:
            row["val"] = T.evaluate(task, model)
        log.append(row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(log, f)
    dist.barrier()
    dist.destroy_process_group()


def summary(logs, every):
    """One line per window of `every` steps and method: lr, val loss at its end, and per kind
    of tensor the means of rel_step / u0_share (and OneBitLamb's c_live / c_frozen / share of
    steps where the frozen coefficient wins / frozen_var / signal), error_ratio."""
    for method, log in logs.items():
        print(f"\n{method}")
        print(f"{'steps':>9} {'lr':>8} {'val':>7} {'err':>5}  " + "  ".join(
            f"{k}: step u0sh cliv cfrz frzwin fvar sig" for k in ("conv_w", "head_w")))
        for lo in range(0, len(log), every):
            rows = log[lo:lo + every]
            lr = sum(r["lr"] for r in rows) / len(rows)
            val = rows[-1].get("val", float("nan"))
            err = [r["error_ratio"] for r in rows if "error_ratio" in r]
            cells = []
            for kind in ("conv_w", "head_w"):
                ps = [p for r in rows for p in r["params"].values() if p["kind"] == kind]

                def mean(key):
                    xs = [p[key] for p in ps if key in p]
                    return sum(xs) / len(xs) if xs else float("nan")

                both = [p for p in ps if "c_frozen" in p and "c_live" in p]
                win = sum(p["c_frozen"] > p["c_live"] for p in both) / len(both) if both else float("nan")
                cells.append(f"{mean('rel_step'):5.2f} {mean('u0_share'):4.2f} {mean('c_live'):4.2f} "
                             f"{mean('c_frozen'):4.2f} {win:6.2f} {mean('frozen_var'):4.2f} {mean('signal'):4.2f}")
            print(f"{rows[0]['step']:>4}-{rows[-1]['step']:<4} {lr:8.5f} {val:7.4f} "
                  f"{(sum(err) / len(err) if err else 0):5.2f}  " + "  ".join(f"{c:>38}" for c in cells))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.lamb_decay_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="conv")
    p.add_argument("--schedule", default="cosine_zero", choices=tuple(T.SCHEDULES))
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--every", type=int, default=24, help="validation loss and summary window, in steps")
    p.add_argument("--methods", default="lamb,onebit_lamb")
    p.add_argument("--onebit-options", default="", type=suite.json_options)
    p.add_argument("--variant", default="", choices=("", "boost_decay", "local_source", "smooth0.5", "smooth0.9", "smooth0.98", "blend", "blend2", "blend0.5",
                                                   "clean", "proj", "projb", "projs"),
                   help="boost_decay: OneBitLamb's norm-estimate allowance shrinks with lr / lr_peak; "
                   "local_source: OneBitLamb compresses each rank's own momentum (exp_avg_local); "
                   "smoothB: the compressed tensors' coefficient as an EMA with weight B; blendK: the compressed "
                   "input's momentum moved towards exp_avg_local as the lr falls, rho = (lr / lr_peak)^K; "
                   "clean: the live ratio divides by the true ||u*||; proj: by u's "
                   "length along u*, <u, u*> / ||u*|| (both from the probe's extra allreduce); "
                   "projb: proj under norm_step_bound's floor; "
                   "projs: projb with ||u*||^2 = <u, u*> sum z^2 / sum u z over 256 coordinates")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    logs = {}
    for method in a.methods.split(","):
        logs[method] = suite.spawn_ranks(probe, a.ranks, a, method)
    summary(logs, a.every)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "logs": logs}, f)


if __name__ == "__main__":
    main()
