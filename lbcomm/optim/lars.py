"""LARS: momentum with a layer-wise trust ratio and decoupled weight decay, for large
batches (see docs/large-batch.md).

With several ranks its communication is compressed by `lbcomm.onebit_hook` (1-bit error
feedback on the gradients, DDP). There is no 1-bit LARS that compresses the momentum
instead (as 1-bit Adam does): such a variant converges worse than Lars under the hook,
so the hook is the way to compress Lars's communication.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import Tensor

from ..config import CommConfig
from ..errors import AveragedGradientsError
from . import functional as F
from .agree import replicas_identical
from .base import BaseOptimizer
from .flat import FlatLayout, Segment

__all__ = ["Lars", "lars_trust_ratio", "adapts"]

Exclude = Union[None, bool, Callable[[Tensor], bool]]


def adapts(p: Tensor, exclude: Exclude) -> bool:
    """Whether parameter `p` gets the trust ratio and weight decay under a group's
    ``exclude_from_adaptation`` option: None excludes tensors with at most one dimension
    (biases, norm weights), True excludes every tensor, False none, a callable excludes
    those for which it returns True."""
    if exclude is None:
        return p.dim() > 1
    if isinstance(exclude, bool):
        return not exclude
    return not bool(exclude(p))


def lars_trust_ratio(pn: Tensor, un: Tensor, trust_coefficient: float, eps: float) -> Tensor:
    """c = trust_coefficient ||w|| / (||u|| + eps) per parameter; 1 where a norm is 0."""
    c = trust_coefficient * pn / (un + eps)
    return torch.where((pn > 0) & (un > 0), c, torch.ones_like(c))


class Lars(BaseOptimizer):
    _flat_buffers = ("momentum_buffer",)

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        exclude_from_adaptation: Exclude = None,
        *,
        grads_averaged: bool = False,
        comm: Optional[CommConfig] = None,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, exclude_from_adaptation=exclude_from_adaptation)
        super().__init__(params, defaults, comm)
        self.grads_averaged = grads_averaged

    def _validate_group(self, group: Dict[str, Any]) -> None:
        # Not BaseOptimizer's: LARS has no betas (its momentum is `momentum`).
        lr = group["lr"]
        if isinstance(lr, Tensor):
            raise ValueError(f"Invalid learning rate: {lr} (a Tensor lr is not supported; use a float)")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"Invalid momentum value: {group['momentum']} (need 0 <= momentum < 1)")
        if not 0.0 <= group["weight_decay"]:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
        if not 0.0 < group["trust_coefficient"]:
            raise ValueError(f"Invalid trust_coefficient: {group['trust_coefficient']} (must be > 0)")
        if not 0.0 <= group["eps"]:
            raise ValueError(f"Invalid epsilon value: {group['eps']}")
        ex = group["exclude_from_adaptation"]
        if not (ex is None or isinstance(ex, bool) or callable(ex)):
            raise ValueError(f"Invalid exclude_from_adaptation: {ex!r} (use None for the 1-D rule, True/False, or a "
                             "callable param -> bool that returns True for parameters to exclude)")

    # ------------------------------------------------------------------ communication
    def _check_replicas(self, slots: Tensor, stage: str) -> bool:
        same = replicas_identical(slots)
        if same:
            p, name = self.transport.world_size, type(self).__name__
            raise AveragedGradientsError(
                f"{name}: at step {self._global_step + 1} the gradients are identical on all {p} ranks: a "
                f"DistributedDataParallel has already averaged them, and {name} would average them a second time. "
                f"Pass {name}(..., grads_averaged=True) (or set optimizer.grads_averaged = True) when a DDP hook such "
                "as lbcomm.onebit_hook or DDP itself averages them; the optimizer then does not communicate. If "
                f"every rank really computes the same gradients, pass {name}(..., "
                "comm=lbcomm.CommConfig(detect_averaged_grads=False)).")
        return same is not None

    # ------------------------------------------------------------------ update
    def _warmup_update(self, L: FlatLayout, active: List[bool]) -> None:
        m, buf = self._flat["momentum_buffer"], self._grad_buf
        for seg in self._segments(L, active):
            group = self.param_groups[seg.group]
            sl = slice(seg.lo, seg.hi)
            m[sl].lerp_(buf[sl], 1 - group["momentum"])  # m <- mu m + (1 - mu) g
            # the gradients are consumed: u is formed in their place
            self._lars_update(L, seg, m, lambda i: L.view(buf, i))

    def _lars_update(self, L: FlatLayout, seg: Segment, m: Tensor, scratch: Callable[[int], Tensor]) -> None:
        """w <- w - lr c u with u = m + wd w and the trust ratio c for adapted parameters,
        u = m and c = 1 for excluded ones; parameter i's u is formed in scratch(i) (a
        tensor of its shape that may be overwritten)."""
        group = self.param_groups[seg.group]
        lr, wd, ex = group["lr"], group["weight_decay"], group["exclude_from_adaptation"]
        for i in seg.idx:
            w, mi = L.params[i], L.view(m, i)
            if not adapts(w, ex):
                F.apply_fp32(w, lambda x, mi=mi: x.add_(mi, alpha=-lr))
                continue
            u = scratch(i).copy_(mi)
            if wd != 0:
                u.add_(w, alpha=wd)
            c = lars_trust_ratio(F.norms([w]), F.norms([u]), group["trust_coefficient"], group["eps"])
            u.mul_(c)
            F.apply_fp32(w, lambda x, u=u: x.add_(u, alpha=-lr))


Lars.__doc__ = r"""Implements LARS (layer-wise adaptive rate scaling, You et al. 2017) with
    decoupled weight decay: momentum SGD whose step for each parameter tensor is rescaled
    so that its length is ``lr * trust_coefficient * ||w||``.

    .. math::
       \begin{aligned}
            &\rule{110mm}{0.4pt}                                                                 \\
            &\textbf{input}: \gamma \text{ (lr)}, \mu \text{ (momentum)}, \lambda \text{ (weight decay)},
                \eta \text{ (trust coefficient)}, \epsilon                                       \\
            &\textbf{initialize}: m_0 \leftarrow 0                                               \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                                 \\
            &\textbf{for} \: t=1 \: \textbf{to} \: \ldots \: \textbf{do}                         \\
            &\hspace{5mm}g_t \leftarrow \tfrac{1}{p}\textstyle\sum_r \nabla_{\theta} f_{t,r}(\theta_{t-1})
                \text{ (by DDP's hook, or by the optimizer)}                                     \\
            &\hspace{5mm}m_t \leftarrow \mu m_{t-1} + (1-\mu) g_t                                 \\
            &\hspace{5mm}\textbf{adapted tensors}: u_t \leftarrow m_t + \lambda \theta_{t-1}, \;
                c_t \leftarrow \eta \|\theta_{t-1}\| / (\|u_t\| + \epsilon)
                \; (1 \text{ if a norm is } 0)                                                   \\
            &\hspace{5mm}\textbf{excluded tensors}: u_t \leftarrow m_t, \; c_t \leftarrow 1     \\
            &\hspace{5mm}\theta_t \leftarrow \theta_{t-1} - \gamma c_t u_t                        \\
            &\rule{110mm}{0.4pt}                                                          \\[-1.ex]
       \end{aligned}

    Differences from You et al.'s Algorithm 1, on purpose: the momentum is an average of
    the gradients (dampening :math:`1-\mu`, as Adam's first moment) and the trust ratio and
    weight decay act on the averaged direction, after the momentum (decoupled, as in LAMB).
    An adapted tensor's step then has length exactly :math:`\gamma \eta \|\theta\|` (for
    :math:`\epsilon \to 0`), whatever the gradient's scale; an excluded tensor's step is
    :math:`\gamma m_t` (SGD with dampening = momentum). To port a recipe of the paper
    (momentum accumulated after the trust ratio, steady-state steps :math:`1/(1-\mu)` times
    longer), multiply its lr by :math:`1/(1-\mu)`.

    Exclusion (``exclude_from_adaptation``, per param group): None (default) excludes every
    tensor with ``p.dim() <= 1`` — biases, LayerNorm/BatchNorm weights and biases, scalars —
    from BOTH the trust ratio and the weight decay; True excludes the whole group, False
    adapts every tensor of it, a callable ``fn(param) -> bool`` excludes those it returns True
    for (use a module-level function if the optimizer is checkpointed: the option is saved).
    Embeddings (2-D) are adapted under the default rule.

    Data parallel: the gradients reaching `step` must be the mean over the ranks, or the
    optimizer averages them itself (one bucketed fp32 allreduce; no DDP needed). Under
    `lbcomm.onebit_hook` (1-bit compressed gradients, error feedback), DDP's own allreduce or
    another averaging hook pass ``grads_averaged=True``: the optimizer then does not
    communicate (identical gradients on every rank otherwise raise
    `lbcomm.errors.AveragedGradientsError` naming this fix). NaN/Inf in the
    averaged gradients (onebit_hook's ``nonfinite="skip"`` makes a bucket NaN on every rank)
    raise or skip the step on every rank alike (``nonfinite``).

    Args:
        params (iterable): iterable of parameters or named parameters to optimize
            or iterable of dicts defining parameter groups.
        lr (float): learning rate; for large batches scale it with
            `lbcomm.schedules.scaled_lr` and warm it up with `lbcomm.schedules.LEGW`
        momentum (float, optional): momentum factor mu (default: 0.9)
        weight_decay (float, optional): decoupled weight decay of adapted tensors (default: 0)
        trust_coefficient (float, optional): eta, the step length relative to ||w|| per unit
            of lr (default: 0.001)
        eps (float, optional): added to ||u|| in the trust ratio (default: 1e-8)
        exclude_from_adaptation (None, bool or callable, optional): which tensors get neither
            trust ratio nor weight decay, see above (default: None, tensors with dim <= 1)
        grads_averaged (bool, optional): the gradients reaching `step` are already the mean
            over the ranks (a DDP hook such as lbcomm.onebit_hook, or DDP itself, averaged
            them); the optimizer then does not communicate (the `grads_averaged` attribute)
            (default: False)
        comm (lbcomm.CommConfig, optional): ``process_group`` / ``backend`` (the ranks the
            optimizer averages over itself), ``bucket_cap_mb`` (its allreduce's buckets),
            ``nonfinite`` ("skip" or "raise" a step whose averaged gradients hold NaN/Inf, the
            state unchanged either way) and ``detect_averaged_grads`` (raise when the
            gradients are identical on every rank although `grads_averaged` is not set)
            (default: CommConfig())

    Example::

        >>> # xdoctest: +SKIP
        >>> lr = lbcomm.schedules.scaled_lr(2.0, base_batch=256, batch=8192, rule="sqrt")
        >>> optimizer = lbcomm.Lars(model.parameters(), lr=lr, weight_decay=1e-4)
        >>> scheduler = lbcomm.schedules.LEGW(optimizer, base_warmup_steps=100, batch_scale=32,
        ...                                   total_steps=10000, decay="poly")
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()
        >>> scheduler.step()
    """

