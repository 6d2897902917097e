"""Typed wrapper of the optimizers' fused op, torch.ops.lbcomm.frozen_adamw_ (csrc/optim.cpp),
with the pure-torch sequence it replaces (`functional.frozen_adamw_`) as the fallback.

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

__all__ = ["frozen_adamw_", "has_fused_kernel"]

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


if _OP:
    @torch.library.register_fake("lbcomm::frozen_adamw_")
    def _(param, exp_avg, sqrt_v, denom_scale, eps, keep, neg_step, bound=None):
        return None
