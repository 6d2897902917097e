"""The optimizers of bench/robust_sim.py on flat vectors: OneBitAdam / OneBitLamb and their
full-precision twins (`SimOneBit`), SGD momentum with and without the 1-bit hook
(`SimSGD`), each with the candidate rules of the study (listed in bench/robust_sim.py).
The ranks' gradients come in as one [p, n] tensor; the compression stage goes through the
simulated allreduce of bench/robust_sim_comm.py.
"""
from __future__ import annotations

import math
import re
from typing import Optional

import torch
from torch import Tensor

from .robust_sim_comm import Compressor, Flat, exact_mask


# ---------------------------------------------------------------------- optimizers
class SimOneBit:
    """OneBitAdam (lamb=False) or OneBitLamb (lamb=True) on flat vectors, with a rule.
    freeze=None: the full-precision twin (AdamW / Lamb) on averaged gradients."""

    def __init__(self, flat: Flat, p: int, *, lr, lamb: bool, freeze: Optional[int], rule="published",
                 betas=(0.9, 0.999), eps=1e-8, wd=0.01, block=2048, max_coeff=10.0, min_coeff=0.01,
                 coeff_beta=0.9, factor_max=4.0, factor_min=0.5, factor_threshold=0.1):
        self.rule_ex = rule  # with its _exN part (exact_mask); the rule itself without it
        rule = rule.split("_ex")[0] if "_ex" in rule else rule
        self.f, self.p, self.lr, self.lamb, self.freeze, self.rule = flat, p, lr, lamb, freeze, rule
        self.b1, self.b2 = betas
        self.eps, self.wd, self.block = eps, wd, block
        if "_b" in self.rule_ex:  # _bN: block size N
            self.block = int(self.rule_ex.split("_b")[1].split("_")[0])
        n = flat.n
        self.m, self.v = torch.zeros(n), torch.zeros(n)
        self.t = 0
        self.lamb_kw = (max_coeff, min_coeff, coeff_beta, factor_max, factor_min, factor_threshold)
        self.c_frz = torch.zeros(len(flat.numels))
        self.frozen = None
        self.first_update_ratio = None  # max |update| / lr at the first compressed step
        self.umax = adam_bound(betas, None)

    def _lamb_step(self, theta, u0s, cs):
        pass

    def step(self, theta: Tensor, grads: Tensor, lr: float) -> Tensor:
        b1, b2, eps, wd = self.b1, self.b2, self.eps, self.wd
        self.t += 1
        t = self.t
        bc1 = 1 - b1 ** t
        sl = self.f.slices()
        frozen_now = self.freeze is not None and t > self.freeze
        if "fv" in self.rule and ("fvf" not in self.rule or frozen_now):
            # EMA of the ranks' mean squared local gradients (factored when used); fvf: from the
            # freeze on, started at p x the frozen variance (so that the bound starts at d)
            sq = (grads * grads).mean(0)
            if "fvf" in self.rule and getattr(self, "vloc", None) is None:
                self.vloc = self.v / (1 - self.b2 ** self.freeze) * self.p
            self.vloc = sq.clone() if getattr(self, "vloc", None) is None else self.vloc.mul_(b2).add_(sq, alpha=1 - b2)
        if "_vs" in self.rule_ex:  # per tensor: EMA (b2) of the mean square of the averaged (vso) or local (vsl) gradients
            x = grads.mean(0).square() if "_vso" in self.rule_ex else self.m.square() if "_vsm" in self.rule_ex \
                else grads.square().mean(0)
            qi = torch.stack([x[s].mean() for s in sl])
            t0 = self.freeze if "_vsf" in self.rule_ex else 0  # vsf: from the first compressed step on
            if t > t0:
                self.q = qi * (1 - b2) if t == t0 + 1 else self.q * b2 + (1 - b2) * qi
            if self.freeze is not None and t == self.freeze and not t0:
                self.q_frz = self.q / (1 - b2 ** t)
            if t0 and t == t0 + 1:
                self.q_frz = qi
        if self.freeze is None or t <= self.freeze:
            g = grads.mean(0)
            self.m.lerp_(g, 1 - b1)
            self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
            d = self.v.sqrt() / math.sqrt(1 - b2 ** t) + eps
            u = self.m / bc1 / d
            if "clipall" in self.rule or "clipcoord" in self.rule:  # running max of |u| over the warmup
                self.urun = u.abs() if getattr(self, "urun", None) is None else torch.maximum(self.urun, u.abs())
            if not self.lamb:
                theta = theta * (1 - lr * wd) - lr * u
            else:
                maxc, minc, cb = self.lamb_kw[:3]
                u = u + wd * theta
                new = theta.clone()
                for i, s in enumerate(sl):
                    pn, un = theta[s].norm(), u[s].norm()
                    c = (pn / un).clamp(minc, maxc) if pn > 0 and un > 0 else torch.tensor(1.0)
                    if c != 1:
                        self.c_frz[i] = cb * self.c_frz[i] + (1 - cb) * c
                    new[s] = theta[s] - lr * c * u[s]
                theta = new
            if self.freeze is not None and t == self.freeze:
                self.theta_last = theta
                self._on_freeze()
            return theta
        return self._compressed(theta, grads, lr)

    def _on_freeze(self):
        b2, eps = self.b2, self.eps
        d = self.v.sqrt() / math.sqrt(1 - b2 ** self.freeze) + eps
        thr = {"mask1e-3": 1e-3}.get(self.rule, 1e-10) * float(self.v.mean())
        keep = self.v > thr
        if self.rule == "floor":
            d = torch.maximum(d, 0.1 * _block_rms(d, self.block))
        u_last = (self.m / (1 - self.b1 ** self.freeze) / d).abs()
        umax_p = torch.cat([u_last[s].max().expand(s.stop - s.start) for s in self.f.slices()])
        if getattr(self, "urun", None) is not None:
            umax_p = self.urun.clone() if "clipcoord" in self.rule else \
                torch.cat([self.urun[s].max().expand(s.stop - s.start) for s in self.f.slices()])
        fz = {"d": d, "keep": keep, "umax_p": umax_p, "comp": Compressor(self.f.n, self.p, self.block,
                                                       "meanabs" if self.rule == "meanabs" else "rms")}
        fz["comp"].exact = exact_mask(self.f, self.rule_ex)
        if self.lamb:
            rms = torch.stack([self.m[s].norm() / math.sqrt(s.stop - s.start) for s in self.f.slices()])
            k = torch.where(rms > 0, rms.mean() / rms, torch.ones_like(rms))
            fz["k"] = torch.cat([torch.full((s.stop - s.start,), float(k[i])) for i, s in enumerate(self.f.slices())])
            fz["v_fresh"] = self.v.clone()
            fz["f_last"] = torch.ones(len(self.f.numels))
            fz["c"] = torch.where(self.c_frz == 0, torch.ones_like(self.c_frz), self.c_frz)
            fz["wn"] = torch.stack([self.theta_last[s].norm() for s in self.f.slices()])
        self.frozen = fz

    def _compressed(self, theta, grads, lr):
        b1, b2, eps, wd = self.b1, self.b2, self.eps, self.wd
        fz = self.frozen
        t, bc1 = self.t, 1 - b1 ** self.t
        d, keep = fz["d"], fz["keep"]
        local = torch.lerp(self.m.expand_as(grads), grads, 1 - b1)  # [p, n]
        precond = self.rule.startswith("precond")
        if self.rule == "uclip":  # compress the update direction, clamped to +-1 on the way in and out
            x = torch.where(keep, local / d, 0.0).clamp_(-bc1, bc1)
            new_m = fz["comp"](x).clamp_(-bc1, bc1) * d
        elif precond:
            # masked coordinates enter as 0: a tiny d must not inflate its block's scale
            new_m = fz["comp"](torch.where(keep, local / d, 0.0)) * d
        elif self.lamb:
            new_m = fz["comp"](local * fz["k"]) / fz["k"]
        else:
            new_m = fz["comp"](local)
        new_m = torch.where(keep, new_m, 0.0)
        if not torch.isfinite(new_m).all():
            raise FloatingPointError("non-finite momentum")
        if self.lamb:  # the fresh variance, from the implied gradient of the decoded momentum
            gt = (new_m - b1 * self.m) / (1 - b1)
            fz["v_fresh"].mul_(b2).addcmul_(gt, gt, value=1 - b2)
        d_fresh = fz["v_fresh"].sqrt() / math.sqrt(1 - b2 ** self.freeze) + eps if self.lamb else None
        if self.rule.startswith("fresh"):  # the denominator never below (a fraction of) the fresh one's
            digits = self.rule.split("_")[0][5:]
            frac = float(digits) / 10 ** (len(digits) - 1) if digits else 1.0
            u0 = new_m / bc1 / torch.maximum(d, frac * d_fresh)
        elif "fv" in self.rule:
            # the denominator never below the factored local second moment / p: a lower bound on
            # E[(mean gradient)^2] = mu^2 + sigma^2 / (p b) >= (mu^2 + sigma^2 / b) / p
            shapes = [tuple(q.shape) for q in self.f.params]
            vf = factored(self.vloc, shapes) / (1 if "fvfull" in self.rule else math.sqrt(self.p) if "fvhalf" in self.rule else self.p)
            d_fv = vf.sqrt() + eps  # started at its first value: no bias to correct
            u0 = new_m / bc1 / torch.maximum(d, d_fv)
        elif "_vs" in self.rule_ex:  # the frozen denominator rescaled per tensor by the gradient scale's change
            t0 = self.freeze if "_vsf" in self.rule_ex else 0
            ratio = (self.q / (1 - b2 ** (t - t0))) / self.q_frz.clamp_min(1e-30)
            if "_vslc" in self.rule_ex or "_vsmc" in self.rule_ex or "_vsfc" in self.rule_ex:
                ratio = ratio.clamp(max=1.0)
            sc = torch.cat([ratio[i].sqrt().expand(s.stop - s.start) for i, s in enumerate(self.f.slices())])
            u0 = new_m / bc1 / ((d - eps) * sc + eps)
        else:
            u0 = new_m / bc1 / d
        if self.rule.startswith("fresh") and "clip" not in self.rule:
            pass
        elif self.rule.endswith("clip") or "clip_" in self.rule:
            u0 = u0.clamp(-1.0, 1.0)
        elif "clipmax" in self.rule:
            u0 = u0.clamp(-self.umax, self.umax)
        elif "clipall" in self.rule or "clipcoord" in self.rule:  # the warmup's running max, per tensor / coordinate
            k = float(re.search(r"clip(?:all|coord)([0-9.]*)", self.rule).group(1) or 1)
            u0 = torch.maximum(torch.minimum(u0, k * fz["umax_p"]), -k * fz["umax_p"])
        elif "clipwarm" in self.rule:  # per tensor: the largest |u| of the last warmup step (x K: clipwarmK)
            k = float(self.rule.split("clipwarm")[1].split("_")[0] or 1)
            u0 = torch.maximum(torch.minimum(u0, k * fz["umax_p"]), -k * fz["umax_p"])
        if not self.lamb:
            self.m = new_m
            new = theta * (1 - lr * wd) - lr * u0
        else:
            maxc, minc, cb, fmax, fmin, fthr = self.lamb_kw
            self.m = new_m
            ratio = d / d_fresh
            new = theta.clone()
            for i, s in enumerate(self.f.slices()):
                f = ratio[s].max()
                u = u0[s] + wd * theta[s]
                if wd != 0:
                    u0n, un = u0[s].norm(), u.norm()
                    r = (u0n / un).clamp(max=1.0) if un > 0 else torch.tensor(1.0)
                    f = f * r + (1 - r)
                f = f.clamp(fmin, fmax)
                last = fz["f_last"][i]
                f = torch.clamp(f, min=last * (1 - fthr), max=last * (1 + fthr))
                fz["f_last"][i] = f
                if "_nof" in self.rule:  # no variance factor: the frozen coefficient alone
                    f = torch.tensor(1.0)
                coef = fz["c"][i] * f
                if "_wn" in self.rule:  # the frozen coefficient follows ||w|| (LAMB's c is ||w|| / ||u||)
                    pn = theta[s].norm()
                    if fz["wn"][i] > 0:
                        coef = coef * pn / fz["wn"][i]
                if "_live" in self.rule:  # LAMB's own trust ratio of this step's update, every step
                    pn, un = theta[s].norm(), u.norm()
                    coef = (pn / un).clamp(minc, maxc) if pn > 0 and un > 0 else torch.tensor(1.0)
                if "trust" in self.rule:  # never a longer layer step than LAMB's own trust ratio gives
                    pn, un = theta[s].norm(), u.norm()
                    if pn > 0 and un > 0:
                        coef = torch.minimum(coef, (pn / un).clamp(minc, maxc))
                new[s] = theta[s] - lr * coef * u
        if self.first_update_ratio is None:
            dw = (new - theta * (1 - lr * wd)) if not self.lamb else (new - theta)
            self.first_update_ratio = float(dw.abs().max()) / lr
        return new


def adam_bound(betas, t: Optional[int]) -> float:
    """The largest |m^ / sqrt(v^)| Adam can produce for any gradient sequence (Cauchy-Schwarz):
    (1-b1)/sqrt(1-b2) / sqrt(1 - b1^2/b2), times sqrt(1-b2^t)/(1-b1^t) for the bias
    corrections at the freeze (t); b1^2 >= b2 has no bound (inf)."""
    b1, b2 = betas
    if b1 * b1 >= b2:
        return math.inf
    bound = (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))
    if t:
        bound *= math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    return bound


def factored(sq: Tensor, shapes) -> Tensor:
    """The rank-1 (rows x columns) fit of sq [n] per matrix of `shapes`, sq itself elsewhere."""
    out, at = torch.empty_like(sq), 0
    for shp in shapes:
        n = math.prod(shp)
        s = sq[at:at + n]
        if len(shp) >= 2 and shp[0] > 1 and n // shp[0] > 1:
            v = s.view(shp[0], -1)
            r, c = v.sum(1), v.sum(0)
            out[at:at + n] = (torch.outer(r, c) / r.sum().clamp(min=1e-30)).reshape(-1)
        else:
            out[at:at + n] = s
        at += n
    return out


def _block_rms(x: Tensor, block: Optional[int]) -> Tensor:
    n = x.numel()
    if block is None:
        return x.pow(2).mean().sqrt().expand(n)
    nb = (n + block - 1) // block
    xp = torch.nn.functional.pad(x, (0, nb * block - n))
    cnt = torch.nn.functional.pad(torch.ones(n), (0, nb * block - n)).view(nb, block).sum(1)
    r = (xp.view(nb, block).pow(2).sum(1) / cnt).sqrt()
    return r.repeat_interleave(block)[:n]


class SimSGD:
    """torch.optim.SGD(momentum=0.9, weight decay wd) on averaged gradients; with hook=True,
    averaged by the 1-bit error-feedback allreduce from step `start` on."""

    def __init__(self, flat: Flat, p: int, *, lr, hook: bool, rule="rms", start=None, block=2048, mu=0.9, wd=0.0):
        self.f, self.p, self.hook, self.start, self.mu, self.wd = flat, p, hook, start, mu, wd
        self.rule = rule
        scale = "meanabs" if rule.startswith("meanabs") else "rms"
        if "_b" in rule:
            block = int(rule.split("_b")[1].split("_")[0])
        self.comp = Compressor(flat.n, p, block, scale) if hook else None
        if self.comp is not None:
            self.comp.exact = exact_mask(flat, rule)
        # "norm": OneBitHookState(normalize="warmup"): compress g / w, decode x w, w = the RMS of
        # the averaged gradients of the full-precision start, floored at 0.1 x its RMS
        self.norm, self.sumsq, self.count, self.w = "norm" in rule, torch.zeros(flat.n), 0, None
        self.buf = None
        self.t = 0
        self.first_update_ratio = None
        # "fact": w re-estimated every step from a factored (row x column, Adafactor-like) EMA of
        # the ranks' mean squared local gradients; costs an fp32 allreduce of rows + columns
        self.fact = "fact" in rule
        self.fbeta = 0.99 if "fact99" in rule else 0.5 if "fact5" in rule else 0.9
        self.mom, self.mloc, self.mhat = "mom" in rule, None, None
        self.rows = self.cols = None
        self.shapes = [tuple(q.shape) for q in flat.params]

    def _factored(self, sq):
        """Update the row/column EMAs with sq [n] and return w [n] (floored, > 0)."""
        if self.rows is None:
            self.rows, self.cols = [None] * len(self.shapes), [None] * len(self.shapes)
        out = torch.empty_like(sq)
        b = self.fbeta
        for i, (shp, sl) in enumerate(zip(self.shapes, self.f.slices())):
            s = sq[sl]
            if len(shp) >= 2:
                s2 = s.view(shp[0], -1)
                r, c = s2.sum(1), s2.sum(0)
                self.rows[i] = r if self.rows[i] is None else b * self.rows[i] + (1 - b) * r
                self.cols[i] = c if self.cols[i] is None else b * self.cols[i] + (1 - b) * c
                v = torch.outer(self.rows[i], self.cols[i]) / self.rows[i].sum().clamp(min=1e-30)
                out[sl] = v.reshape(-1)
            else:
                self.rows[i] = s if self.rows[i] is None else b * self.rows[i] + (1 - b) * s
                out[sl] = self.rows[i]
        w = out.sqrt()
        fl = float("0" + self.rule.split("_f0")[1].split("_")[0]) if "_f0" in self.rule else 0.1
        w = torch.maximum(w, fl * w.square().mean().sqrt())
        return torch.where(w > 0, w, 1.0)

    def _rescale(self, w_old, w_new):
        """Error feedback kept in gradient units across a change of w."""
        c, n = self.comp, self.f.n
        r = w_old / w_new
        c.worker[:, :n] *= r
        c.server.view(-1)[:n] *= r

    def step(self, theta, grads, lr):
        self.t += 1
        if not (self.hook and self.t > self.start):
            g = grads.mean(0)
            if self.norm:
                self.sumsq += g * g
                self.count += 1
            if self.fact and "_cold" not in self.rule:  # warm the row/column EMAs
                self._factored(g * g if "_avgwarm" in self.rule else (grads * grads).mean(0))
        else:
            x = grads
            if self.mom:
                # compress each rank's local momentum; hand the optimizer the gradient that
                # makes its buffer equal the decoded momentum: g = m^_t - mu m^_{t-1}
                if self.mloc is None:
                    init = torch.zeros_like(self.buf) if "_zm" in self.rule else self.buf
                    self.mloc = init.expand(self.p, -1).clone()
                    self.mhat = init.clone()
                self.mloc = self.mu * self.mloc + grads
                x = self.mloc
            every = int(self.rule.split("_k")[1].split("_")[0]) if "_k" in self.rule else 1
            if self.fact and (self.w is None or (self.t - self.start) % every == 0):
                b0 = self.fbeta
                self.fbeta = b0 ** every
                w = self._factored((x * x).mean(0))
                self.fbeta = b0
                if self.w is not None and "norescale" not in self.rule:
                    self._rescale(self.w, w)
                self.w = w
            elif self.norm and self.w is None:
                rms = (self.sumsq / self.count).sqrt()
                w = torch.maximum(rms, 0.1 * rms.square().mean().sqrt())
                self.w = torch.where(w > 0, w, 1.0)
            d = self.comp(x / self.w) * self.w if self.w is not None else self.comp(x)
            if self.mom:
                g = d - self.mu * self.mhat
                self.mhat = d
            else:
                g = d
        if not torch.isfinite(g).all():
            raise FloatingPointError("non-finite gradient")
        if self.wd:
            g = g + self.wd * theta
        self.buf = g.clone() if self.buf is None else self.buf.mul_(self.mu).add_(g)
        return theta - lr * self.buf
