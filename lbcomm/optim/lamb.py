"""LAMB (the full-precision baseline) and 1-bit LAMB (DESIGN.md §3)."""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..compressed import DEFAULT_BLOCK_SIZE
from .base import FlatOptimizer, _Layout, _Segment

__all__ = ["Lamb", "OneBitLamb"]


def _norms(tensors: List[Tensor]) -> Tensor:
    """fp32 L2 norm of each tensor, stacked (no host synchronization)."""
    return torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])


class Lamb(FlatOptimizer):
    _compresses = False

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        bias_correction: bool = True,
        bucket_cap_mb: float = 25.0,
        process_group=None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff, bias_correction=bias_correction, bucket_cap_mb=bucket_cap_mb)
        self._validate_group(defaults)
        super().__init__(params, defaults, process_group=process_group)

    def _validate_group(self, group) -> None:
        super()._validate_group(group)
        if not 0.0 <= group["min_coeff"] <= group["max_coeff"]:
            raise ValueError(f"Invalid min_coeff/max_coeff: {group['min_coeff']}/{group['max_coeff']} "
                             "(need 0 <= min_coeff <= max_coeff)")

    # u = m^ / (sqrt(v^) + eps) [+ wd p], written into the gradient buffer (g is consumed)
    def _direction(self, seg: _Segment, v: Tensor) -> Tensor:
        group = self.param_groups[seg.group]
        bc1, bc2 = self._bias_corrections(group, seg)
        u = self._denominator(v[seg.lo:seg.hi], bc2, group["eps"], out=self._grad_buf[seg.lo:seg.hi])
        return torch.div(self._flat["exp_avg"][seg.lo:seg.hi] / bc1, u, out=u)

    def _add_weight_decay(self, L: _Layout, seg: _Segment) -> None:
        wd = self.param_groups[seg.group]["weight_decay"]
        if wd != 0:
            for i in seg.idx:
                L.view(self._grad_buf, i).add_(L.params[i], alpha=wd)

    def _trust_ratio(self, L: _Layout, seg: _Segment) -> Tensor:
        """c = clamp(||p|| / ||u||, min_coeff, max_coeff) per parameter; 1 where a norm is 0."""
        group = self.param_groups[seg.group]
        pn = _norms([L.params[i] for i in seg.idx])
        un = _norms([L.view(self._grad_buf, i) for i in seg.idx])
        c = (pn / un).clamp(group["min_coeff"], group["max_coeff"])
        return torch.where((pn > 0) & (un > 0), c, torch.ones_like(c))

    def _scaled_update(self, L: _Layout, seg: _Segment, coef: Tensor) -> None:
        """p <- p - lr coef_p u_p."""
        lr = self.param_groups[seg.group]["lr"]
        for j, i in enumerate(seg.idx):
            u = L.view(self._grad_buf, i).mul_(coef[j])
            self._apply(L.params[i], lambda w, u=u: w.add_(u, alpha=-lr))

    def _track_coeff(self, seg: _Segment, c: Tensor) -> None:
        pass

    def _warmup_update(self, L: _Layout, active: List[bool]) -> None:
        for seg in self._segments(L, active):
            self._update_moments(seg)
            self._direction(seg, self._flat["exp_avg_sq"])
            self._add_weight_decay(L, seg)
            c = self._trust_ratio(L, seg)
            self._track_coeff(seg, c)
            self._scaled_update(L, seg, c)


Lamb.__doc__ = r"""Implements LAMB (layer-wise adaptive moments), the full-precision twin of
    :class:`OneBitLamb`.

    .. math::
       \begin{aligned}
            &\rule{110mm}{0.4pt}                                                                 \\
            &\textbf{input}: \gamma \text{ (lr)}, \beta_1, \beta_2 \text{ (betas)}, \epsilon,
                \lambda \text{ (weight decay)}, c_{min}, c_{max}                                 \\
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
        max_coeff (float, optional): upper bound of the trust ratio (default: 10.0)
        min_coeff (float, optional): lower bound of the trust ratio (default: 0.01)
        bias_correction (bool, optional): divide m by 1-b1^t and v by 1-b2^t (default: True)
        bucket_cap_mb (float, optional): bucket size of the gradient allreduce (default: 25)
        process_group (ProcessGroup, optional): the ranks to average over (default: the world)

    Example::

        >>> # xdoctest: +SKIP
        >>> optimizer = lbcomm.Lamb(model.parameters(), lr=1e-2, weight_decay=0.01)
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()
    """


class OneBitLamb(Lamb):
    _compresses = True
    _frozen_buffers = ("exp_avg_sq_fresh",)
    _param_vectors = {"lamb_coeff_freeze": 0.0, "momentum_scale": 1.0, "last_factor": 1.0}

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100000,
        *,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        bias_correction: bool = True,
        block_size: Optional[int] = DEFAULT_BLOCK_SIZE,
        mask_threshold: float = 1e-10,
        nonfinite: str = "raise",
        bucket_cap_mb: float = 25.0,
        process_group=None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, freeze_step=freeze_step,
                        max_coeff=max_coeff, min_coeff=min_coeff, coeff_beta=coeff_beta, factor_max=factor_max,
                        factor_min=factor_min, factor_threshold=factor_threshold, bias_correction=bias_correction,
                        block_size=block_size, mask_threshold=mask_threshold, nonfinite=nonfinite,
                        bucket_cap_mb=bucket_cap_mb)
        self._validate_group(defaults)
        FlatOptimizer.__init__(self, params, defaults, process_group=process_group)

    def _validate_group(self, group) -> None:
        super()._validate_group(group)
        if not 0.0 <= group["coeff_beta"] < 1.0:
            raise ValueError(f"Invalid coeff_beta: {group['coeff_beta']} (need 0 <= coeff_beta < 1)")
        if not 0.0 < group["factor_min"] <= group["factor_max"]:
            raise ValueError(f"Invalid factor_min/factor_max: {group['factor_min']}/{group['factor_max']} "
                             "(need 0 < factor_min <= factor_max)")
        if not 0.0 <= group["factor_threshold"]:
            raise ValueError(f"Invalid factor_threshold: {group['factor_threshold']} (must be >= 0)")

    def _track_coeff(self, seg: _Segment, c: Tensor) -> None:
        """Warmup: c_frz <- coeff_beta c_frz + (1 - coeff_beta) c where c != 1."""
        beta = self.param_groups[seg.group]["coeff_beta"]
        cf = self._vectors["lamb_coeff_freeze"]
        idx = torch.tensor(seg.idx, device=cf.device)
        old = cf[idx]
        cf[idx] = torch.where(c != 1, beta * old + (1 - beta) * c, old)

    def _on_freeze(self, L: _Layout) -> None:
        self._flat["exp_avg_sq_fresh"].copy_(self._flat["exp_avg_sq"])
        idx = [i for i, on in enumerate(self._participating(L)) if on]
        if idx:  # k_p = mean_q rms(m_q) / rms(m_p): momenta of similar size through one compression
            m = self._flat["exp_avg"]
            rms = torch.stack([torch.linalg.vector_norm(L.view(m, i)) / math.sqrt(L.numels[i]) for i in idx])
            k = torch.where(rms > 0, rms.mean() / rms, torch.ones_like(rms))
            self._vectors["momentum_scale"][torch.tensor(idx, device=m.device)] = k
        self._vectors["last_factor"].fill_(1.0)
        cf = self._vectors["lamb_coeff_freeze"]
        cf.masked_fill_(cf == 0, 1.0)  # never tracked (c was always 1): keep the plain step

    def _compressed_update(self, L: _Layout) -> bool:
        new_m = self._compress_momentum(L, scale=self._vectors["momentum_scale"])
        if new_m is None:
            return False
        m, vf = self._flat["exp_avg"], self._flat["exp_avg_sq_fresh"]
        gt = torch.empty_like(m)  # the gradient the compressed momentum implies
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


OneBitLamb.__doc__ = r"""Implements 1-bit LAMB: LAMB in the warmup, then a frozen variance, one
    1-bit compressed allreduce of the (rescaled) momentum per step and a LAMB coefficient
    frozen at the warmup's average, adapted by the variance the compressed momentum implies.

    .. math::
       \begin{aligned}
            &\rule{110mm}{0.4pt}                                                                 \\
            &\textbf{warmup } (t \leq T_w): \text{ exactly } \mathrm{Lamb}, \text{ and per parameter }
                c_{frz} \leftarrow \beta_c c_{frz} + (1-\beta_c) c_t \text{ when } c_t \neq 1      \\
            &\textbf{at the freeze}: \tilde{v} \leftarrow v, \:
                k_p \leftarrow \mathrm{mean}_q\,\mathrm{rms}(m_q) / \mathrm{rms}(m_p), \:
                f_{last} \leftarrow 1                                                            \\
            &\textbf{compression } (t > T_w), \text{ per parameter tensor}:                      \\
            &\hspace{5mm} m' \leftarrow \mathrm{CompressedAllreduce}\big(
                (\beta_1 m + (1-\beta_1) g_{t,r}) k_p\big) / k_p \odot \mathrm{mask}               \\
            &\hspace{5mm} \tilde{g} \leftarrow (m' - \beta_1 m)/(1-\beta_1), \: m \leftarrow m', \:
                \tilde{v} \leftarrow \beta_2 \tilde{v} + (1-\beta_2) \tilde{g}^2                  \\
            &\hspace{5mm} d \leftarrow \sqrt{\hat{v}} + \epsilon, \:
                \tilde{d} \leftarrow \sqrt{\hat{\tilde{v}}} + \epsilon, \:
                u_0 \leftarrow \hat{m} / d, \: u \leftarrow u_0 + \lambda \theta                    \\
            &\hspace{5mm} f \leftarrow \max_i (d / \tilde{d}); \:
                \textbf{if } \lambda > 0: r \leftarrow \min(1, \|u_0\|/\|u\|), \:
                f \leftarrow f r + (1 - r)                                                       \\
            &\hspace{5mm} f \leftarrow \mathrm{clamp}(f, f_{min}, f_{max}), \:
                f \leftarrow \mathrm{clamp}\big(f, f_{last}(1-\tau), f_{last}(1+\tau)\big), \:
                f_{last} \leftarrow f                                                            \\
            &\hspace{5mm} \theta \leftarrow \theta - \gamma \, c_{frz} f \, u                      \\
            &\rule{110mm}{0.4pt}                                                          \\[-1.ex]
       \end{aligned}

    :math:`\hat{m} = m / (1-\beta_1^t)`; :math:`\hat{v}` and :math:`\hat{\tilde{v}}` are divided
    by :math:`1-\beta_2^{T_w}` (the correction frozen with the variance). The mask, the
    flat fp32 state, the checkpoints and the non-finite handling are those of
    :class:`OneBitAdam`.

    Args:
        params (iterable): iterable of parameters or named parameters to optimize
            or iterable of dicts defining parameter groups.
        lr (float, optional): learning rate (default: 1e-3)
        betas (Tuple[float, float], optional): coefficients of the running averages of the
            gradient and its square (default: (0.9, 0.999))
        eps (float, optional): term added to the denominator (default: 1e-8)
        weight_decay (float, optional): weight decay added to the update (default: 0)
        freeze_step (int, optional): warmup steps before the variance is frozen and the
            momentum compressed (default: 100000)
        max_coeff (float, optional): upper bound of the LAMB coefficient (default: 10.0)
        min_coeff (float, optional): lower bound of the LAMB coefficient (default: 0.01)
        coeff_beta (float, optional): averaging factor of the frozen coefficient (default: 0.9)
        factor_max (float, optional): upper bound of the variance factor f (default: 4.0)
        factor_min (float, optional): lower bound of the variance factor f (default: 0.5)
        factor_threshold (float, optional): largest relative change of f per step (default: 0.1)
        bias_correction (bool, optional): as in :class:`OneBitAdam` (default: True)
        block_size (int or None, optional): elements per scale block of the compressed
            allreduce; None selects the published single-scale scheme
            (default: lbcomm.DEFAULT_BLOCK_SIZE)
        mask_threshold (float, optional): coordinates whose frozen variance is at most this
            times the mean variance get no momentum after the freeze, as in
            :class:`OneBitAdam` (default: 1e-10)
        nonfinite (str, optional): "raise" or "skip" a step with NaN/Inf, state unchanged
            (default: "raise")
        bucket_cap_mb (float, optional): bucket size of the warmup gradient allreduce (default: 25)
        process_group (ProcessGroup, optional): the ranks to average over (default: the world)

    Example::

        >>> # xdoctest: +SKIP
        >>> optimizer = lbcomm.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=1000)
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()
    """
