"""1-bit LAMB: LAMB in the warmup (`lamb.lamb_warmup_`), then a frozen variance, one 1-bit
compressed allreduce of the (rescaled) momentum per step through the `OneBitStage` it
holds, and a layer coefficient per step: LAMB's trust ratio of that step's direction, the
coefficient frozen at the warmup's average, or the larger of the two (`trust_ratio`,
docs/optimizers.md)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..config import CommConfig
from ..common import compressor_stats
from . import functional as F
from .adam import check_freeze_step
from .base import BaseOptimizer
from .flat import FlatLayout, Segment
from .lamb import check_range, lamb_step_, lamb_warmup_
from .onebit import OneBitStage

__all__ = ["OneBitLamb"]


def _mode(group) -> str:
    """The group's trust_ratio; a checkpoint saved before the option existed continues with
    the rule it was trained with, "frozen"."""
    return group.get("trust_ratio", "frozen")


class OneBitLamb(BaseOptimizer):
    _GLOBAL_OPTIONS = ("freeze_step",)
    TRUST_RATIOS = ("live", "frozen", "max")
    _param_vectors: Dict[str, float] = {**OneBitStage.VECTORS, "lamb_coeff_freeze": 0.0, "momentum_scale": 1.0,
                                        "last_factor": 1.0}
    _frozen_buffers = ("exp_avg_sq_fresh",)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100000,
        *,
        coeff_range: Tuple[float, float] = (0.01, 10.0),
        trust_ratio: str = "max",
        coeff_beta: float = 0.9,
        factor_range: Tuple[float, float] = (0.5, 4.0),
        bias_correction: bool = True,
        comm: Optional[CommConfig] = None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, freeze_step=freeze_step,
                        coeff_range=tuple(coeff_range), trust_ratio=trust_ratio, coeff_beta=coeff_beta,
                        factor_range=tuple(factor_range), factor_threshold=0.1,
                        bias_correction=bias_correction)
        self._scratch_u: Optional[Tensor] = None
        super().__init__(params, defaults, comm)
        self._onebit = OneBitStage(self, exact_numel=self.comm.exact_numel)

    def _validate_group(self, group) -> None:
        super()._validate_group(group)
        check_freeze_step("freeze_step", group["freeze_step"])
        F.resolve_max_update(self.comm.max_update, group["betas"])
        check_range("coeff_range", group["coeff_range"], 0.0)
        if group["trust_ratio"] not in self.TRUST_RATIOS:
            raise ValueError(f"Invalid trust_ratio: {group['trust_ratio']!r} (must be 'live', 'frozen' or 'max')")
        if not 0.0 <= group["coeff_beta"] < 1.0:
            raise ValueError(f"Invalid coeff_beta: {group['coeff_beta']} (need 0 <= coeff_beta < 1)")
        check_range("factor_range", group["factor_range"], 0.0, strict=True)
        if not 0.0 <= group["factor_threshold"]:
            raise ValueError(f"Invalid factor_threshold: {group['factor_threshold']} (must be >= 0)")

    # ------------------------------------------------------------------ public API
    @property
    def compression_state(self):
        """The reducer of the momentum, as `OneBitAdam.compression_state`."""
        return self._onebit.reducer

    def compression_stats(self) -> Dict[str, Any]:
        """The momentum reducer's `lbcomm.common.compressor_stats` (zeros before the freeze)."""
        return compressor_stats(self._onebit.reducer)

    def bytes_per_step(self) -> Optional[Dict[str, int]]:
        """What this rank sends per compression-stage step, as `OneBitAdam.bytes_per_step`."""
        return self._onebit.bytes_per_step()

    @property
    def masked_coordinates(self) -> int:
        """How many momentum coordinates are held at zero (0 before the freeze)."""
        return self._onebit.masked_coordinates

    def set_momentum_mask(self, param: Tensor, mask: Optional[Tensor]) -> None:
        """Override the automatic zero-variance mask for one parameter, as `OneBitAdam.set_momentum_mask`."""
        self._onebit.set_momentum_mask(param, mask)

    # ------------------------------------------------------------------ layout and step
    def _buffer_names(self) -> tuple:
        return self._flat_buffers + (self._frozen_buffers if self.frozen else ())

    def _on_layout(self, old, new) -> None:
        super()._on_layout(old, new)
        self._scratch_u = None

    def _take_step(self, L: FlatLayout) -> bool:
        if not self.frozen:
            return self._warmup_step(L)
        if not self._onebit.grads_finite(L):
            return self._nonfinite("the local gradients")
        if not self._compressed_update(L):
            return self._nonfinite("the new momenta")
        self._onebit.watch_lr()
        return True

    def _warmup_update(self, L: FlatLayout, active: List[bool]) -> None:
        lamb_warmup_(self, L, active, self._track_coeff)

    def _track_coeff(self, seg: Segment, c: Tensor) -> None:
        """Warmup: c_frz <- coeff_beta c_frz + (1 - coeff_beta) c where c != 1."""
        cf = self._vectors["lamb_coeff_freeze"]
        idx = torch.tensor(seg.idx, device=cf.device)
        cf[idx] = F.track_coeff(cf[idx], c, self.param_groups[seg.group]["coeff_beta"])

    def _after_step(self, L: FlatLayout) -> None:
        if not self.frozen and self._global_step >= self._option("freeze_step"):
            self._onebit.freeze(L)
            self._flat["exp_avg_sq_fresh"] = torch.zeros_like(self._flat["exp_avg"])
            self._on_freeze(L)
            self._attach_views()
            self._onebit.log_freeze(L)

    def _on_freeze(self, L: FlatLayout) -> None:
        self._flat["exp_avg_sq_fresh"].copy_(self._flat["exp_avg_sq"])
        idx = [i for i, on in enumerate(self._onebit.participating(L)) if on]
        m = self._flat["exp_avg"]
        if self._sharded():  # rms of whole parameters, the mean over every parameter of the model
            local = torch.zeros(len(L.params), 2, dtype=torch.float32, device=m.device)
            for i in idx:
                local[i, 0] = torch.linalg.vector_norm(L.view(m, i)).square()
                local[i, 1] = 1.0
            full, where = self._per_tensor(L, local, full=True)
            numels = torch.tensor([float(p.numel()) for g in self.param_groups for p in g["params"]], device=m.device)
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
            self._onebit.mask_range(values, lo, hi)
            for i, a, b in parts:
                b1, b2 = self.param_groups[L.group_of[i]]["betas"]
                F.implied_grad_variance_(vf[a:b], values[a - lo:b - lo], m[a:b], b1, b2)  # commits m too

        return sink

    def _compressed_update(self, L: FlatLayout) -> bool:
        vecs = self._vectors
        scale = vecs["momentum_scale"]
        st = self._onebit
        applied, bounds, segs, _ = st.step_and_reduce(L, st.participating(L), st.momentum_source(L, scale),
                                                      self._momentum_sink(L, scale), scale=scale)
        if not applied:
            return False
        if not self._sharded():  # every rank holds the whole reduced momentum and parameters
            for seg in segs:
                mode = _mode(self.param_groups[seg.group])
                for i in seg.idx:
                    u, ratio_max, u0n, un = self._direction(L, seg, i, bounds[i], stats=mode != "live")
                    live = None if mode == "frozen" else torch.cat([F.norms([L.tensor(i)]), F.norms([u])])
                    self._lamb_step(L, seg, i, u, ratio_max, u0n, un, live)
            return True
        # sharded: this rank's max of d / d~ and squared norms first (columns: max ratio,
        # ||u0||^2, ||u||^2 under weight decay; ||theta||^2, ||u||^2 for the live ratio), one
        # allreduce for the max and one for the norms, then the step
        stats = torch.zeros(len(L.params), 5, dtype=torch.float32, device=self._device(L))
        for seg in segs:
            mode = _mode(self.param_groups[seg.group])
            for i in seg.idx:
                u, ratio_max, u0n, un = self._direction(L, seg, i, bounds[i], stats=mode != "live")
                if ratio_max is not None:
                    stats[i, 0] = ratio_max.reshape(())
                if u0n is not None:
                    stats[i, 1:3] = torch.cat([u0n, un]).square()
                if mode != "frozen":
                    stats[i, 3:] = torch.cat([F.norms([L.tensor(i)]), F.norms([u])]).square()
        modes = {_mode(self.param_groups[seg.group]) for seg in segs}
        ratio = self._per_tensor(L, stats[:, :1], op="max")[:, 0] if modes - {"live"} else None
        norms = self._per_tensor(L, stats[:, 1:]).sqrt_()
        for seg in segs:
            group = self.param_groups[seg.group]
            mode, wd = _mode(group), group["weight_decay"] != 0
            for i in seg.idx:
                u = self._direction(L, seg, i, bounds[i], stats=False)[0]
                self._lamb_step(L, seg, i, u, None if ratio is None else ratio[i:i + 1],
                                norms[i, :1] if wd else None, norms[i, 1:2] if wd else None,
                                None if mode == "frozen" else norms[i, 2:])
        return True

    def _direction(self, L: FlatLayout, seg: Segment, i: int, bound: Optional[float], stats: bool = True):
        """Parameter i's update direction u = clamp(m^ / d, -U, U) [+ wd p] in the update
        buffer, with (if `stats`) max(d / d~) and, under weight decay, ||u0|| and ||u||
        (1-element tensors) of this rank's elements."""
        m, v, vf = self._flat["exp_avg"], self._flat["exp_avg_sq"], self._flat["exp_avg_sq_fresh"]
        stage, u_buf = self._onebit.stage_buffer(L), self._update_buffer(L)
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

    def _lamb_step(self, L: FlatLayout, seg: Segment, i: int, u: Tensor, ratio_max: Optional[Tensor],
                   u0n: Optional[Tensor], un: Optional[Tensor], live: Optional[Tensor]) -> None:
        """p <- p - lr c u with the coefficient c of the group's trust_ratio: "live"
        clamp(||theta|| / ||u||, coeff_range) from `live` = (||theta||, ||u||) of whole
        tensors; "frozen" c_frz f with the variance factor f of parameter i; "max" the larger
        of the two."""
        group, vecs = self.param_groups[seg.group], self._vectors
        mode = _mode(group)
        c = None
        if mode != "live":
            last = vecs["last_factor"][i:i + 1]
            f = F.onebit_lamb_factor(ratio_max, u0n, un, last, *group["factor_range"], group["factor_threshold"])
            vecs["last_factor"][i:i + 1] = f
            c = vecs["lamb_coeff_freeze"][i:i + 1] * f
        if mode != "frozen":
            c_live = F.trust_ratio(live[:1], live[1:], *group["coeff_range"])
            c = c_live if c is None else torch.maximum(c, c_live)
        lamb_step_(L.tensor(i), u, c, group["lr"])

    def _update_buffer(self, L: FlatLayout) -> Tensor:
        """One parameter's update direction (the largest parameter's size): its norms need
        the whole of it."""
        if self._scratch_u is None:
            self._scratch_u = torch.empty(max(L.numels, default=0), dtype=torch.float32, device=self._device(L))
        return self._scratch_u


OneBitLamb.__doc__ = r"""Implements 1-bit LAMB: LAMB in the warmup, then a frozen variance, one
    1-bit compressed allreduce of the (rescaled) momentum per step, and a layer-wise
    coefficient per step (``trust_ratio``): LAMB's own trust ratio of the step's direction,
    the published coefficient frozen at the warmup's average and adapted by the variance
    the compressed momentum implies, or the larger of the two.

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
            &\hspace{5mm} c_{live} \leftarrow \mathrm{clamp}\big(\|\theta\| / \|u\|, c_{min}, c_{max}\big), \:
                c \leftarrow c_{live} \text{ (live)}, \: c_{frz} f \text{ (frozen)}, \:
                \max(c_{live}, c_{frz} f) \text{ (max)}                                         \\
            &\hspace{5mm} \theta \leftarrow \theta - \gamma \, c \, u                           \\
            &\rule{110mm}{0.4pt}                                                          \\[-1.ex]
       \end{aligned}

    :math:`\hat{m} = m / (1-\beta_1^t)`; :math:`\hat{v}` and :math:`\hat{\tilde{v}}` are divided
    by :math:`1-\beta_2^{T_w}` (the correction frozen with the variance). "live" computes no
    :math:`f` (:math:`\tilde{v}` is kept in every mode).

    Why the coefficient matters for a drop-in: the direction :math:`u` divides a momentum
    that shrinks with the gradients by a variance frozen at the warmup's, so its norm keeps
    falling, and a coefficient frozen at the warmup's average turns that into an lr decay
    that Lamb does not have: at Lamb's lr the published rule under-steps. LAMB's own
    ratio :math:`\|\theta\|/\|u\|`, computed each step from the replicated parameters
    and the reduced momentum (the same on every rank: no communication unsharded; under
    FSDP2 the squared norms are summed over ``shard_group``), keeps Lamb's step size. The
    1-bit error of a compressed tensor, however, adds to :math:`\|u\|` (most on coordinates
    of a tiny frozen variance, such as nearly dead units) and shrinks the live ratio there;
    "max" takes the live ratio but never less than the frozen coefficient. The mask, the
    flat fp32 state, the checkpoints and the non-finite handling are those of
    :class:`OneBitAdam`. :math:`U_p` (max_update) bounds each coordinate of :math:`u_0`
    (no clamp when None); the default 1.0 is OneBitAdam's: no coordinate's direction beyond
    the largest steady Adam step (see :class:`OneBitAdam` for why the compressed momentum
    needs a bound). "warmup" takes the largest :math:`|\hat{m}/(\sqrt{\hat{v}}+\epsilon)|` of
    parameter tensor p after the last warmup step instead (the earlier default). With
    comm.capped_decode (default) the bound also caps each coordinate of the compressed
    allreduce's momentum (in its momentum scale), as in :class:`OneBitAdam`, and the error
    feedback keeps what the cap held back.

    Args:
        params (iterable): iterable of parameters or named parameters to optimize
            or iterable of dicts defining parameter groups.
        lr (float, optional): learning rate, meant to be Lamb's for the same model and
            schedule (default: 1e-3)
        betas (Tuple[float, float], optional): coefficients of the running averages of the
            gradient and its square (default: (0.9, 0.999))
        eps (float, optional): term added to the denominator (default: 1e-8)
        weight_decay (float, optional): weight decay added to the update (default: 0)
        freeze_step (int, optional): warmup steps before the variance is frozen and the
            momentum compressed (default: 100000)
        coeff_range (Tuple[float, float], optional): (min_coeff, max_coeff), the bounds of
            the LAMB coefficient (default: (0.01, 10.0))
        trust_ratio (str, optional): the compression stage's layer coefficient: "live"
            (LAMB's trust ratio of each step's direction), "frozen" (the published
            :math:`c_{frz} f`) or "max" (the larger of the two) (default: "max")
        coeff_beta (float, optional): averaging factor of the frozen coefficient (default: 0.9)
        factor_range (Tuple[float, float], optional): (f_min, f_max), the bounds of the
            variance factor f of the frozen coefficient (default: (0.5, 4.0))
        bias_correction (bool, optional): as in :class:`OneBitAdam` (default: True)
        comm (lbcomm.CommConfig, optional): the communication settings, as in
            :class:`OneBitAdam`; ``max_update`` bounds each coordinate of u0 = m^ / (sqrt(v^) +
            eps), before weight decay and the LAMB coefficient ("warmup": per parameter
            tensor its largest |u0| after the last warmup step); under FSDP2 LAMB's norms
            are reduced over ``shard_group`` (default: CommConfig())

    A parameter group may also set ``factor_threshold``, the largest relative change of f
    from one step to the next (default: 0.1), e.g.
    ``OneBitLamb([{"params": model.parameters(), "factor_threshold": 0.2}])``: a detail of
    the published rule that is rarely tuned, kept out of the constructor.

    Example::

        >>> # xdoctest: +SKIP
        >>> optimizer = lbcomm.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=1000)
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()
    """
