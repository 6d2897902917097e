"""ZeroOneAdam's local-step stage (after var_freeze_step): local steps without communication
between synchronizations, and the synchronization that rebuilds every rank's parameters
from the anchor with one compressed allreduce (see `ZeroOneAdam`'s docs for the equations).
Functions of a ZeroOneAdam's flat state `fs` (a `FlatState`) and its `OneBitStage`."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from . import functional as F
from . import kernels
from .flat import FlatLayout

__all__ = ["local_step_", "sync_step_", "start_", "initial_schedule", "interval"]

# rescale_variance's factors (`VarianceRescale.factors_of`): called with the participating
# parameters once their step counts have advanced; per parameter a factor of v^, or None
FactorsOf = Optional[Callable[[List[bool]], Optional[Sequence[Optional[float]]]]]


def initial_schedule() -> Dict[str, Any]:
    """ZeroOneAdam's schedule (checkpointed): var_updates, the variance updates so far;
    next_var, the step of the next one (0: none left); local, the local-step stage has
    begun; syncs, synchronizations in it so far; next_sync, the step of the next one."""
    return {"var_updates": 0, "next_var": 1, "local": False, "syncs": 0, "next_sync": 0}


def interval(syncs: int, scaler: int, clipper: int) -> int:
    """The steps between two synchronizations after `syncs` of them: min(2^(syncs // scaler), clipper)."""
    return min(2 ** (syncs // scaler), clipper)


def start_(fs, L: FlatLayout) -> None:
    """The local-step stage begins: its buffers (``local_update``, the accumulation, and
    ``anchor``, the parameters now) and the interval's vectors; no gradient buffer."""
    fs.grad_buf = None
    fs.buffers["local_update"] = torch.zeros_like(fs.buffers["exp_avg"])
    anchor = fs.buffers["anchor"] = torch.empty_like(fs.buffers["exp_avg"])
    for i, p in enumerate(L.params):
        L.view(anchor, i).copy_(p.detach())
    fs.vectors["interval_lr"].zero_()
    fs.vectors["interval_keep"].fill_(1.0)


def _bc1(group: Dict[str, Any], step: float) -> float:
    return 1 - group["betas"][0] ** step if group["bias_correction"] else 1.0


def _local_momentum(m_i: Tensor, g: Optional[Tensor], weight: float, out: Tensor) -> None:
    """out = b1 m + (1-b1) g (torch.lerp), g None counting as zeros."""
    if g is None:
        g = torch.zeros_like(m_i)
    elif g.dtype != torch.float32:
        g = g.float()
    torch.lerp(m_i, g.reshape(-1), weight, out=out)


def _interval_vectors(fs, idx_by_group: Dict[int, List[int]], out_lr: Tensor, out_keep: Tensor) -> None:
    """Add this step's lr to interval_lr and its decay factor to interval_keep (fp32)."""
    for gi, idx in idx_by_group.items():
        group = fs.param_groups[gi]
        out_lr[idx] += group["lr"]
        out_keep[idx] *= 1 - group["lr"] * group["weight_decay"]


def _by_group(L: FlatLayout, include: List[bool]) -> Dict[int, List[int]]:
    out: Dict[int, List[int]] = {}
    for i, on in enumerate(include):
        if on:
            out.setdefault(L.group_of[i], []).append(i)
    return out


def local_step_(fs, stage, L: FlatLayout, factors_of: FactorsOf = None) -> None:
    """No communication: the local momentum and an AdamW step with the frozen variance
    (rescaled by `factors_of`'s factors), accumulated into local_update."""
    m, v, acc = fs.buffers["exp_avg"], fs.buffers["exp_avg_sq"], fs.buffers["local_update"]
    part = stage.participating(L)
    for i, on in enumerate(part):
        if on:
            m_i = L.view(m, i).view(-1)
            _local_momentum(m_i, L.params[i].grad, 1 - fs.param_groups[L.group_of[i]]["betas"][0], m_i)
    stage.mask_range(m, 0, L.total)
    scratch, bounds = stage.stage_buffer(L), stage.update_bounds(L)
    segs = fs.segments(L, part, vstep="variance_step")
    factors = None if factors_of is None else factors_of(part)
    for seg in segs:
        group = fs.param_groups[seg.group]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        bc1, bc2 = fs.bias_corrections(group, seg)
        for i in seg.idx:
            b = None if bounds[i] is None else lr * bounds[i]
            F.apply_fp32(L.params[i], lambda w, i=i, b=b, c=F.rescaled_bc2(bc2, factors, i): kernels.frozen_adamw_(
                w, L.view(m, i), L.view(v, i), c, eps, lr * wd, lr / bc1, scratch, b))
            L.view(acc, i).add_(L.view(m, i), alpha=lr / bc1)
    _interval_vectors(fs, _by_group(L, part), fs.vectors["interval_lr"], fs.vectors["interval_keep"])


def sync_step_(fs, stage, L: FlatLayout, factors_of: FactorsOf = None) -> bool:
    """The local step's momentum, then one compressed allreduce of the interval's mean
    bias-corrected momentum (times bc1) into m, and every rank's parameters rebuilt from
    the anchor with the variance as rescaled at this step (`factors_of`); False (nothing
    changed) when the result is non-finite."""
    m, v = fs.buffers["exp_avg"], fs.buffers["exp_avg_sq"]
    acc, anchor = fs.buffers["local_update"], fs.buffers["anchor"]
    part = stage.participating(L)
    steps = fs.vectors["step"].tolist()
    lr_sum, keep = fs.vectors["interval_lr"].clone(), fs.vectors["interval_keep"].clone()
    _interval_vectors(fs, _by_group(L, part), lr_sum, keep)
    sums = lr_sum.tolist()
    weights, alphas, scales = [], [], []
    for i, gi in enumerate(L.group_of):
        group = fs.param_groups[gi]
        weights.append(1 - group["betas"][0])
        if part[i]:
            bc1 = _bc1(group, steps[i] + 1)
            alphas.append(group["lr"] / bc1)
            scales.append(bc1 / sums[i] if sums[i] > 0 else 0.0)
        else:  # not trained: its momentum is reduced as OneBitAdam's, it does not move
            alphas.append(None)
            scales.append(None)

    def source(lo: int, hi: int, buf: Tensor) -> None:
        for i, a, b in L.overlapping(lo, hi):
            o = L.offsets[i]
            out, g = buf[o + a - lo:o + b - lo], L.params[i].grad
            _local_momentum(m[o + a:o + b], None if g is None else g.reshape(-1)[a:b], weights[i], out)
            if alphas[i] is not None:
                torch.add(acc[o + a:o + b], out, alpha=alphas[i], out=out)
                out.mul_(scales[i])

    # the interval's momentum is in m's units: the rebuild's bound total U is m's cap too
    applied, bounds, segs, factors, _ = stage.step_and_reduce(L, part, source, m, factors_of)
    if not applied:
        return False
    scratch = stage.stage_buffer(L)
    keeps = keep.tolist()
    for seg in segs:
        group = fs.param_groups[seg.group]
        eps = group["eps"]
        bc1, bc2 = fs.bias_corrections(group, seg)
        for i in seg.idx:
            total = sums[i]
            b = None if bounds[i] is None else total * bounds[i]
            a_i = L.view(anchor, i)

            def rebuild(w, i=i, b=b, total=total, a_i=a_i, c=F.rescaled_bc2(bc2, factors, i)):
                w.copy_(a_i)
                kernels.frozen_adamw_(w, L.view(m, i), L.view(v, i), c, eps, 1 - keeps[i], total / bc1,
                                      scratch, b)
                a_i.copy_(w)

            F.apply_fp32(L.params[i], rebuild)
    acc.zero_()
    fs.vectors["interval_lr"].zero_()
    fs.vectors["interval_keep"].fill_(1.0)
    return True
