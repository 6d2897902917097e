"""Single-process simulation of p ranks for the robustness study of the compression stage.

A study tool, not a maintained benchmark (its conclusions: bench/studies.md; the shipped
rules are measured with `python -m bench.suite`): candidate rules that make the compression stage of the 1-bit optimizers
and of the 1-bit gradient hook safe, measured on every task of bench/tasks.py over the lr
grid. One model, p data shards: each step computes every rank's local gradient on its
quarter of the global batch, then runs the optimizer math below on flat fp32 vectors with
a vectorized compressed allreduce (the algorithm of lbcomm/compressed.py; checked against
lbcomm.testing.kernels by ``--check``, as tests/test_robustness.py does). Deterministic, no processes, cheap.

Rules (``rule=``) of OneBitAdam / OneBitLamb in the compression stage, with
m the decoded momentum, d = sqrt(v^) + eps the frozen denominator, b1c = 1 - b1^t:

    published   the paper (mask: v <= 1e-10 mean(v))
    mask1e-3    the published rule with mask_threshold 1e-3 (the published algorithm's tunable threshold)
    clip        u = clamp(m / (b1c d), -1, 1): no coordinate moves faster than lr per step
                (|E g| <= sqrt(E g^2): the largest stationary Adam step)
    clipmax     u = clamp(m / (b1c d), -U, U), U = (1-b1) / sqrt((1-b2)(1-b1^2/b2)): the
                largest |m^/sqrt(v^)| Adam can produce for any gradient sequence (7.27 at
                betas (0.9, 0.999), 2.35 at (0.9, 0.99))
    floor       d <- max(d, 0.1 rms_block(d)): denominator floored relative to its block
    precond     compress m / d instead of m, decode, multiply by d: every block then holds
                update-sized numbers, so the compression noise of a coordinate is the
                block's update RMS, never lr scale / sqrt(v)
    precond_clip  both
    clipwarm    u = clamp(m^ / d, -U_p, U_p), U_p = max_i |m^_i / d_i| of tensor p at the freeze
                (the largest full-precision step of that tensor in the last warmup step)
    clipallK    U_p = K x the largest |m^ / d| of tensor p over the whole warmup (running max)
    clipcoordK  per coordinate: K x its own largest |m^ / d| over the warmup
    uclip       compress clamp(m_local / d, -1, 1) (masked coordinates 0), clamp the decoded
                direction to +-1, m = d x decoded: a coordinate's compressed update is
                at most its block's RMS update (and at most lr); no k_p scaling for LAMB
    meanabs     block scale mean|y| instead of rms(y) (L2-optimal scale for signs)

    _vsl        the frozen denominator rescaled per tensor: v^ x q^_t / q^_freeze, q^ the
                bias-corrected EMA (beta2) of the ranks' mean squared local gradient of the tensor
                from step 1 (OneBitAdam(rescale_variance=True)); _vslc: the factor at most 1;
                _vso: q from the averaged gradient (an oracle: not available after the freeze);
                _vsm: q from the decoded momentum; _vsf / _vsfc: q from the freeze on, relative
                to its first compressed step

OneBitLamb's layer coefficient (suffixes of a LAMB rule; default c_frz x f, the paper's):
    _live       LAMB's own trust ratio clamp(||w|| / ||u||) of every compressed step
    _wn         c_frz x f x ||w|| / ||w at the freeze|| (LAMB's c grows with ||w||)
    _nof        no variance factor f (c_frz alone)

The hook (SGD momentum on compressed gradients): scale rule, block size, start fraction, and
``norm``: per-coordinate normalization by the full-precision start's gradient RMS
(OneBitHookState(normalize="warmup"), the default). Parts of a hook rule name:

    mom         compress each rank's momentum (mu 0.9, started from the start's momentum)
                and hand SGD m^_t - mu m^_{t-1} (OneBitHookState(momentum=0.9))
    fact        weights re-estimated every step from an EMA (beta 0.9; fact99: 0.99, fact5:
                0.5) of the ranks' mean squares of what is compressed, factored per matrix
                into rows x columns; error feedback rescaled by w_old / w_new
                (OneBitHookState(normalize="adaptive"))
    _avgwarm    the EMA started from the averaged gradients of the start (else the ranks'
                mean squares); _cold: not started, first value at the first compressed step
    _zm         momentum started from zero instead of the start's momentum
    _kN         weights re-estimated every N steps only; _norescale: errors not rescaled
    _fX         floor X x the unit's RMS of the weights (default 0.1); _bN: block size N
                (also for the optimizers' rules)
    _exN        the parameters of at most N elements averaged exactly, their errors kept at
                zero (CommConfig(exact_numel=N)); also for the optimizers' rules
                (clipwarm_ex4096); _exlayerK: only parameter K of the flat order; _exvec: the
                vectors only

    python -m bench.robust_sim --check                 # the simulated allreduce vs lbcomm.testing.kernels
    python -m bench.robust_sim --tasks all --json out   # the whole study (minutes)
"""
from __future__ import annotations

import argparse
import json
import math
import re
import time
from typing import Dict, List, Optional

import torch
from torch import Tensor

from . import tasks as T

from lbcomm.reference import chunk_size

ADAM_RULES = ["published", "mask1e-3", "clip", "clipmax", "floor", "precond", "precond_clip", "meanabs"]
LAMB_RULES = ["published", "mask1e-3", "clip", "clipmax", "precond", "precond_clip", "precond_clipmax"]
HOOK_RULES = ["rms", "meanabs", "rms_b256", "rms_start50", "meanabs_start50", "norm", "norm_b256", "norm_start50",
              "mom", "mom_norm", "fact99", "mom_fact99", "mom_fact", "mom_fact5", "mom_fact99_avgwarm"]


# ---------------------------------------------------------------------- compressed allreduce
def _scales(y: Tensor, real: Tensor, block: Optional[int], rule: str) -> Tensor:
    """Per-element scale of y [rows, m] (real: bool mask of real elements), per block or whole row."""
    rows, m = y.shape
    mag = y * y if rule == "rms" else y.abs()
    mag = torch.where(real, mag, 0.0).double()
    cnt = real.double()
    if block is None:
        s, c = mag.sum(1, keepdim=True), cnt.sum(1, keepdim=True)
        val = s / c.clamp(min=1)
        val = (val.sqrt() if rule == "rms" else val).float()
        return val.expand(rows, m).contiguous()
    nb = (m + block - 1) // block
    pad = nb * block - m
    s = torch.nn.functional.pad(mag, (0, pad)).view(rows, nb, block).sum(-1)
    c = torch.nn.functional.pad(cnt, (0, pad)).view(rows, nb, block).sum(-1)
    val = s / c.clamp(min=1)
    val = (val.sqrt() if rule == "rms" else val).float()
    return val.repeat_interleave(block, dim=1)[:, :m]


def _code(y: Tensor, scale: Tensor) -> Tensor:
    return torch.where(torch.signbit(y), -scale, scale)


class Compressor:
    """Error-feedback state of p simulated ranks for one flat tensor of n elements."""

    def __init__(self, n: int, p: int, block: Optional[int], scale_rule: str = "rms"):
        self.n, self.p, self.block, self.rule = n, p, block, scale_rule
        self.m = chunk_size(n, p)
        self.worker = torch.zeros(p, p * self.m)
        self.server = torch.zeros(p, self.m)
        self.real = (torch.arange(p * self.m) < n)
        self.exact: Optional[Tensor] = None  # bool [n]: averaged exactly, zero error (CommConfig.exact_numel)

    def __call__(self, xs: Tensor) -> Tensor:
        """xs [p, n] -> approximate mean [n]."""
        p, m, n = self.p, self.m, self.n
        y = torch.zeros(p, p * m)
        y[:, :n] = xs
        y = torch.where(self.real, y + self.worker, 0.0)
        # worker: one scale set per (rank, chunk); block None: one scale per rank over all chunks
        if self.block is None:
            sc = _scales(y, self.real.expand(p, -1), None, self.rule)
        else:
            sc = _scales(y.view(p * p, m), self.real.view(p, m).repeat(p, 1), self.block, self.rule).reshape(p, p * m)
        dec = torch.where(self.real, _code(y, sc), 0.0)
        self.worker = y - dec
        real_k = self.real.view(p, m)
        z = dec.view(p, p, m).sum(0) * (1.0 / p)  # [chunk, m]
        z = torch.where(real_k, z + self.server, 0.0)
        sc2 = _scales(z, real_k, self.block, self.rule)
        out = torch.where(real_k, _code(z, sc2), 0.0)
        self.server = z - out
        res = out.reshape(-1)[:n].clone()
        if self.exact is not None:
            res = torch.where(self.exact, xs.mean(0), res)
            keep = torch.nn.functional.pad(~self.exact, (0, p * m - n))
            self.worker = self.worker * keep
            self.server = self.server * keep.view(p, m)
        return res


def exact_mask(flat: "Flat", rule: str) -> Optional[Tensor]:
    """Rule parts ``_exN``: the parameters of at most N elements averaged exactly;
    ``_exlayerK``: parameter K of the flat order (the hook's: reversed) only; ``_exvec``:
    the 1-D parameters."""
    if "_exvec" in rule:  # the vectors (biases, norm weights) only
        return torch.cat([torch.full((k,), len(q.shape) < 2) for k, q in zip(flat.numels, flat.params)])
    if "_exlayer" in rule:
        k = int(rule.split("_exlayer")[1].split("_")[0])
        sl = flat.slices()[k]
        return (torch.arange(flat.n) >= sl.start) & (torch.arange(flat.n) < sl.stop)
    if "_ex" in rule:
        limit = int(rule.split("_ex")[1].split("_")[0])
        return torch.cat([torch.full((k,), k <= limit) for k in flat.numels])
    return None


def check_against_reference(n=5000, p=4, block=256, steps=3) -> float:
    """Largest difference of the simulated allreduce (rms) from lbcomm.testing.kernels."""
    from lbcomm.testing import kernels as R
    torch.manual_seed(0)
    m = chunk_size(n, p)
    we, se = [torch.zeros(p, m) for _ in range(p)], [torch.zeros(m) for _ in range(p)]
    worst = 0.0
    for blk in (block, None):
        c = Compressor(n, p, blk)
        we, se = [torch.zeros(p, m) for _ in range(p)], [torch.zeros(m) for _ in range(p)]
        for _ in range(steps):
            xs = torch.randn(p, n) * torch.rand(n) * 3
            ref, we, se = R.compressed_allreduce(list(xs), we, se, blk)
            worst = max(worst, float((c(xs) - ref).abs().max()))
    return worst


# ---------------------------------------------------------------------- the model as flat vectors
class Flat:
    def __init__(self, model, reverse: bool = False):
        self.params = [p for p in model.parameters()]
        if reverse:  # DDP buckets hold the parameters in reverse order
            self.params = self.params[::-1]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.n = sum(self.numels)

    def get(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def set(self, flat: Tensor) -> None:
        with torch.no_grad():
            for p, o, k in zip(self.params, self.offsets, self.numels):
                p.copy_(flat[o:o + k].view_as(p))

    def slices(self):
        return [slice(o, o + k) for o, k in zip(self.offsets, self.numels)]


def rank_grads(task, model, flat: Flat, step: int, p: int) -> Tensor:
    """[p, n]: every rank's gradient on its share of the global batch of this step."""
    batch = task.batch(step)
    per = batch[0].shape[0] // p
    out = torch.empty(p, flat.n)
    losses = []
    for r in range(p):
        part = tuple(t[r * per:(r + 1) * per] for t in batch)
        model.zero_grad(set_to_none=False)
        loss = task.loss(model, part)
        loss.backward()
        losses.append(float(loss))
        out[r] = torch.cat([q.grad.reshape(-1) if q.grad is not None else torch.zeros(q.numel())
                            for q in flat.params])
    return out, sum(losses) / p


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


# ---------------------------------------------------------------------- one run
FAMILY = {"adamw": "adam", "onebit_adam": "adam", "lamb": "lamb", "onebit_lamb": "lamb", "sgd": "sgd",
          "sgd_hook": "sgd"}
TWIN = {"onebit_adam": "adamw", "onebit_lamb": "lamb", "sgd_hook": "sgd"}


def run(task, method: str, lr: float, rule: str = "published", p: int = 4, freeze_frac: float = 0.25,
        eval_every: int = 0) -> Dict:
    model = task.make_model()
    flat = Flat(model, reverse=method.startswith("sgd"))
    steps = task.steps
    freeze = max(2, round(freeze_frac * steps))
    kw = dict(betas=(0.9, task.beta2), wd=task.weight_decay)
    if method in ("adamw", "onebit_adam", "lamb", "onebit_lamb"):
        opt = SimOneBit(flat, p, lr=lr, lamb="lamb" in method, freeze=freeze if "onebit" in method else None,
                        rule=rule, **kw)
    else:
        start = freeze
        if "start50" in rule:
            start = round(0.5 * steps)
        opt = SimSGD(flat, p, lr=lr, hook=method == "sgd_hook", rule=rule, start=start)
    theta = flat.get()
    init = T.evaluate(task, model)
    curve, diverged = [(0, init)], None
    warm = max(1, steps // 10)
    for step in range(steps):
        grads, _ = rank_grads(task, model, flat, step, p)
        try:
            theta = opt.step(theta, grads, lr * T.lr_factor(step, steps, warm))
        except FloatingPointError:
            diverged = step + 1
            break
        if not torch.isfinite(theta).all():
            diverged = step + 1
            break
        flat.set(theta)
        if eval_every and (step + 1) % eval_every == 0:
            curve.append((step + 1, T.evaluate(task, model)))
    final = float("nan") if diverged else T.evaluate(task, model)
    if not math.isfinite(final):
        diverged = diverged or steps
    return {"task": task.name, "method": method, "lr": lr, "rule": rule, "final": final, "init": init,
            "diverged": diverged, "curve": curve, "max_param": float(theta.abs().max()) if not diverged else None,
            "first_update_ratio": getattr(opt, "first_update_ratio", None)}


def study(task_names: List[str], quick: bool, rules: Dict[str, List[str]], out: Optional[str],
          seed: int = 0, grid: str = "coarse") -> List[Dict]:
    results = []
    for name in task_names:
        task = T.make_task(name, quick=quick, seed=seed, grid=grid)
        for method in ("adamw", "onebit_adam", "lamb", "onebit_lamb", "sgd", "sgd_hook"):
            for rule in rules.get(method, []):
                for lr in task.grids[FAMILY[method]]:
                    t0 = time.perf_counter()
                    r = run(task, method, lr, rule)
                    r["seconds"] = time.perf_counter() - t0
                    results.append(r)
                    print(f"{name:<14}{method:<12}{rule:<16}lr {lr:<7g} final {r['final']:.4f}"
                          f"{'  DIVERGED@' + str(r['diverged']) if r['diverged'] else ''}"
                          f"  first-upd/lr {r['first_update_ratio'] if r['first_update_ratio'] is not None else '-'}"
                          f"  ({r['seconds']:.1f}s)", flush=True)
                    if out:
                        with open(out, "w") as f:
                            json.dump(results, f)
    return results


def diverged(r) -> bool:
    """Diverged: non-finite, or ended worse than the initial model."""
    return bool(r["diverged"]) or not math.isfinite(r["final"]) or r["final"] > r["init"]


def table(results: List[Dict]) -> str:
    """Best-of-grid ratio of each 1-bit method and rule to its full-precision twin, and the
    lrs at which the 1-bit method diverged while the twin did not."""
    lines = []
    tasks_ = sorted({r["task"] for r in results}, key=list(T.TASKS).index)
    combos = []
    for r in results:
        if r["method"] in TWIN and (r["method"], r["rule"]) not in combos:
            combos.append((r["method"], r["rule"]))
    lines.append(f"{'method':<12}{'rule':<17}" + "".join(f"{t:>15}" for t in tasks_))
    for method, rule in combos:
        cells = []
        for t in tasks_:
            mine = [r for r in results if r["task"] == t and r["method"] == method and r["rule"] == rule]
            twin = [r for r in results if r["task"] == t and r["method"] == TWIN[method]]
            if not mine or not twin:
                cells.append("-")
                continue
            best = min((r["final"] for r in mine if not diverged(r)), default=float("inf"))
            best0 = min((r["final"] for r in twin if not diverged(r)), default=float("inf"))
            tw = {r["lr"]: diverged(r) for r in twin}
            bad = sum(1 for r in mine if diverged(r) and not tw.get(r["lr"], True))
            cells.append(f"{best / best0:.4f}" + (f" d{bad}" if bad else "") if math.isfinite(best) else "all-div")
        lines.append(f"{method:<12}{rule:<17}" + "".join(f"{c:>15}" for c in cells))
    lines.append("(ratio: best-of-grid final val loss / twin's; dN: N lrs diverged where the twin did not)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.robust_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--tasks", default="all")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--adam-rules", default=",".join(ADAM_RULES))
    ap.add_argument("--lamb-rules", default=",".join(LAMB_RULES))
    ap.add_argument("--hook-rules", default=",".join(HOOK_RULES))
    ap.add_argument("--seed", type=int, default=0, help="the tasks' seed (data, initial weights)")
    ap.add_argument("--grid", choices=("coarse", "fine"), default="coarse")
    ap.add_argument("--json", default="")
    ap.add_argument("--table-only", default="", help="print the table of a saved --json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.check:
        print(f"simulated allreduce vs lbcomm.testing.kernels: max abs difference {check_against_reference():.3g}")
        return
    if a.table_only:
        with open(a.table_only) as f:
            print(table(json.load(f)))
        return
    names = list(T.TASKS) if a.tasks == "all" else a.tasks.split(",")
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    rules = {"adamw": ["-"], "lamb": ["-"], "sgd": ["-"], "onebit_adam": split(a.adam_rules),
             "onebit_lamb": split(a.lamb_rules), "sgd_hook": split(a.hook_rules)}
    rules = {k: v for k, v in rules.items() if v}
    results = study(names, a.quick, rules, a.json, a.seed, a.grid)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
