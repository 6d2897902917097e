"""Typed wrappers of the optimizers' fused ops, torch.ops.lbcomm.frozen_adamw_(capped_) and
decode_caps_ (csrc/optim.cpp), lamb_clean_pass_ / lamb_edge_find_ / lamb_advance_local_
(csrc/lamb.cpp) and lamb_direction_ / implied_variance_ (csrc/lamb_direction.cpp), with the
pure-torch sequences they replace as the fallback (`functional.frozen_adamw_`,
`clean_pass_torch`, `edge_find_torch`, `direction_torch`, `functional.implied_grad_variance_`).

OneBitAdam keeps no denominator after the freeze: every step computes
sqrt(v) / sqrt(1 - b2^T) + eps again, in the op's one pass that reads p, m and v and
writes p, with IEEE's root (`functional.ieee_sqrt` in the torch sequence, so the two are
bitwise equal on every ISA; torch's own fp32 sqrt on the CPU is not correctly rounded and
took longer than the whole pass); with a bound (max_update) each coordinate's step is
clamped in the same pass, and with the capped decode's caps (`frozen_adamw_capped_`) the
momentum is capped there too, from the same root, where the reducer left that to the
update. CPU tensors use the op; CUDA tensors use the torch sequence until
the CUDA body (csrc/cuda/optim.cu) has been checked bitwise on a GPU
(tests/test_optim_kernels.py).
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import ops
from . import functional as F

__all__ = ["frozen_adamw_", "has_fused_kernel", "decode_caps_", "decode_caps_table_", "caps_table_op",
           "lamb_direction_", "direction_torch", "implied_variance_",
           "lamb_clean_pass_", "lamb_edge_find_", "clean_pass_torch", "edge_find_torch", "advance_local_", "EDGE_BLOCK",
           "sampled_runs", "SAMPLE_RUN"]

_log = logging.getLogger(__name__)


def _op_is_current() -> bool:
    """The compiled op takes the variance itself and the bound (an extension built before
    takes sqrt(v), or no bound: it would compute another update)."""
    if not (ops.HAS_EXTENSION and hasattr(torch.ops.lbcomm, "frozen_adamw_")):
        return False
    names = {a.name for a in torch.ops.lbcomm.frozen_adamw_.default._schema.arguments}
    if {"bound", "exp_avg_sq"} <= names:
        return True
    _log.warning("lbcomm._C is older than lbcomm/optim (its frozen_adamw_ takes sqrt(v) or has no bound); OneBitAdam "
                 "uses the slower torch sequence. Rebuild: pip install --no-build-isolation -e . (or python setup.py "
                 "build_ext --inplace)")
    return False


_OP = _op_is_current()
_CLEAN_OP = ops.HAS_EXTENSION and hasattr(torch.ops.lbcomm, "lamb_advance_local_")
_CAPPED_OP = ops.HAS_EXTENSION and hasattr(torch.ops.lbcomm, "frozen_adamw_capped_")
_CAPS_OP = ops.HAS_EXTENSION and hasattr(torch.ops.lbcomm, "decode_caps_")
_CAPS_TABLE_OP = ops.HAS_EXTENSION and hasattr(torch.ops.lbcomm, "decode_caps_table_")
_DIRECTION_OP = ops.HAS_EXTENSION and hasattr(torch.ops.lbcomm, "lamb_direction_")
_IMPLIED_OP = ops.HAS_EXTENSION and hasattr(torch.ops.lbcomm, "implied_variance_")
# the edge counts' blocks of the clean pass (kEdgeBlock in csrc/lamb.cpp)
EDGE_BLOCK = 128
# a sampled pass covers whole runs of SAMPLE_RUN elements (csrc/lamb.cpp's kBlock)
SAMPLE_RUN = 512


def has_fused_kernel(device: torch.device) -> bool:
    """Whether `frozen_adamw_` runs the fused op for tensors on `device`."""
    return _OP and torch.device(device).type == "cpu"


def frozen_adamw_(w: Tensor, m: Tensor, v: Tensor, bc2: float, eps: float, decay: float, step_size: float,
                  scratch: Tensor, bound: Optional[float] = None, cap: Optional[Tuple[float, float]] = None) -> None:
    """w <- w (1 - decay) - step_size m / (sqrt(v) / sqrt(bc2) + eps), in place, the root
    correctly rounded, each coordinate's step clamped to [-bound, bound] if bound is given,
    bitwise as `lbcomm.optim.functional.frozen_adamw_` (which runs where the op cannot, in
    `scratch`: at least min(STAGE, numel) fp32 elements). `cap` (a, b): first m <- sign(m)
    min(|m|, sqrt(v) a + b) in place, the capped decode's caps, which the reducer then left
    to this update (see `functional.cap_momentum_`)."""
    if w.dtype == torch.float32 and w.is_contiguous() and has_fused_kernel(w.device) and (cap is None or _CAPPED_OP):
        args = (w.view(-1), m.view(-1), v.view(-1), bc2 ** 0.5, eps, 1 - decay if decay != 0 else 1.0, -step_size,
                bound)
        if cap is None:
            torch.ops.lbcomm.frozen_adamw_(*args)
        else:
            torch.ops.lbcomm.frozen_adamw_capped_(*args, *cap)
    else:
        F.frozen_adamw_(w, m, v, bc2, eps, decay, step_size, scratch, bound, cap)


def decode_caps_(out: Tensor, v: Tensor, a: float, b: float, scale: Optional[Tensor] = None) -> None:
    """out = (sqrt(v) a + b) [scale]: the capped decode's caps (`bounds.decode_caps`), each op
    rounded, the root correctly rounded (the fp64 root rounded to fp32: the same on every
    ISA). One pass of the op on CPU (fp32 contiguous, `scale` one fp32 element); elsewhere
    torch ops."""
    if _CAPS_OP and v.device.type == "cpu" and v.dtype == out.dtype == torch.float32 and v.is_contiguous() \
            and out.is_contiguous():
        torch.ops.lbcomm.decode_caps_(out, v, a, b, None if scale is None else scale.reshape(1).float())
        return
    F.ieee_sqrt(v, out).mul_(a).add_(b)
    if scale is not None:
        out.mul_(scale)


def caps_table_op(v: Tensor) -> bool:
    """Whether `decode_caps_table_` runs for the variance `v` (CPU, fp32, contiguous)."""
    return _CAPS_TABLE_OP and v.device.type == "cpu" and v.dtype == torch.float32 and v.is_contiguous()


def decode_caps_table_(out: Tensor, v: Tensor, lo: int, starts: Tensor, table: Tensor) -> None:
    """`decode_caps_` over flat elements [lo, lo + out.numel()) of a parameter layout in one
    call (starts: int64, each parameter's first element and the end; table: fp32 [P, 3],
    (a, b, s) per parameter, b = +inf for an uncapped one, s = 1 without a scale): the same
    bits as one `decode_caps_` per parameter, without a call per parameter. CPU only
    (`caps_table_op`)."""
    torch.ops.lbcomm.decode_caps_table_(out, v, lo, starts, table)


def lamb_direction_(u: Tensor, m: Tensor, v: Tensor, vf: Optional[Tensor], stage: Tensor, scale: float, eps: float,
                    bc1: float, bound: Optional[float]) -> Optional[Tensor]:
    """OneBitLamb's direction over one range, roots included: with d = sqrt(v) / scale + eps
    (IEEE's root, `F.scaled_root`), u <- clamp((m / bc1) / d, -bound, bound) (no
    clamp for bound None); with the fresh variance `vf`, max(d / (sqrt(vf) / scale + eps))
    over the range is returned (`torch.amax`: a 1-element tensor, NaN if any ratio is).
    `stage` (fp32, the range's size) is scratch. One pass of the op on CPU (fp32,
    contiguous), then the max; elsewhere `direction_torch`, bitwise the same."""
    ts = (u, m, v, stage) if vf is None else (u, m, v, stage, vf)
    if _DIRECTION_OP and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in ts):
        torch.ops.lbcomm.lamb_direction_(u, m, v, vf, stage, scale, eps, bc1, bound)
        return None if vf is None else torch.amax(stage).reshape(1)
    return direction_torch(u, m, v, vf, stage, scale, eps, bc1, bound)


def direction_torch(u: Tensor, m: Tensor, v: Tensor, vf: Optional[Tensor], stage: Tensor, scale: float, eps: float,
                    bc1: float, bound: Optional[float]) -> Optional[Tensor]:
    """`lamb_direction_` in torch ops (its fallback, and the sequence it replaces)."""
    d = F.scaled_root(v, scale, eps, out=stage)
    part = None
    if vf is not None:
        r = F.scaled_root(vf, scale, eps, out=u)
        part = torch.amax(torch.div(d, r, out=r)).reshape(1)
    torch.div(m, bc1, out=u).div_(d)
    if bound is not None:
        u.clamp_(-bound, bound)
    return part


def implied_variance_(v_fresh: Tensor, m_new: Tensor, m: Tensor, b1: float, b2: float) -> None:
    """`F.implied_grad_variance_` (OneBitLamb's fresh variance from the reduced momentum,
    then m <- m_new) in one pass of the op on CPU (fp32, contiguous); elsewhere the torch
    ops. Bitwise the same where torch's addcmul_ fuses its multiply-add, as its vectorized
    CPU kernels do."""
    if _IMPLIED_OP and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                           for t in (v_fresh, m_new, m)):
        torch.ops.lbcomm.implied_variance_(v_fresh, m_new, m, b1, b2)
        return
    F.implied_grad_variance_(v_fresh, m_new, m, b1, b2)


def advance_local_(ml: Tensor, g: Optional[Tensor], weight: float, scratch: Optional[Tensor] = None) -> None:
    """ml <- ml + weight (g - ml) in fp32 (g None: zero), three roundings and no FMA, stored
    in ml's dtype (bf16: rounded once, to nearest even): the update the fused pass makes
    with a gradient. The op on CPU (ml contiguous); elsewhere torch ops in `scratch` (fp32,
    at least ml.numel() elements; allocated if not given)."""
    if _CLEAN_OP and ml.device.type == "cpu" and ml.is_contiguous():
        torch.ops.lbcomm.lamb_advance_local_(ml, _f32(g), weight)
    else:
        _advance_torch(ml, g, weight, scratch)


def _advance_torch(ml: Tensor, g: Optional[Tensor], weight: float, scratch: Optional[Tensor] = None) -> None:
    """`advance_local_` in torch ops (its fallback, and the fallback pass's first step)."""
    if scratch is None:
        scratch = torch.empty(ml.numel(), dtype=torch.float32, device=ml.device)
    t = scratch[:ml.numel()].view_as(ml)
    if g is None:
        t.zero_()
    else:
        t.copy_(g)
    t.sub_(ml).mul_(weight).add_(ml)
    ml.copy_(t)


def _clean_torch(m: Tensor, v: Tensor, ml: Tensor, masked: Optional[Tensor], bc1: float, denom_scale: float,
                 eps: float, bound: Optional[float], edge_at: float):
    """(u0, y, edge) of the pass, in torch ops: r = 1 / ((sqrt(v) (1 / denom_scale) + eps)
    bc1) (IEEE's root and reciprocal), u0 = m r, y = ml r."""
    r = F.ieee_sqrt(v).mul_(1 / denom_scale).add_(eps).mul_(bc1).reciprocal_()
    u0 = torch.mul(m, r)
    y = torch.mul(ml, r)
    if bound is not None:
        u0.clamp_(-bound, bound)
        y.clamp_(-bound, bound)
        edge = u0.abs() >= edge_at
    else:
        edge = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
    if masked is not None:
        edge |= masked
    return u0, y, edge


def sampled_runs(n: int, every: int, device=None) -> Tensor:
    """Per coordinate of a range of n: whether its run (SAMPLE_RUN elements) is one of the
    runs 0, every, 2 every, ... that a pass with `every` covers."""
    return (torch.arange(n, device=device) // SAMPLE_RUN) % every == 0


def clean_pass_torch(acc: Tensor, counts: Tensor, m: Tensor, v: Tensor, ml: Tensor, grad: Optional[Tensor],
                     weight: float, masked: Optional[Tensor], bc1: float, denom_scale: float, eps: float,
                     bound: Optional[float], edge_at: float, every: int = 1) -> None:
    """`lamb_clean_pass_` in torch ops (any device): the same per-coordinate roundings, the
    fp64 sums in torch's order (see csrc/lamb.cpp for what it computes)."""
    if every > 1:  # the covered runs gathered, passed over as one range, ml put back
        take = sampled_runs(m.numel(), every, m.device)
        mine = ml[take]
        if grad is not None:
            _advance_torch(mine, grad.reshape(-1)[take], weight)
            ml[take] = mine
        u0, y, covered_edge = _clean_torch(m[take], v[take], mine, None if masked is None else masked[take], bc1,
                                           denom_scale, eps, bound, edge_at)
        edge = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
        edge[take] = covered_edge
    else:
        if grad is not None:
            _advance_torch(ml, grad, weight)
        u0, y, covered_edge = _clean_torch(m, v, ml, masked, bc1, denom_scale, eps, bound, edge_at)
        edge = covered_edge
    acc[0] += torch.where(covered_edge, 0.0, y.double() * u0.double()).sum()
    pad = -m.numel() % EDGE_BLOCK
    counts.copy_(torch.nn.functional.pad(edge.long(), (0, pad)).view(-1, EDGE_BLOCK).sum(1))
    acc[1] += edge.sum()


def edge_find_torch(out: Tensor, draws: Tensor, counts: Tensor, m: Tensor, v: Tensor, masked: Optional[Tensor],
                    bc1: float, denom_scale: float, eps: float, bound: Optional[float], edge_at: float) -> None:
    """`lamb_edge_find_` in torch ops (any device): the edge of the blocks the pass counted
    in (a block counted 0 holds none of the pass's edge coordinates)."""
    edge = _clean_torch(m, v, m, masked, bc1, denom_scale, eps, bound, edge_at)[2]
    edge &= (counts > 0).repeat_interleave(EDGE_BLOCK)[:m.numel()]
    out.copy_(edge.nonzero().view(-1)[draws])


def _f32(t: Optional[Tensor]) -> Optional[Tensor]:
    """t as the op takes it: fp32 and contiguous (a copy only where it is not)."""
    return t if t is None or (t.dtype == torch.float32 and t.is_contiguous()) else t.float().contiguous()


def lamb_clean_pass_(acc: Tensor, counts: Tensor, m: Tensor, v: Tensor, ml: Tensor, grad: Optional[Tensor],
                     weight: float, masked: Optional[Tensor], bc1: float, denom_scale: float, eps: float,
                     bound: Optional[float], edge_at: float, every: int = 1) -> None:
    """OneBitLamb's clean-norm pass over one range (`LambNorms.track_and_estimate`): with
    `grad`, first ml <- ml + weight (grad - ml) (`advance_local_`); then acc (fp64, 2) +=
    (sum off the edge of y u0, edge count) and counts[b] = the edge coordinates of block b
    (EDGE_BLOCK elements) of the range; u0 = clamp(m r), y = clamp(ml r), r = 1 / (d bc1)
    with d = sqrt(v) (1 / denom_scale) + eps (IEEE's root and reciprocal: u0 is within a few
    ulps of the direction's), the edge |u0| >= edge_at (with a bound) or `masked`. With
    `every` > 1, over the runs of SAMPLE_RUN elements 0, every, 2 every, ... of the range
    only (`sampled_runs`): ml is advanced there only and the rest counts 0. The fused op on
    CPU (m, v fp32 contiguous; ml fp32 or bf16), `clean_pass_torch` elsewhere, with the
    same roundings."""
    if _CLEAN_OP and m.device.type == "cpu":
        torch.ops.lbcomm.lamb_clean_pass_(acc, counts, m, v, ml, _f32(grad), weight, masked, bc1, denom_scale, eps,
                                          bound, edge_at, every)
    else:
        clean_pass_torch(acc, counts, m, v, ml, grad, weight, masked, bc1, denom_scale, eps, bound, edge_at, every)


def lamb_edge_find_(out: Tensor, draws: Tensor, counts: Tensor, m: Tensor, v: Tensor, masked: Optional[Tensor],
                    bc1: float, denom_scale: float, eps: float, bound: Optional[float], edge_at: float) -> None:
    """out[i] = the index in the range of its draws[i]-th edge coordinate (draws in any
    order; counts: `lamb_clean_pass_`'s over the same range and arguments): the op passes
    again over the blocks holding a draw only; `edge_find_torch` elsewhere."""
    if _CLEAN_OP and m.device.type == "cpu":
        torch.ops.lbcomm.lamb_edge_find_(out, draws, counts, m, v, masked, bc1, denom_scale, eps, bound, edge_at)
    else:
        edge_find_torch(out, draws, counts, m, v, masked, bc1, denom_scale, eps, bound, edge_at)


if _CLEAN_OP:
    @torch.library.register_fake("lbcomm::lamb_clean_pass_")
    def _(acc, counts, exp_avg, exp_avg_sq, exp_avg_local, grad, weight, masked, bc1, denom_scale, eps, bound, edge_at,
          every=1):
        return None

    @torch.library.register_fake("lbcomm::lamb_advance_local_")
    def _(exp_avg_local, grad, weight):
        return None

    @torch.library.register_fake("lbcomm::lamb_edge_find_")
    def _(out, draws, counts, exp_avg, exp_avg_sq, masked, bc1, denom_scale, eps, bound, edge_at):
        return None


if _CAPS_OP:
    @torch.library.register_fake("lbcomm::decode_caps_")
    def _(out, v, a, b, scale):
        return None


if _DIRECTION_OP:
    @torch.library.register_fake("lbcomm::lamb_direction_")
    def _(u, exp_avg, exp_avg_sq, exp_avg_sq_fresh, ratio, scale, eps, bc1, bound):
        return None


if _IMPLIED_OP:
    @torch.library.register_fake("lbcomm::implied_variance_")
    def _(v_fresh, m_new, m, b1, b2):
        return None


if _CAPS_TABLE_OP:
    @torch.library.register_fake("lbcomm::decode_caps_table_")
    def _(out, v, lo, starts, table):
        return None


if _OP:
    @torch.library.register_fake("lbcomm::frozen_adamw_")
    def _(param, exp_avg, exp_avg_sq, denom_scale, eps, keep, neg_step, bound=None):
        return None
