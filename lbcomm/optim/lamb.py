"""LAMB, the full-precision baseline, and `lamb_warmup_`, LAMB's update over the flat state
that `OneBitLamb`'s warmup shares (docs/optimizers.md)."""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from ..config import CommConfig
from . import functional as F
from .base import BaseOptimizer
from .flat import FlatLayout, Segment
from .flatstate import FlatState

__all__ = ["Lamb", "lamb_warmup_", "lamb_step_", "check_range"]


def check_range(name: str, value, low: float, strict: bool = False) -> None:
    """Raise ValueError unless `value` is a pair (a, b) with low <= a <= b (low < a if strict)."""
    ok = isinstance(value, (tuple, list)) and len(value) == 2
    if ok:
        a, b = value
        ok = (low < a if strict else low <= a) and a <= b
    if not ok:
        raise ValueError(f"Invalid {name}: {value!r} (need a pair (min, max) with {low} {'<' if strict else '<='} "
                         "min <= max)")


def lamb_step_(p: Tensor, u: Tensor, coef: Tensor, lr: float) -> None:
    """p <- p - lr coef u (u is scaled in place)."""
    u = u.mul_(coef)
    F.apply_fp32(p, lambda w: w.add_(u, alpha=-lr))


def lamb_warmup_(fs: FlatState, L: FlatLayout, active: List[bool],
                 track: Optional[Callable[[Segment, Tensor], None]] = None, moments=None, corrections=None) -> None:
    """LAMB on the averaged gradients in ``fs.grad_buf`` (`fs`: the optimizer's flat state)
    for the `active` parameters; `track(seg, c)` sees each segment's trust ratios (1-bit
    LAMB averages them). `moments(seg)` and `corrections(group, seg)` replace
    `FlatState.moments` and `FlatState.bias_corrections` (the optimizer's `_moments` and
    `_bias_corrections`, which a subclass may override)."""
    moments = fs.moments if moments is None else moments
    corrections = fs.bias_corrections if corrections is None else corrections
    m, v, buf = fs.buffers["exp_avg"], fs.buffers["exp_avg_sq"], fs.grad_buf
    segs, norms = fs.segments(L, active), []
    for seg in segs:
        moments(seg)
        group = fs.param_groups[seg.group]
        bc1, bc2 = corrections(group, seg)
        sl = slice(seg.lo, seg.hi)
        # u = m^ / (sqrt(v^) + eps) [+ wd p], written into the gradient buffer (g is consumed)
        F.lamb_direction(m[sl], v[sl], bc1, bc2, group["eps"], out=buf[sl])
        if group["weight_decay"] != 0:
            for i in seg.idx:
                L.view(buf, i).add_(L.tensor(i), alpha=group["weight_decay"])
        norms.append(torch.stack([F.norms([L.tensor(i) for i in seg.idx]),
                                  F.norms([L.view(buf, i) for i in seg.idx])], 1))
    if fs.sharded():  # the norms of whole parameters: squares summed over the shards
        flat = torch.zeros(len(L.params), 2, dtype=torch.float32, device=fs.device_of(L))
        for seg, n in zip(segs, norms):
            flat[seg.idx] = n.square()
        flat = fs.per_tensor(L, flat).sqrt_()
        norms = [flat[seg.idx] for seg in segs]
    for seg, n in zip(segs, norms):
        group = fs.param_groups[seg.group]
        c = F.trust_ratio(n[:, 0], n[:, 1], *group["coeff_range"])
        if track is not None:
            track(seg, c)
        for j, i in enumerate(seg.idx):
            lamb_step_(L.tensor(i), L.view(buf, i), c[j], group["lr"])


class Lamb(BaseOptimizer):
    _probes_averaged_grads = False  # the full-precision twin averages unless grads_averaged is set

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        coeff_range: Tuple[float, float] = (0.01, 10.0),
        bias_correction: bool = True,
        comm: Optional[CommConfig] = None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        coeff_range=tuple(coeff_range), bias_correction=bias_correction)
        super().__init__(params, defaults, comm)

    def _validate_group(self, group) -> None:
        super()._validate_group(group)
        check_range("coeff_range", group["coeff_range"], 0.0)

    def _warmup_update(self, L: FlatLayout, active: List[bool]) -> None:
        lamb_warmup_(self.flat_state, L, active, moments=self._moments, corrections=self._bias_corrections)


Lamb.__doc__ = r"""Implements LAMB (layer-wise adaptive moments), the full-precision twin of
    :class:`OneBitLamb`.

    .. math::
       \begin{aligned}
            &\rule{110mm}{0.4pt}                                                                 \\
            &\textbf{input}: \gamma \text{ (lr)}, \beta_1, \beta_2 \text{ (betas)}, \epsilon,
                \lambda \text{ (weight decay)}, c_{min}, c_{max}                               \\
            &\textbf{initialize}: m_0 \leftarrow 0, \: v_0 \leftarrow 0                          \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                                 \\
            &\textbf{for} \: t=1 \: \textbf{to} \: \ldots \: \textbf{do}                         \\
            &\hspace{5mm}g_t \leftarrow \tfrac{1}{p}\textstyle\sum_r \nabla_{\theta} f_{t,r}(\theta_{t-1})
                \text{ (bucketed allreduce)}                                                     \\
            &\hspace{5mm}m_t \leftarrow \beta_1 m_{t-1} + (1-\beta_1) g_t                         \\
            &\hspace{5mm}v_t \leftarrow \beta_2 v_{t-1} + (1-\beta_2) g_t^2                       \\
            &\hspace{5mm}u_t \leftarrow \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)}+\epsilon}
                + \lambda \theta_{t-1}                                                           \\
            &\hspace{5mm}c_t \leftarrow \mathrm{clamp}\big(\|\theta_{t-1}\| / \|u_t\|,
                c_{min}, c_{max}\big) \text{ per parameter tensor } (1 \text{ if a norm is } 0)  \\
            &\hspace{5mm}\theta_t \leftarrow \theta_{t-1} - \gamma c_t u_t                        \\
            &\rule{110mm}{0.4pt}                                                          \\[-1.ex]
       \end{aligned}

    The moments of all parameters live in flat fp32 buffers; in data-parallel use the
    optimizer averages the gradients itself (fused into buckets) unless a DDP hook or DDP
    itself already did and `grads_averaged` is set.

    Args:
        params (iterable): iterable of parameters or named parameters to optimize
            or iterable of dicts defining parameter groups.
        lr (float, optional): learning rate (default: 1e-3)
        betas (Tuple[float, float], optional): coefficients of the running averages of the
            gradient and its square (default: (0.9, 0.999))
        eps (float, optional): term added to the denominator (default: 1e-8)
        weight_decay (float, optional): weight decay added to the update before the trust
            ratio (default: 0)
        coeff_range (Tuple[float, float], optional): (c_min, c_max), the bounds of the trust
            ratio (default: (0.01, 10.0))
        bias_correction (bool, optional): divide m by 1-b1^t and v by 1-b2^t (default: True)
        comm (lbcomm.CommConfig, optional): the communication settings: ``process_group``
            and ``backend`` (the ranks to average over), ``bucket_cap_mb`` (the gradient
            allreduce's buckets), ``nonfinite`` ("skip" or "raise" a step whose averaged
            gradients hold NaN/Inf, the state unchanged either way) and ``shard_group`` (set
            by `lbcomm.fsdp.onebit_optimizer`); the others are about compression, which Lamb
            does not do, and Lamb does not probe for averaged gradients (it averages only
            when `grads_averaged` is not set) (default: CommConfig())

    Example::

        >>> # xdoctest: +SKIP
        >>> optimizer = lbcomm.Lamb(model.parameters(), lr=1e-2, weight_decay=0.01)
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()
    """
