"""1-bit LAMB: LAMB in the warmup (`lamb.lamb_warmup_`), then a frozen variance, one 1-bit
compressed allreduce of the (rescaled) momentum per step through the `OneBitStage` it
holds, and a layer coefficient per step: LAMB's trust ratio of that step's direction (on an
estimate of the norm the uncompressed direction would have), the coefficient frozen at the
warmup's average, or the larger of the two (`trust_ratio`, docs/optimizers.md)."""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from ..config import CommConfig, OneBitOptions, resolve, resolve_options
from ..common import ring_allreduce_bytes
from . import functional as F
from . import kernels as K
from .adam import check_freeze_step
from .base import BaseOptimizer
from .flat import FlatLayout, Segment
from .lamb import check_range, lamb_step_, lamb_warmup_
from .lamb_norm import LambNorms, estimated_norm, trust_mode
from .onebit import OneBitStage

__all__ = ["OneBitLamb"]

_log = logging.getLogger(__name__)

_mode = trust_mode  # the group's trust_ratio (bench/lamb_decay_probe.py reads it here)
LIVE = ("live", "aligned")  # the rules of LAMB's own ratio alone (no frozen coefficient)


class OneBitLamb(BaseOptimizer):
    _GLOBAL_OPTIONS = ("freeze_step",)
    TRUST_RATIOS = ("live", "aligned", "frozen", "max")
    GROUP_OPTIONS = ("factor_threshold", "norm_samples", "norm_step_bound")
    _param_vectors: Dict[str, float] = {**OneBitStage.VECTORS, "lamb_coeff_freeze": 0.0, "momentum_scale": 1.0,
                                        "last_factor": 1.0}
    # exp_avg_local: this rank's own momentum of its local gradients (never communicated);
    # its mean over the ranks is the momentum an uncompressed allreduce would give
    _frozen_buffers = ("exp_avg_sq_fresh", "exp_avg_local")
    _rank_local_buffers = ("exp_avg_local",)
    # it only feeds the live ratio's norm estimate (whose sampling error is far larger than
    # bf16's rounding), so it takes 2 bytes per parameter; each update runs in fp32
    _buffer_dtypes = {"exp_avg_local": torch.bfloat16}

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: Union[int, str] = 100000,
        *,
        coeff_range: Tuple[float, float] = (0.01, 10.0),
        trust_ratio: str = "aligned",
        coeff_beta: float = 0.9,
        factor_range: Tuple[float, float] = (0.5, 4.0),
        comm: Optional[CommConfig] = None,
        options: Optional[OneBitOptions] = None,
    ) -> None:
        comm, self.options = resolve_options(options, resolve(comm, "OneBitLamb"), "OneBitLamb")
        if not self.options.rescale_variance:
            raise ValueError("OneBitLamb: rescale_variance is OneBitAdam's and ZeroOneAdam's; OneBitLamb scales its "
                             "frozen variance by its own factor (factor_range). Leave it at True")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, freeze_step=freeze_step,
                        coeff_range=tuple(coeff_range), trust_ratio=trust_ratio, coeff_beta=coeff_beta,
                        factor_range=tuple(factor_range), factor_threshold=0.1,
                        norm_samples=256, norm_step_bound=0.1, bias_correction=self.options.bias_correction)
        super().__init__(params, defaults, comm)
        self._onebit = OneBitStage(self.flat_state, self.options, exact_numel=self.comm.exact_numel)
        self._norms = LambNorms(self.flat_state, self._onebit)  # the direction, the live ratio's norm

    def _validate_group(self, group) -> None:
        super()._validate_group(group)
        check_freeze_step("freeze_step", group["freeze_step"])
        F.resolve_max_update(self.options.max_update, group["betas"])
        check_range("coeff_range", group["coeff_range"], 0.0)
        if group["trust_ratio"] not in self.TRUST_RATIOS:
            raise ValueError(f"Invalid trust_ratio: {group['trust_ratio']!r} (must be one of {self.TRUST_RATIOS})")
        if not 0.0 <= group["coeff_beta"] < 1.0:
            raise ValueError(f"Invalid coeff_beta: {group['coeff_beta']} (need 0 <= coeff_beta < 1)")
        check_range("factor_range", group["factor_range"], 0.0, strict=True)
        if not 0.0 <= group["factor_threshold"]:
            raise ValueError(f"Invalid factor_threshold: {group['factor_threshold']} (must be >= 0)")
        k = group["norm_samples"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"Invalid norm_samples: {k!r} (an int >= 0; 0 takes the decoded direction's norm)")
        tau = group["norm_step_bound"]
        if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0):
            raise ValueError(f"Invalid norm_step_bound: {tau!r} (a number > 0, or None for no bound)")

    # ------------------------------------------------------------------ public API
    @property
    def compression_state(self):
        """The reducer of the momentum, as `OneBitAdam.compression_state`."""
        return self._onebit.reducer

    @property
    def frozen_after(self) -> Optional[int]:
        """The step after which the variance was frozen (the fixed freeze option, or the step
        "auto" decided on); None until then."""
        return self._onebit.frozen_after(self.frozen)

    def compression_stats(self) -> Dict[str, Any]:
        """The momentum reducer's `lbcomm.common.compressor_stats` (zeros before the freeze),
        and ``status``: "compressing", or why nothing is compressed (the warmup, one rank)."""
        return self._onebit.report.stats()

    def bytes_per_step(self) -> Optional[Dict[str, int]]:
        """What this rank sends per compression-stage step, as `OneBitAdam.bytes_per_step`,
        with ``"norm_estimate"``: the allreduce of the sampled coordinates behind the live
        ratio's norm (fp32, ``norm_samples`` + 1 per parameter)."""
        out = self._onebit.report.bytes_per_step()
        L = self.flat_state.layout
        if out is None or L is None:
            return out
        slots = self._norms.estimate_slots(L)
        n = 0 if slots is None else int((slots > 0).sum()) * self._norms.sent_columns(L, slots)[0]
        total = out.pop("total")
        out["norm_estimate"] = int(ring_allreduce_bytes(4 * n, self.transport.world_size))
        out["total"] = total + out["norm_estimate"]
        return out

    @property
    def masked_coordinates(self) -> int:
        """How many momentum coordinates are held at zero (0 before the freeze)."""
        return self._onebit.masked_coordinates

    def set_momentum_mask(self, param: Tensor, mask: Optional[Tensor]) -> None:
        """Override the automatic zero-variance mask for one parameter, as `OneBitAdam.set_momentum_mask`."""
        self._onebit.set_momentum_mask(self._prepare(), param, mask)

    # ------------------------------------------------------------------ layout and step
    def _buffer_names(self) -> tuple:
        return self._flat_buffers + (self._frozen_buffers if self.frozen else ())

    def _take_step(self, L: FlatLayout) -> bool:
        if not self.frozen:
            return self._warmup_step(L)
        if not self._onebit.grads_finite(L):
            return self._nonfinite("the local gradients")
        if not self._compressed_update(L):
            return self._nonfinite("the new momenta")
        self._onebit.report.watch_lr()
        return True

    def _warmup_update(self, L: FlatLayout, active: List[bool]) -> None:
        lamb_warmup_(self.flat_state, L, active, self._track_coeff, moments=self._moments,
                     corrections=self._bias_corrections)

    def _track_coeff(self, seg: Segment, c: Tensor) -> None:
        """Warmup: c_frz <- coeff_beta c_frz + (1 - coeff_beta) c where c != 1."""
        cf = self.flat_state.vectors["lamb_coeff_freeze"]
        idx = torch.tensor(seg.idx, device=cf.device)
        cf[idx] = F.track_coeff(cf[idx], c, self.param_groups[seg.group]["coeff_beta"])

    def _after_step(self, L: FlatLayout) -> None:
        if not self.frozen and self._onebit.freeze_due(L):
            self._onebit.freeze(L)
            for name in self._frozen_buffers:
                self.flat_state.buffers[name] = self.flat_state.new_buffer(name, L)
            self._on_freeze(L)
            self._attach_views()
            self._onebit.report.log_freeze(L)

    def _load_extra_state(self, saved, extra) -> None:
        super()._load_extra_state(saved, extra)
        loaded = self.flat_state.layout is not None and saved
        if self.frozen and loaded and "exp_avg_local" not in next(iter(saved.values())):
            # saved before the live ratio estimated the clean norm: start from the momentum
            self._reset_rank_local(["exp_avg_local"])
            _log.warning("OneBitLamb: the checkpoint has no exp_avg_local (saved by an older lbcomm); each rank's "
                         "own momentum starts from the reduced momentum")

    def _reset_rank_local(self, names) -> None:
        """exp_avg_local starts from the momentum, as at the freeze (there it is exact)."""
        for n in names:
            self.flat_state.buffers[n].copy_(self.flat_state.buffers["exp_avg"])

    def _on_freeze(self, L: FlatLayout) -> None:
        flat = self.flat_state.buffers
        flat["exp_avg_sq_fresh"].copy_(flat["exp_avg_sq"])
        self._reset_rank_local(self._rank_local_buffers)  # the warmup's momentum is exact
        idx = [i for i, on in enumerate(self._onebit.participating(L)) if on]
        m = self.flat_state.buffers["exp_avg"]
        if self.flat_state.sharded():  # rms of whole parameters, the mean over every parameter of the model
            local = torch.zeros(len(L.params), 2, dtype=torch.float32, device=m.device)
            for i in idx:
                local[i, 0] = torch.linalg.vector_norm(L.view(m, i)).square()
                local[i, 1] = 1.0
            full, where = self.flat_state.per_tensor(L, local, full=True)
            numels = torch.tensor([float(p.numel()) for g in self.param_groups for p in g["params"]], device=m.device)
            rms = (full[:, 0] / numels).sqrt()
            on = full[:, 1] > 0
            if bool(on.any()) and idx:
                mean = rms[on].mean()
                mine = rms[where[idx]]
                k = torch.where(mine > 0, mean / mine, torch.ones_like(mine))
                self.flat_state.vectors["momentum_scale"][torch.tensor(idx, device=m.device)] = k
        elif idx:  # k_p = mean_q rms(m_q) / rms(m_p): momenta of similar size through one compression
            rms = torch.stack([torch.linalg.vector_norm(L.view(m, i)) / math.sqrt(L.numels[i]) for i in idx])
            k = torch.where(rms > 0, rms.mean() / rms, torch.ones_like(rms))
            self.flat_state.vectors["momentum_scale"][torch.tensor(idx, device=m.device)] = k
        self.flat_state.vectors["last_factor"].fill_(1.0)
        cf = self.flat_state.vectors["lamb_coeff_freeze"]
        cf.masked_fill_(cf == 0, 1.0)  # never tracked (c was always 1): keep the plain step

    def _momentum_sink(self, L: FlatLayout, scale: Tensor):
        """sink(lo, hi, values): the reduced (scaled) momentum of [lo, hi): unscaled, masked,
        its implied gradient folded into the fresh variance, then committed to m."""
        m, vf = self.flat_state.buffers["exp_avg"], self.flat_state.buffers["exp_avg_sq_fresh"]

        def sink(lo: int, hi: int, values: Tensor) -> None:
            parts = [(i, L.offsets[i] + a, L.offsets[i] + b) for i, a, b in L.overlapping(lo, hi)]
            for i, a, b in parts:
                values[a - lo:b - lo].div_(scale[i])
            self._onebit.mask_range(values, lo, hi)
            for i, a, b in parts:
                b1, b2 = self.param_groups[L.group_of[i]]["betas"]
                K.implied_variance_(vf[a:b], values[a - lo:b - lo], m[a:b], b1, b2)  # commits m too
        return sink

    def _compressed_update(self, L: FlatLayout) -> bool:
        vecs = self.flat_state.vectors
        scale = vecs["momentum_scale"]
        st = self._onebit
        applied, bounds, segs, _, _ = st.step_and_reduce(L, st.participating(L), st.momentum_source(L, scale),
                                                      self._momentum_sink(L, scale), scale=scale)
        if not applied:
            return False
        for seg in segs:  # norm_step_bound's reference; saved with the param groups
            group = self.param_groups[seg.group]
            group["lr_peak"] = max(group.get("lr_peak", 0.0), group["lr"])
        clean, estimated = self._norms.track_and_estimate(L, segs, bounds)
        if not self.flat_state.sharded():  # every rank holds the whole reduced momentum and parameters
            for seg in segs:
                group = self.param_groups[seg.group]
                mode = _mode(group)
                for i in seg.idx:
                    u, ratio_max, u0n, un = self._norms.direction(L, seg, i, bounds[i], mode not in LIVE,
                                                                  i in estimated)
                    if mode != "frozen":  # un, where the direction gave it, is already ||u||
                        live = torch.cat([F.norms([L.tensor(i)]), F.norms([u]) if un is None else un])
                    else:
                        live = None
                    if i in estimated:
                        wd = 0.0 if un is None else self._norms.wd_terms(u0n, un)
                        sq = self._norms.live_sq(clean[i], wd, mode == "aligned")
                        live = torch.cat([live[:1], self._estimated_norm(sq, live[1:], group)])
                    self._lamb_step(L, seg, i, u, ratio_max, u0n, un, live)
            return True
        # sharded: this rank's max of d / d~ and squared norms first (columns: max ratio,
        # ||u0||^2, ||u||^2 under weight decay; ||theta||^2, ||u||^2 for the live ratio), one
        # allreduce for the max and one for the norms (with the clean norm's parts), then the step
        stats = torch.zeros(len(L.params), 5, dtype=torch.float32, device=self.flat_state.device_of(L))
        for seg in segs:
            mode = _mode(self.param_groups[seg.group])
            for i in seg.idx:
                u, ratio_max, u0n, un = self._norms.direction(L, seg, i, bounds[i], mode not in LIVE, i in estimated)
                if ratio_max is not None:
                    stats[i, 0] = ratio_max.reshape(())
                if u0n is not None:
                    stats[i, 1:3] = torch.cat([u0n, un]).square()
                if mode != "frozen":
                    stats[i, 3:] = torch.cat([F.norms([L.tensor(i)]), F.norms([u])]).square()
        modes = {_mode(self.param_groups[seg.group]) for seg in segs}
        ratio = self.flat_state.per_tensor(L, stats[:, :1], op="max")[:, 0] if modes - set(LIVE) else None
        norms = self.flat_state.per_tensor(L, stats[:, 1:]).sqrt_()
        if clean is not None:  # the shards' parts of the clean norm's estimate, summed; the weight decay's terms
            clean, wds = self.flat_state.per_tensor(L, clean), self._norms.wd_terms(norms[:, 0], norms[:, 1])
        for seg in segs:
            group = self.param_groups[seg.group]
            mode, wd = _mode(group), group["weight_decay"] != 0
            for i in seg.idx:
                u = self._norms.direction(L, seg, i, bounds[i], stats=False)[0]
                live = None if mode == "frozen" else norms[i, 2:]
                if i in estimated:
                    sq = self._norms.live_sq(clean[i], wds[i], mode == "aligned")
                    live = torch.cat([live[:1], self._estimated_norm(sq, live[1:], group)])
                self._lamb_step(L, seg, i, u, None if ratio is None else ratio[i:i + 1],
                                norms[i, :1] if wd else None, norms[i, 1:2] if wd else None, live)
        return True

    _estimated_norm = staticmethod(estimated_norm)

    def _lamb_step(self, L: FlatLayout, seg: Segment, i: int, u: Tensor, ratio_max: Optional[Tensor],
                   u0n: Optional[Tensor], un: Optional[Tensor], live: Optional[Tensor]) -> None:
        """p <- p - lr c u with the coefficient c of the group's trust_ratio: "live"
        clamp(||theta|| / ||u||, coeff_range) from `live` = (||theta||, ||u||) of whole
        tensors; "frozen" c_frz f with the variance factor f of parameter i; "max" the larger
        of the two."""
        group, vecs = self.param_groups[seg.group], self.flat_state.vectors
        mode = _mode(group)
        c = None
        if mode not in LIVE:
            last = vecs["last_factor"][i:i + 1]
            f = F.onebit_lamb_factor(ratio_max, u0n, un, last, *group["factor_range"], group["factor_threshold"])
            vecs["last_factor"][i:i + 1] = f
            c = vecs["lamb_coeff_freeze"][i:i + 1] * f
        if mode != "frozen":
            c_live = F.trust_ratio(live[:1], live[1:], *group["coeff_range"])
            c = c_live if c is None else torch.maximum(c, c_live)
        lamb_step_(L.tensor(i), u, c, group["lr"])

OneBitLamb.__doc__ = r"""Implements 1-bit LAMB: LAMB in the warmup, then a frozen variance, one
    1-bit compressed allreduce of the (rescaled) momentum per step, and a layer-wise
    coefficient per step (``trust_ratio``): LAMB's own trust ratio of the step's direction
    (by default with its step along the clean direction made LAMB's), the published
    coefficient frozen at the warmup's average and adapted by the variance the compressed
    momentum implies, or the larger of the two.

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
            &\hspace{5mm} \nu \leftarrow \max\big(\hat{n}, 0.1\|u\|, \|u\| / \max(1, \sigma/\gamma_{peak})\big), \:
                c_{live} \leftarrow \mathrm{clamp}\big(\|\theta\| / \nu, c_{min}, c_{max}\big), \:
                c \leftarrow c_{live} \text{ (live)}, \: c_{frz} f \text{ (frozen)}, \:
                \max(c_{live}, c_{frz} f) \text{ (max)}                                         \\
            &\hspace{5mm} \theta \leftarrow \theta - \gamma \, c \, u                           \\
            &\rule{110mm}{0.4pt}                                                          \\[-1.ex]
       \end{aligned}

    :math:`\hat{m} = m / (1-\beta_1^t)`; :math:`\hat{v}` and :math:`\hat{\tilde{v}}` are divided
    by :math:`1-\beta_2^{T_w}` (the correction frozen with the variance). "live" computes no
    :math:`f` (:math:`\tilde{v}` is kept in every mode). :math:`\hat{n}` estimates the norm of
    the direction an uncompressed allreduce would give (below); with ``norm_samples=0``,
    :math:`\nu = \|u\|`.

    Why the coefficient matters for a drop-in: the direction :math:`u` divides a momentum
    that shrinks with the gradients by a variance frozen at the warmup's, so its norm keeps
    falling, and a coefficient frozen at the warmup's average turns that into an lr decay
    that Lamb does not have: at Lamb's lr the published rule under-steps. LAMB's own
    ratio :math:`\|\theta\|/\|u\|`, computed each step from the replicated parameters
    and the reduced momentum (the same on every rank: no communication unsharded; under
    FSDP2 the squared norms are summed over ``shard_group``), keeps Lamb's step size. The
    1-bit error of a compressed tensor, however, adds to :math:`\|u\|` (most on coordinates
    of a tiny frozen variance, such as nearly dead units) and shrinks the live ratio there;
    "max" takes the live ratio but never less than the frozen coefficient.

    So the live ratio does not divide by the 1-bit error, it divides by an estimate
    :math:`\hat{n}` of the clean direction's norm: each rank keeps the momentum of its
    own gradients (``exp_avg_local``, never sent; 2 bytes per parameter in bf16, each update
    computed in fp32 and rounded once: it feeds only this estimate), whose mean over
    the ranks is the uncompressed momentum :math:`m^*`. Where the decoded :math:`u_0` is
    neither clamped nor masked, :math:`\mathrm{clamp}(\hat{m}_r / d)` is projected on
    :math:`u_0`: there the 1-bit error is nearly uncorrelated with the clean direction, so
    the projection keeps the clean part of the norm and drops the error's; on the other
    coordinates, where the error is largest, ``norm_samples`` of them (the same on every
    rank) are averaged exactly, clamped, and their squares scaled up to all of them; the
    weight decay's terms are added with the decoded :math:`u_0`. That costs one fused pass
    over the state and one fp32 allreduce of (``norm_samples`` + 1) values per parameter
    and step (``bytes_per_step()["norm_estimate"]``). The estimate may raise the coefficient above
    the decoded direction's by at most :math:`\max(1, \sigma/\gamma_{peak})`
    (``norm_step_bound`` :math:`\sigma`; :math:`\gamma_{peak}` the largest lr of the group
    in the compression stage, kept as the group's ``lr_peak``): a run at an lr of
    :math:`\sigma` or more divides by the decoded norm as before, where the larger step would
    carry more 1-bit error than the lr can take, and the factor stays fixed as the schedule
    decays the lr. Parameters averaged exactly (``exact_numel``) and a single rank have
    nothing compressed: :math:`\nu = \|u\|`.

    "aligned" divides by :math:`u`'s length along the clean direction instead,
    :math:`\langle u, u^*\rangle / \|u^*\|`: the error feedback holds back part of each step's
    signal and pays it later, so :math:`\langle u, u^*\rangle < \|u^*\|^2` and "live"'s step
    along :math:`u^*` falls short of LAMB's. :math:`\langle u_0, u_0^*\rangle` is what the
    projection above sums off the edge; :math:`\|u_0^*\|^2` there is that times the ratio of
    :math:`\sum z^2` to :math:`\sum u_0 z` over ``norm_samples`` coordinates drawn uniformly
    (:math:`z`: their exact mean, sent in the same allreduce: ``norm_samples`` more values).

    The mask, the flat fp32 state, the checkpoints and the non-finite handling are
    :class:`OneBitAdam`'s. :math:`U_p` (max_update) bounds each coordinate of :math:`u_0`
    (no clamp when None); the default 1.0 is OneBitAdam's: no coordinate's direction beyond
    the largest steady Adam step (see :class:`OneBitAdam` for why the compressed momentum
    needs a bound). "warmup" takes the largest :math:`|\hat{m}/(\sqrt{\hat{v}}+\epsilon)|` of
    parameter tensor p after the last warmup step instead (the earlier default). With
    options.capped_decode (default) the bound also caps each coordinate of the compressed
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
        freeze_step (int or str, optional): warmup steps before the variance is frozen and
            the momentum compressed; "auto": once the variance has settled and the lr warmup
            is over, as `OneBitAdam`'s (default: 100000)
        coeff_range (Tuple[float, float], optional): (min_coeff, max_coeff), the bounds of
            the LAMB coefficient (default: (0.01, 10.0))
        trust_ratio (str, optional): the compression stage's layer coefficient: "live"
            (LAMB's trust ratio of each step's direction), "aligned" (the live ratio whose
            step along the clean direction is LAMB's), "frozen" (the published
            :math:`c_{frz} f`) or "max" (the larger of "live" and "frozen") (default: "aligned")
        coeff_beta (float, optional): averaging factor of the frozen coefficient (default: 0.9)
        factor_range (Tuple[float, float], optional): (f_min, f_max), the bounds of the
            variance factor f of the frozen coefficient (default: (0.5, 4.0))
        comm (lbcomm.CommConfig, optional): the communication settings, as in
            :class:`OneBitAdam`; under FSDP2 LAMB's norms are reduced over ``shard_group``
            (default: CommConfig())
        options (lbcomm.OneBitOptions, optional): as in :class:`OneBitAdam`, but
            ``max_update`` bounds each coordinate of u0 = m^ / (sqrt(v^) + eps), before weight
            decay and the LAMB coefficient ("warmup": per parameter tensor its largest |u0|
            after the last warmup step), and ``rescale_variance`` must stay True (the factor
            f above scales the frozen variance instead) (default: OneBitOptions())

    A parameter group may also set, e.g.
    ``OneBitLamb([{"params": model.parameters(), "norm_samples": 0}])`` (details rarely
    tuned, kept out of the constructor):

    * ``factor_threshold``: :math:`\tau` above, the largest relative change of f from one
      step to the next (default: 0.1);
    * ``norm_samples``: the coordinates sampled per parameter for the live ratio's norm
      (default: 256; 0 in a checkpoint saved without it); 0 divides by the decoded norm
      :math:`\|u\|`, the rule before the estimate, and leaves ``exp_avg_local`` as it is
      (it restarts from the momentum when the estimate is turned on again);
    * ``norm_step_bound``: :math:`\sigma` above (default: 0.1); None: no bound.

    Example::

        >>> # xdoctest: +SKIP
        >>> optimizer = lbcomm.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=1000)
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()
    """
