"""LAMB (the full-precision baseline) and 1-bit LAMB (docs/optimizers.md)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from ..config import DEFAULT_BLOCK_SIZE
from ..topology import Topology
from . import functional as F
from .base import BaseOptimizer
from .flat import FlatLayout, Segment
from .onebit import OneBitOptimizer

__all__ = ["Lamb", "OneBitLamb"]


class Lamb(BaseOptimizer):
    # Options a subclass adds to every group (set by its __init__ before Lamb.__init__ runs).
    _subclass_defaults: Dict[str, Any] = {}

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
        backend: str = "auto",
        shard_group=None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff, bias_correction=bias_correction, bucket_cap_mb=bucket_cap_mb,
                        **self._subclass_defaults)
        super().__init__(params, defaults, process_group=process_group, backend=backend, shard_group=shard_group)

    def _validate_group(self, group) -> None:
        super()._validate_group(group)
        if not 0.0 <= group["min_coeff"] <= group["max_coeff"]:
            raise ValueError(f"Invalid min_coeff/max_coeff: {group['min_coeff']}/{group['max_coeff']} "
                             "(need 0 <= min_coeff <= max_coeff)")

    def _track_coeff(self, seg: Segment, c: Tensor) -> None:
        """Called with each warmup step's trust ratios (1-bit LAMB averages them)."""

    def _warmup_update(self, L: FlatLayout, active: List[bool]) -> None:
        m, v, buf = self._flat["exp_avg"], self._flat["exp_avg_sq"], self._grad_buf
        segs, norms = self._segments(L, active), []
        for seg in segs:
            self._moments(seg)
            group = self.param_groups[seg.group]
            bc1, bc2 = self._bias_corrections(group, seg)
            sl = slice(seg.lo, seg.hi)
            # u = m^ / (sqrt(v^) + eps) [+ wd p], written into the gradient buffer (g is consumed)
            F.lamb_direction(m[sl], v[sl], bc1, bc2, group["eps"], out=buf[sl])
            if group["weight_decay"] != 0:
                for i in seg.idx:
                    L.view(buf, i).add_(L.tensor(i), alpha=group["weight_decay"])
            norms.append(torch.stack([F.norms([L.tensor(i) for i in seg.idx]),
                                      F.norms([L.view(buf, i) for i in seg.idx])], 1))
        if self._sharded():  # the norms of whole parameters: squares summed over the shards
            flat = torch.zeros(len(L.params), 2, dtype=torch.float32, device=self._device(L))
            for seg, n in zip(segs, norms):
                flat[seg.idx] = n.square()
            flat = self._per_tensor(L, flat).sqrt_()
            norms = [flat[seg.idx] for seg in segs]
        for seg, n in zip(segs, norms):
            group = self.param_groups[seg.group]
            c = F.trust_ratio(n[:, 0], n[:, 1], group["min_coeff"], group["max_coeff"])
            self._track_coeff(seg, c)
            for j, i in enumerate(seg.idx):
                self._lamb_step(L.tensor(i), L.view(buf, i), c[j], group["lr"])

    @staticmethod
    def _lamb_step(p: Tensor, u: Tensor, coef: Tensor, lr: float) -> None:
        """p <- p - lr coef u (u is scaled in place)."""
        u = u.mul_(coef)
        F.apply_fp32(p, lambda w: w.add_(u, alpha=-lr))


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
        backend (str, optional): "torch" (torch.distributed), "mpi" (mpi4py, launched with
            mpirun; `process_group` is then an mpi4py communicator or None) or "auto":
            torch.distributed when initialized, else MPI under mpirun; every collective goes
            through `lbcomm.comm.get_transport` (default: "auto")
        shard_group (ProcessGroup, optional): for FSDP2-sharded parameters, set by
            `lbcomm.fsdp.onebit_optimizer` (the norms are reduced over it) (default: None)

    Example::

        >>> # xdoctest: +SKIP
        >>> optimizer = lbcomm.Lamb(model.parameters(), lr=1e-2, weight_decay=0.01)
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()
    """


class OneBitLamb(OneBitOptimizer, Lamb):
    _frozen_buffers = ("exp_avg_sq_fresh",)
    _scratch_u: Optional[Tensor] = None
    _param_vectors = {**OneBitOptimizer._param_vectors, "lamb_coeff_freeze": 0.0, "momentum_scale": 1.0,
                      "last_factor": 1.0}

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
        max_update: Union[float, str, None] = 1.0,
        exact_numel: int = 4096,
        nonfinite: str = "raise",
        bucket_cap_mb: float = 25.0,
        detect_averaged_grads: bool = True,
        process_group=None,
        backend: str = "auto",
        topology: Union[str, Topology, None] = "auto",
        shard_group=None,
    ) -> None:
        self._subclass_defaults = dict(freeze_step=freeze_step, coeff_beta=coeff_beta, factor_max=factor_max,
                                       factor_min=factor_min, factor_threshold=factor_threshold,
                                       block_size=block_size, mask_threshold=mask_threshold, max_update=max_update,
                                       exact_numel=exact_numel,
                                       nonfinite=nonfinite, detect_averaged_grads=detect_averaged_grads)
        super().__init__(params, lr, betas, eps, weight_decay, max_coeff=max_coeff, min_coeff=min_coeff,
                         bias_correction=bias_correction, bucket_cap_mb=bucket_cap_mb, process_group=process_group,
                         backend=backend, shard_group=shard_group, topology=topology)

    def _validate_group(self, group) -> None:
        super()._validate_group(group)
        if not 0.0 <= group["coeff_beta"] < 1.0:
            raise ValueError(f"Invalid coeff_beta: {group['coeff_beta']} (need 0 <= coeff_beta < 1)")
        if not 0.0 < group["factor_min"] <= group["factor_max"]:
            raise ValueError(f"Invalid factor_min/factor_max: {group['factor_min']}/{group['factor_max']} "
                             "(need 0 < factor_min <= factor_max)")
        if not 0.0 <= group["factor_threshold"]:
            raise ValueError(f"Invalid factor_threshold: {group['factor_threshold']} (must be >= 0)")

    def _track_coeff(self, seg: Segment, c: Tensor) -> None:
        """Warmup: c_frz <- coeff_beta c_frz + (1 - coeff_beta) c where c != 1."""
        cf = self._vectors["lamb_coeff_freeze"]
        idx = torch.tensor(seg.idx, device=cf.device)
        cf[idx] = F.track_coeff(cf[idx], c, self.param_groups[seg.group]["coeff_beta"])

    def _on_freeze(self, L: FlatLayout) -> None:
        self._flat["exp_avg_sq_fresh"].copy_(self._flat["exp_avg_sq"])
        idx = [i for i, on in enumerate(self._participating(L)) if on]
        m = self._flat["exp_avg"]
        if self._sharded():  # rms of whole parameters, the mean over every parameter of the model
            local = torch.zeros(len(L.params), 2, dtype=torch.float32, device=m.device)
            for i in idx:
                local[i, 0] = torch.linalg.vector_norm(L.view(m, i)).square()
                local[i, 1] = 1.0
            full, where = self._per_tensor(L, local, full=True)
            numels = torch.tensor([float(p.numel()) for p in self._params_in_order()], device=m.device)
            rms = (full[:, 0] / numels).sqrt()
            on = full[:, 1] > 0
            if bool(on.any()) and idx:
                mean = rms[on].mean()
                mine = rms[where[idx]]
                k = torch.where(mine > 0, mean / mine, torch.ones_like(mine))
                self._vectors["momentum_scale"][torch.tensor(idx, device=m.device)] = k
        elif idx:  # k_p = mean_q rms(m_q) / rms(m_p): momenta of similar size through one compression
            rms = torch.stack([torch.linalg.vector_norm(L.view(m, i)) / math.sqrt(L.numels[i]) for i in idx])
            k = torch.where(rms > 0, rms.mean() / rms, torch.ones_like(rms))
            self._vectors["momentum_scale"][torch.tensor(idx, device=m.device)] = k
        self._vectors["last_factor"].fill_(1.0)
        cf = self._vectors["lamb_coeff_freeze"]
        cf.masked_fill_(cf == 0, 1.0)  # never tracked (c was always 1): keep the plain step

    def _momentum_sink(self, L: FlatLayout, scale: Tensor):
        """sink(lo, hi, values): the reduced (scaled) momentum of [lo, hi): unscaled, masked,
        its implied gradient folded into the fresh variance, then committed to m."""
        m, vf = self._flat["exp_avg"], self._flat["exp_avg_sq_fresh"]

        def sink(lo: int, hi: int, values: Tensor) -> None:
            parts = [(i, L.offsets[i] + a, L.offsets[i] + b) for i, a, b in L.overlapping(lo, hi)]
            for i, a, b in parts:
                values[a - lo:b - lo].div_(scale[i])
            self._mask_range(values, lo, hi)
            for i, a, b in parts:
                b1, b2 = self.param_groups[L.group_of[i]]["betas"]
                F.implied_grad_variance_(vf[a:b], values[a - lo:b - lo], m[a:b], b1, b2)  # commits m too

        return sink

    def _compressed_update(self, L: FlatLayout) -> bool:
        vecs = self._vectors
        scale = vecs["momentum_scale"]
        if not self._reduce_momentum(L, self._momentum_source(L, scale), self._momentum_sink(L, scale)):
            return False
        bounds = self._update_bounds(L)
        segs = self._segments(L, self._participating(L), vstep="variance_step")
        sharded = self._sharded()
        stats = torch.zeros(len(L.params), 3, dtype=torch.float32, device=self._device(L)) if sharded else None
        for seg in segs:
            for i in seg.idx:
                u, ratio_max, u0n, un = self._direction(L, seg, i, bounds[i])
                if sharded:  # the shards' max and squared norms first, the step below
                    stats[i, 0] = ratio_max.reshape(())
                    if u0n is not None:
                        stats[i, 1:] = torch.cat([u0n, un]).square()
                else:
                    self._frozen_lamb_step(L, seg, i, u, ratio_max, u0n, un)
        if sharded:  # one allreduce for the max ratio (of d / d~ >= 0) and one for the norms
            ratio = self._per_tensor(L, stats[:, :1], op="max")[:, 0]
            norms = self._per_tensor(L, stats[:, 1:]).sqrt_()
            for seg in segs:
                wd = self.param_groups[seg.group]["weight_decay"] != 0
                for i in seg.idx:
                    u = self._direction(L, seg, i, bounds[i], stats=False)[0]
                    self._frozen_lamb_step(L, seg, i, u, ratio[i:i + 1], norms[i, :1] if wd else None,
                                           norms[i, 1:] if wd else None)
        return True

    def _direction(self, L: FlatLayout, seg: Segment, i: int, bound: Optional[float], stats: bool = True):
        """Parameter i's update direction u = clamp(m^ / d, -U, U) [+ wd p] in the update
        buffer, with (if `stats`) max(d / d~) and, under weight decay, ||u0|| and ||u||
        (1-element tensors) of this rank's elements."""
        m, v, vf = self._flat["exp_avg"], self._flat["exp_avg_sq"], self._flat["exp_avg_sq_fresh"]
        stage, u_buf = self._stage_buffer(L), self._update_buffer(L)
        group = self.param_groups[seg.group]
        bc1, bc2 = self._bias_corrections(group, seg)
        eps, wd = group["eps"], group["weight_decay"]
        o, n = L.offsets[i], L.numels[i]
        u = u_buf[:n]
        # d = sqrt(v^) + eps, d~ likewise of the fresh variance; f = max(d / d~);
        # u0 = m^ / d, clamped to [-U, U] per coordinate (max_update)
        ratio_max = None
        for lo in range(0, n, F.STAGE):
            hi = min(n, lo + F.STAGE)
            d = F.denominator(v[o + lo:o + hi], bc2, eps, out=stage[:hi - lo])
            if stats:
                r = F.denominator(vf[o + lo:o + hi], bc2, eps, out=u[lo:hi])
                part = torch.amax(torch.div(d, r, out=r)).reshape(1)
                ratio_max = part if ratio_max is None else torch.maximum(ratio_max, part)
            torch.div(m[o + lo:o + hi], bc1, out=u[lo:hi]).div_(d)
            if bound is not None:
                u[lo:hi].clamp_(-bound, bound)
        u0n = un = None
        u = u.view(L.shapes[i])
        if wd != 0:
            u0n = F.norms([u]) if stats else None
            u.add_(L.tensor(i), alpha=wd)
            un = F.norms([u]) if stats else None
        return u, ratio_max, u0n, un

    def _frozen_lamb_step(self, L: FlatLayout, seg: Segment, i: int, u: Tensor, ratio_max: Tensor,
                          u0n: Optional[Tensor], un: Optional[Tensor]) -> None:
        """p <- p - lr c_frz f u with the variance factor f of parameter i."""
        group, vecs = self.param_groups[seg.group], self._vectors
        last = vecs["last_factor"][i:i + 1]
        f = F.onebit_lamb_factor(ratio_max, u0n, un, last, group["factor_min"], group["factor_max"],
                                 group["factor_threshold"])
        vecs["last_factor"][i:i + 1] = f
        self._lamb_step(L.tensor(i), u, vecs["lamb_coeff_freeze"][i:i + 1] * f, group["lr"])

    def _update_buffer(self, L: FlatLayout) -> Tensor:
        """One parameter's update direction (the largest parameter's size): its norms need
        the whole of it."""
        if self._scratch_u is None:
            self._scratch_u = torch.empty(max(L.numels, default=0), dtype=torch.float32, device=self._device(L))
        return self._scratch_u

    def _on_layout(self, old, new) -> None:
        super()._on_layout(old, new)
        self._scratch_u = None


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
                u_0 \leftarrow \mathrm{clamp}(\hat{m} / d, -U_p, U_p), \: u \leftarrow u_0 + \lambda \theta \\
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
    :class:`OneBitAdam`. :math:`U_p` (max_update) bounds each coordinate of :math:`u_0`
    (no clamp when None); the default 1.0 is OneBitAdam's: no coordinate's direction beyond
    the largest steady Adam step (see :class:`OneBitAdam` for why the compressed momentum
    needs a bound). "warmup" takes the largest :math:`|\hat{m}/(\sqrt{\hat{v}}+\epsilon)|` of
    parameter tensor p after the last warmup step instead (the earlier default).

    Args:
        params (iterable): iterable of parameters or named parameters to optimize
            or iterable of dicts defining parameter groups.
        lr (float, optional): learning rate; the best value can be larger than Lamb's on
            the same task, so tune it rather than copying Lamb's (default: 1e-3)
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
        max_update (float, str or None, optional): in the compression stage, the bound U_p on
            each coordinate of u0 = m^ / (sqrt(v^) + eps), before weight decay and the LAMB
            coefficient: "warmup" (per parameter tensor, its largest |u0| after the last
            warmup step, recorded at the freeze and saved in checkpoints), a number > 0,
            "auto" (Adam's largest possible |u0|, (1-b1) / sqrt((1-b2)(1-b1^2/b2)), needs
            b1^2 < b2), or None (the published, unbounded update) (default: 1.0)
        exact_numel (int, optional): the parameters of at most this many elements averaged
            exactly in the compression stage, as in :class:`OneBitAdam`; 0 compresses every
            parameter, as published (default: 4096)
        nonfinite (str, optional): "raise" or "skip" a step with NaN/Inf, state unchanged
            (default: "raise")
        bucket_cap_mb (float, optional): bucket size of the warmup gradient allreduce (default: 25)
        detect_averaged_grads (bool, optional): raise `lbcomm.errors.AveragedGradientsError`
            when the gradients are identical on every rank at the first warmup or compression
            step (a DDP without lbcomm's hook); False only when every rank really trains on
            the same batch (default: True)
        process_group (ProcessGroup, optional): the ranks to average over (default: the world)
        backend (str, optional): "torch" (torch.distributed), "mpi" (mpi4py, launched with
            mpirun; `process_group` is then an mpi4py communicator or None) or "auto":
            torch.distributed when initialized, else MPI under mpirun; every collective goes
            through `lbcomm.comm.get_transport` (default: "auto")
        topology (Topology, str or None, optional): nodes of fast-linked ranks for the
            momentum reduction, as in :class:`OneBitAdam` (default: "auto")
        shard_group (ProcessGroup, optional): for FSDP2-sharded parameters, set by
            `lbcomm.fsdp.onebit_optimizer` (LAMB's norms are reduced over it) (default: None)

    Example::

        >>> # xdoctest: +SKIP
        >>> optimizer = lbcomm.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=1000)
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()
    """
