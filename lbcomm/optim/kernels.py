"""Typed wrappers of the optimizers' fused ops, torch.ops.lbcomm.frozen_adamw_ (csrc/optim.cpp)
and lamb_clean_pass_ (csrc/lamb.cpp), with the pure-torch sequences they replace as the
fallback (`functional.frozen_adamw_`, `clean_pass_torch`).

OneBitAdam keeps no denominator after the freeze: every step computes
sqrt(v) / sqrt(1 - b2^T) + eps again. torch.sqrt runs on a cache-sized stage (torch's
vectorized sqrt is not correctly rounded on every ISA, so it stays torch's), and the op
does the rest in one pass that reads p, m and the staged sqrt and writes p, bitwise equal
to the torch ops; with a bound (max_update) each coordinate's step is clamped in the same
pass. CPU tensors use the op; CUDA tensors use the torch sequence until the
CUDA body (csrc/cuda/optim.cu) has been checked bitwise on a GPU (tests/test_optim_kernels.py).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

from .. import ops
from . import functional as F

__all__ = ["frozen_adamw_", "has_fused_kernel", "lamb_clean_pass_", "clean_pass_torch", "clean_denominator"]

_log = logging.getLogger(__name__)


def _op_is_current() -> bool:
    """The compiled op takes the bound (an extension built before max_update does not)."""
    if not (ops.HAS_EXTENSION and hasattr(torch.ops.lbcomm, "frozen_adamw_")):
        return False
    if any(a.name == "bound" for a in torch.ops.lbcomm.frozen_adamw_.default._schema.arguments):
        return True
    _log.warning("lbcomm._C is older than lbcomm/optim (its frozen_adamw_ has no bound argument); OneBitAdam uses "
                 "the slower torch sequence. Rebuild: pip install --no-build-isolation -e . (or python setup.py "
                 "build_ext --inplace)")
    return False


_OP = _op_is_current()
_CLEAN_OP = ops.HAS_EXTENSION and hasattr(torch.ops.lbcomm, "lamb_clean_pass_")


def has_fused_kernel(device: torch.device) -> bool:
    """Whether `frozen_adamw_` runs the fused op for tensors on `device`."""
    return _OP and torch.device(device).type == "cpu"


def frozen_adamw_(w: Tensor, m: Tensor, v: Tensor, bc2: float, eps: float, decay: float, step_size: float,
                  scratch: Tensor, bound: Optional[float] = None) -> None:
    """w <- w (1 - decay) - step_size m / (sqrt(v) / sqrt(bc2) + eps), in place, each
    coordinate's step clamped to [-bound, bound] if bound is given, bitwise as
    `lbcomm.optim.functional.frozen_adamw_` (which runs where the op cannot). `scratch`:
    at least min(STAGE, numel) fp32 elements."""
    if w.dtype == torch.float32 and w.is_contiguous() and has_fused_kernel(w.device):
        w, m, v = w.view(-1), m.view(-1), v.view(-1)
        n = w.numel()
        for lo in range(0, n, F.STAGE):
            hi = min(n, lo + F.STAGE)
            r = torch.sqrt(v[lo:hi], out=scratch[:hi - lo])
            torch.ops.lbcomm.frozen_adamw_(w[lo:hi], m[lo:hi], r, bc2 ** 0.5, eps, 1 - decay if decay != 0 else 1.0,
                                           -step_size, bound)
    else:
        F.frozen_adamw_(w, m, v, bc2, eps, decay, step_size, scratch, bound)


def clean_denominator(v: Tensor, denom_scale: float, eps: float) -> Tensor:
    """d = sqrt(v) / denom_scale + eps, the root taken in fp64 and rounded to fp32: the value
    the fused op computes, whatever the vector instructions of either side."""
    return torch.sqrt(v.double()).float().div_(denom_scale).add_(eps)


def clean_pass_torch(acc: Tensor, positions: Tensor, m: Tensor, v: Tensor, ml: Tensor, theta: Optional[Tensor],
                     masked: Optional[Tensor], base: int, skip: int, bc1: float, denom_scale: float, eps: float,
                     bound: Optional[float], edge_at: float) -> None:
    """`lamb_clean_pass_` in torch ops (any device): the same per-coordinate roundings, the
    fp64 sums in torch's order (see csrc/lamb.cpp for what it computes)."""
    q = clean_denominator(v, denom_scale, eps).mul_(bc1)
    u0 = torch.div(m, q)
    y = torch.div(ml, q)
    if bound is not None:
        u0.clamp_(-bound, bound)
        y.clamp_(-bound, bound)
        edge = u0.abs() >= edge_at
    else:
        edge = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
    if masked is not None:
        edge |= masked
    u64 = u0.double()
    acc[0] += torch.where(edge, 0.0, y.double() * u64).sum()
    if theta is not None:
        th = theta.double()
        acc[1] += torch.dot(u64, th)
        acc[2] += torch.dot(th, th)
    where = edge.nonzero().view(-1)
    seen, cap = int(acc[3]), positions.numel()
    a, b = max(skip - seen, 0), min(skip + cap - seen, where.numel())
    if b > a:
        positions[seen + a - skip:seen + b - skip] = where[a:b] + base
    acc[3] += where.numel()


def lamb_clean_pass_(acc: Tensor, positions: Tensor, m: Tensor, v: Tensor, ml: Tensor, theta: Optional[Tensor],
                     masked: Optional[Tensor], base: int, skip: int, bc1: float, denom_scale: float, eps: float,
                     bound: Optional[float], edge_at: float) -> None:
    """OneBitLamb's clean-norm pass over one range (`LambNorms.clean_norm_parts`): acc (fp64,
    4) += (sum off the edge of y u0, sum u0 theta, sum theta^2, edge count) and the edge
    coordinates numbered [skip, skip + positions.numel()) from acc[3] on written to
    positions (plus base); u0 = clamp(m / (d bc1)), y = clamp(ml / (d bc1)), d =
    `clean_denominator`(v), the edge |u0| >= edge_at (with a bound) or `masked`.
    The fused op on CPU (fp32 contiguous m, v, theta; ml fp32 or bf16), `clean_pass_torch` elsewhere."""
    if _CLEAN_OP and m.device.type == "cpu":
        if theta is not None and (theta.dtype != torch.float32 or not theta.is_contiguous()):
            theta = theta.float().contiguous()
        torch.ops.lbcomm.lamb_clean_pass_(acc, positions, m, v, ml, theta, masked, base, skip, bc1, denom_scale,
                                          eps, bound, edge_at)
    else:
        clean_pass_torch(acc, positions, m, v, ml, theta, masked, base, skip, bc1, denom_scale, eps, bound,
                         edge_at)


if _CLEAN_OP:
    @torch.library.register_fake("lbcomm::lamb_clean_pass_")
    def _(acc, positions, exp_avg, exp_avg_sq, exp_avg_local, theta, masked, base, skip, bc1, denom_scale, eps,
          bound, edge_at):
        return None


if _OP:
    @torch.library.register_fake("lbcomm::frozen_adamw_")
    def _(param, exp_avg, sqrt_v, denom_scale, eps, keep, neg_step, bound=None):
        return None
