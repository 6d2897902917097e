"""PROTOTYPE ONLY (issue 16): the proposed ``max_update`` rule on the real optimizers, as
subclasses, so that the suite and tests/test_robustness.py can measure it on real gloo
ranks before it is integrated into lbcomm/optim. Delete this file once lbcomm.OneBitAdam
and lbcomm.OneBitLamb take ``max_update`` themselves.

Rule, compression stage only (t > freeze_step), per coordinate:

    u = clamp(m^ / (sqrt(v^) + eps), -U, U)         (then AdamW's update, or LAMB's u + wd p, c_frz f)

    max_update = a number U      (OneBitAdam default 1.0: |E g| <= sqrt(E g^2), the largest step
                                  a coordinate with stationary gradients gets from frozen-v Adam)
    max_update = "warmup"        (OneBitLamb default) U_p per tensor p, once at the freeze:
                                  U_p = max_i |m^_i / (sqrt(v^_i) + eps)| after the last warmup step
    max_update = "auto"          U = (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)), the largest
                                  |m^/sqrt(v^)| Adam can produce for any gradient sequence
                                  (7.27 at betas (0.9, 0.999)); measured worse, kept for the study
    max_update = None            the published algorithm
"""
from __future__ import annotations

import math
import os
from typing import Optional, Union

import torch

from lbcomm import OneBitAdam, OneBitLamb
from lbcomm.optim.lamb import _norms


_FUSED_SRC = r"""
#include <torch/extension.h>
// w <- w (1 - decay) - step clamp(m / d, -bound, bound): AdamW's compressed-stage update in one pass
void adamw_clamped_(torch::Tensor w, torch::Tensor m, torch::Tensor d, double decay, double step, double bound) {
  TORCH_CHECK(w.is_contiguous() && m.is_contiguous() && d.is_contiguous() && w.scalar_type() == torch::kFloat,
              "adamw_clamped_: contiguous float32 tensors expected");
  float* W = w.data_ptr<float>();
  const float* M = m.data_ptr<float>();
  const float* D = d.data_ptr<float>();
  const float k = 1.0f - (float)decay, s = (float)step, b = (float)bound;
  const int64_t n = w.numel();
  for (int64_t i = 0; i < n; ++i) {
    float u = M[i] / D[i];
    u = u > b ? b : (u < -b ? -b : u);
    W[i] = W[i] * k - s * u;
  }
}
"""
_fused = None


def fused():
    """PROTOTYPE: the one-pass update compiled on first use (what a csrc op would do)."""
    global _fused
    if _fused is None:
        from torch.utils.cpp_extension import load_inline
        _fused = load_inline("robust_fused", cpp_sources=_FUSED_SRC, functions=["adamw_clamped_"],
                             extra_cflags=["-O3"], verbose=False)
    return _fused


def adam_update_bound(betas) -> float:
    b1, b2 = betas
    if b1 * b1 >= b2:
        raise ValueError(f"max_update='auto' needs beta1**2 < beta2 (got betas {tuple(betas)}): Adam's update is "
                         "then unbounded; pass max_update as a number")
    return (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))


def _bound(group) -> Optional[float]:
    u = group.get("max_update")
    if u is None or u == "warmup":
        return None
    return adam_update_bound(group["betas"]) if u == "auto" else float(u)


def _warmup_bounds(opt, L) -> None:
    """max_update="warmup": U_p = max_i |m^_i / d_i| of tensor p after the last warmup step
    (its largest full-precision step then), once at the freeze; 0 if it never had a gradient."""
    m, bounds = opt._flat["exp_avg"], []
    for i, p in enumerate(L.params):
        group = opt.param_groups[L.group_of[i]]
        b1, b2 = group["betas"]
        t = float(opt._vectors["step"][i])
        if t == 0:
            bounds.append(0.0)
            continue
        bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if group.get("bias_correction", True) else (1.0, 1.0)
        d = opt._denominator(L.view(opt._flat["exp_avg_sq"], i), bc2, group["eps"], out=torch.empty(p.shape))
        bounds.append(float((L.view(m, i) / bc1 / d).abs().max()))
    opt._update_bounds = bounds


class RobustOneBitAdam(OneBitAdam):
    fused_update = os.environ.get("LBCOMM_ROBUST_FUSED", "1") == "1"

    def __init__(self, params, *args, max_update: Union[str, float, None] = 1.0, **kwargs):
        super().__init__(params, *args, **kwargs)
        for g in self.param_groups:
            g.setdefault("max_update", max_update)
        self.defaults["max_update"] = max_update

    def _on_freeze(self, L):
        super()._on_freeze(L)
        _warmup_bounds(self, L)

    def _adam_update(self, L, seg, frozen=False):
        group = self.param_groups[seg.group]
        bound = _bound(group)
        if frozen and group.get("max_update") == "warmup":  # one bound per tensor: a run of one
            for i in seg.idx:
                one = type(seg)(seg.group, i, L.offsets[i], L.offsets[i] + L.numels[i], seg.step, seg.vstep)
                self._adam_update_bounded(L, one, self._update_bounds[i])
            return
        if not frozen or bound is None:
            return super()._adam_update(L, seg, frozen)
        self._adam_update_bounded(L, seg, bound)

    def _adam_update_bounded(self, L, seg, bound):
        group = self.param_groups[seg.group]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        bc1, bc2 = self._bias_corrections(group, seg)
        d = self._frozen_denominator(L, seg, bc2, eps)
        m = self._flat["exp_avg"]
        if self.fused_update:  # one pass: w (1 - lr wd) - lr/bc1 clamp(m / d, +-bound bc1)
            for i in seg.idx:
                o = L.offsets[i] - seg.lo
                d_i = d[o:o + L.numels[i]]
                self._apply(L.params[i], lambda w, i=i, d_i=d_i: fused().adamw_clamped_(
                    w, L.view(m, i), d_i.view(w.shape), lr * wd, lr / bc1, bound * bc1))
            return
        u = torch.div(m[seg.lo:seg.hi], d, out=self._grad_buf[seg.lo:seg.hi])
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
    def __init__(self, params, *args, max_update: Union[str, float, None] = "warmup", **kwargs):
        super().__init__(params, *args, **kwargs)
        for g in self.param_groups:
            g.setdefault("max_update", max_update)
        self.defaults["max_update"] = max_update

    def _on_freeze(self, L):
        super()._on_freeze(L)
        _warmup_bounds(self, L)

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
            elif group.get("max_update") == "warmup":  # per tensor: its largest warmup step at the freeze
                for i in seg.idx:
                    L.view(buf, i).clamp_(-self._update_bounds[i], self._update_bounds[i])
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
