"""PROTOTYPE ONLY (issue 16): the proposed ``max_update`` rule on the real optimizers, as
subclasses, so that the suite and tests/test_robustness.py can measure it on real gloo
ranks before it is integrated into lbcomm/optim. Delete this file once lbcomm.OneBitAdam
and lbcomm.OneBitLamb take ``max_update`` themselves.

Rule, compression stage only (t > freeze_step), per coordinate:

    u = clamp(m^ / (sqrt(v^) + eps), -U, U)         (then AdamW's update, or LAMB's u + wd p, c_frz f)
    U = max_update, or for max_update="auto":
        U = (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))

"auto" is the largest |m^ / sqrt(v^)| Adam can produce for ANY gradient sequence
(Cauchy-Schwarz on the two running averages, t -> inf): 7.27 at betas (0.9, 0.999), 2.35
at (0.9, 0.99). So no coordinate moves further in one compressed step than full-precision
Adam could ever move it; max_update=None is the published algorithm.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from lbcomm import OneBitAdam, OneBitLamb
from lbcomm.optim.lamb import _norms


def adam_update_bound(betas) -> float:
    b1, b2 = betas
    if b1 * b1 >= b2:
        raise ValueError(f"max_update='auto' needs beta1**2 < beta2 (got betas {tuple(betas)}): Adam's update is "
                         "then unbounded; pass max_update as a number")
    return (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))


def _bound(group) -> Optional[float]:
    u = group.get("max_update", "auto")
    if u is None:
        return None
    return adam_update_bound(group["betas"]) if u == "auto" else float(u)


class RobustOneBitAdam(OneBitAdam):
    def __init__(self, params, *args, max_update: Union[str, float, None] = "auto", **kwargs):
        super().__init__(params, *args, **kwargs)
        for g in self.param_groups:
            g.setdefault("max_update", max_update)
        self.defaults["max_update"] = max_update

    def _adam_update(self, L, seg, frozen=False):
        group = self.param_groups[seg.group]
        bound = _bound(group)
        if not frozen or bound is None:
            return super()._adam_update(L, seg, frozen)
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        bc1, bc2 = self._bias_corrections(group, seg)
        d = self._frozen_denominator(L, seg, bc2, eps)
        u = torch.div(self._flat["exp_avg"][seg.lo:seg.hi], d, out=self._grad_buf[seg.lo:seg.hi])
        u.clamp_(-bound * bc1, bound * bc1)  # |m^ / d| <= bound
        for i in seg.idx:
            o = L.offsets[i] - seg.lo
            u_i = u[o:o + L.numels[i]].view(L.params[i].shape)

            def fn(w, u_i=u_i):
                if wd != 0:
                    w.mul_(1 - lr * wd)
                w.add_(u_i, alpha=-lr / bc1)
            self._apply(L.params[i], fn)


class RobustOneBitLamb(OneBitLamb):
    def __init__(self, params, *args, max_update: Union[str, float, None] = "auto", **kwargs):
        super().__init__(params, *args, **kwargs)
        for g in self.param_groups:
            g.setdefault("max_update", max_update)
        self.defaults["max_update"] = max_update

    def _compressed_update(self, L) -> bool:  # OneBitLamb's, with the one clamp marked below
        new_m = self._compress_momentum(L, scale=self._vectors["momentum_scale"])
        if new_m is None:
            return False
        m, vf = self._flat["exp_avg"], self._flat["exp_avg_sq_fresh"]
        gt = torch.empty_like(m)
        for gi, _, _, lo, hi in L.group_ranges:
            b1 = self.param_groups[gi]["betas"][0]
            torch.sub(new_m[lo:hi], m[lo:hi] * b1, out=gt[lo:hi]).div_(1 - b1)
        m.copy_(new_m)
        for gi, _, _, lo, hi in L.group_ranges:
            b2 = self.param_groups[gi]["betas"][1]
            vf[lo:hi].mul_(b2).addcmul_(gt[lo:hi], gt[lo:hi], value=1 - b2)
        buf, vecs = self._grad_buf, self._vectors
        for seg in self._segments(L, self._participating(L), frozen=True):
            group = self.param_groups[seg.group]
            bc1, bc2 = self._bias_corrections(group, seg)
            d = self._frozen_denominator(L, seg, bc2, group["eps"])
            ratio = self._denominator(vf[seg.lo:seg.hi], bc2, group["eps"], out=gt[seg.lo:seg.hi])
            torch.div(d, ratio, out=ratio)
            f = torch.stack([torch.amax(L.view(gt, i)) for i in seg.idx])
            torch.div(m[seg.lo:seg.hi] / bc1, d, out=buf[seg.lo:seg.hi])  # u0
            bound = _bound(group)
            if bound is not None:  # THE RULE: |u0| <= bound per coordinate
                buf[seg.lo:seg.hi].clamp_(-bound, bound)
            if group["weight_decay"] != 0:
                u0n = _norms([L.view(buf, i) for i in seg.idx])
                self._add_weight_decay(L, seg)
                un = _norms([L.view(buf, i) for i in seg.idx])
                r = torch.where(un > 0, (u0n / un).clamp(max=1.0), torch.ones_like(un))
                f = f * r + (1 - r)
            f = f.clamp(group["factor_min"], group["factor_max"])
            idx = torch.tensor(seg.idx, device=f.device)
            last = vecs["last_factor"][idx]
            thr = group["factor_threshold"]
            f = torch.clamp(f, min=last * (1 - thr), max=last * (1 + thr))
            vecs["last_factor"][idx] = f
            self._scaled_update(L, seg, vecs["lamb_coeff_freeze"][idx] * f)
        return True
