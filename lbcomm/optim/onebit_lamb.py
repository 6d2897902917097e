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

from ..config import CommConfig
from ..common import ring_allreduce_bytes
from . import functional as F
from .adam import check_freeze_step
from .base import BaseOptimizer
from .flat import FlatLayout, Segment
from .lamb import check_range, lamb_step_, lamb_warmup_
from .onebit import OneBitStage

__all__ = ["OneBitLamb"]

_log = logging.getLogger(__name__)

# |u0| >= U * AT_BOUND counts as clamped: the capped decode leaves coordinates at U within
# a few roundings, on either side
AT_BOUND = 1 - 1e-5


def _mode(group) -> str:
    """The group's trust_ratio; a checkpoint saved before the option existed continues with
    the rule it was trained with, "frozen"."""
    return group.get("trust_ratio", "frozen")


def _samples(group) -> int:
    """The group's norm_samples (0: the live ratio takes the decoded direction's norm); a
    checkpoint saved before the option existed continues with that rule."""
    return 0 if _mode(group) == "frozen" else group.get("norm_samples", 0)


class OneBitLamb(BaseOptimizer):
    _GLOBAL_OPTIONS = ("freeze_step",)
    TRUST_RATIOS = ("live", "frozen", "max")
    GROUP_OPTIONS = ("factor_threshold", "norm_samples", "norm_step_bound")
    _param_vectors: Dict[str, float] = {**OneBitStage.VECTORS, "lamb_coeff_freeze": 0.0, "momentum_scale": 1.0,
                                        "last_factor": 1.0}
    # exp_avg_local: this rank's own momentum of its local gradients (never communicated);
    # its mean over the ranks is the momentum an uncompressed allreduce would give
    _frozen_buffers = ("exp_avg_sq_fresh", "exp_avg_local")
    _rank_local_buffers = ("exp_avg_local",)

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
        trust_ratio: str = "max",
        coeff_beta: float = 0.9,
        factor_range: Tuple[float, float] = (0.5, 4.0),
        bias_correction: bool = True,
        comm: Optional[CommConfig] = None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, freeze_step=freeze_step,
                        coeff_range=tuple(coeff_range), trust_ratio=trust_ratio, coeff_beta=coeff_beta,
                        factor_range=tuple(factor_range), factor_threshold=0.1,
                        norm_samples=256, norm_step_bound=0.1, bias_correction=bias_correction)
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
        return self._onebit.stats()

    def bytes_per_step(self) -> Optional[Dict[str, int]]:
        """What this rank sends per compression-stage step, as `OneBitAdam.bytes_per_step`,
        with ``"norm_estimate"``: the allreduce of the sampled coordinates behind the live
        ratio's norm (fp64, ``norm_samples`` + 1 per parameter)."""
        out = self._onebit.bytes_per_step()
        L = self._layout
        if out is None or L is None:
            return out
        slots = self._estimate_slots(L)
        n = 0 if slots is None else int((slots > 0).sum()) * (1 + int(slots.max()))
        total = out.pop("total")
        out["norm_estimate"] = int(ring_allreduce_bytes(8 * n, self.transport.world_size))
        out["total"] = total + out["norm_estimate"]
        return out

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
        if not self.frozen and self._onebit.freeze_due(L):
            self._onebit.freeze(L)
            for name in self._frozen_buffers:
                self._flat[name] = torch.zeros_like(self._flat["exp_avg"])
            self._on_freeze(L)
            self._attach_views()
            self._onebit.log_freeze(L)

    def _load_extra_state(self, saved, extra) -> None:
        super()._load_extra_state(saved, extra)
        if self.frozen and self._layout is not None and saved and "exp_avg_local" not in next(iter(saved.values())):
            # saved before the live ratio estimated the clean norm: start from the momentum
            self._reset_rank_local(["exp_avg_local"])
            _log.warning("OneBitLamb: the checkpoint has no exp_avg_local (saved by an older lbcomm); each rank's "
                         "own momentum starts from the reduced momentum")

    def _reset_rank_local(self, names) -> None:
        """exp_avg_local starts from the momentum, as at the freeze (there it is exact)."""
        for n in names:
            self._flat[n].copy_(self._flat["exp_avg"])

    def _on_freeze(self, L: FlatLayout) -> None:
        self._flat["exp_avg_sq_fresh"].copy_(self._flat["exp_avg_sq"])
        self._flat["exp_avg_local"].copy_(self._flat["exp_avg"])  # the warmup's momentum is exact
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
        self._track_local_momentum(L, segs)
        for seg in segs:  # norm_step_bound's reference; saved with the param groups
            group = self.param_groups[seg.group]
            group["lr_peak"] = max(group.get("lr_peak", 0.0), group["lr"])
        clean, estimated = self._clean_norm_parts(L, segs, bounds)
        if not self._sharded():  # every rank holds the whole reduced momentum and parameters
            for seg in segs:
                group = self.param_groups[seg.group]
                mode = _mode(group)
                for i in seg.idx:
                    u, ratio_max, u0n, un = self._direction(L, seg, i, bounds[i], stats=mode != "live")
                    live = None if mode == "frozen" else torch.cat([F.norms([L.tensor(i)]), F.norms([u])])
                    if i in estimated:
                        live = torch.cat([live[:1], self._estimated_norm(clean[i], live[1:], group)])
                    self._lamb_step(L, seg, i, u, ratio_max, u0n, un, live)
            return True
        # sharded: this rank's max of d / d~ and squared norms first (columns: max ratio,
        # ||u0||^2, ||u||^2 under weight decay; ||theta||^2, ||u||^2 for the live ratio), one
        # allreduce for the max and one for the norms (with the clean norm's parts), then the step
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
        if clean is not None:  # the shards' parts of the squared clean norm, summed
            clean = self._per_tensor(L, clean[:, None])[:, 0]
        for seg in segs:
            group = self.param_groups[seg.group]
            mode, wd = _mode(group), group["weight_decay"] != 0
            for i in seg.idx:
                u = self._direction(L, seg, i, bounds[i], stats=False)[0]
                live = None if mode == "frozen" else norms[i, 2:]
                if i in estimated:
                    live = torch.cat([live[:1], self._estimated_norm(clean[i], live[1:], group)])
                self._lamb_step(L, seg, i, u, None if ratio is None else ratio[i:i + 1],
                                norms[i, :1] if wd else None, norms[i, 1:2] if wd else None, live)
        return True

    # ------------------------------------------------------------------ the live ratio's norm
    def _track_local_momentum(self, L: FlatLayout, segs) -> None:
        """exp_avg_local <- b1 exp_avg_local + (1 - b1) g, this rank's own gradients."""
        ml = self._flat["exp_avg_local"]
        for seg in segs:
            w = 1 - self.param_groups[seg.group]["betas"][0]
            for i in seg.idx:
                g = L.grad(i)
                view = ml[L.offsets[i]:L.offsets[i] + L.numels[i]]
                view.lerp_(torch.zeros_like(view) if g is None else g.reshape(-1).float(), w)

    def _estimate_slots(self, L: FlatLayout) -> Optional[Tensor]:
        """Per parameter whose live ratio takes the estimated norm: its norm_samples (a long
        tensor in layout order, 0 for the others); None when no parameter does. Nothing
        to estimate where nothing is compressed: with one rank, and for the parameters
        averaged exactly (exact_numel), the decoded momentum is the clean one."""
        if self._onebit.reducer is None:
            return None
        part = self._onebit.exact.part(L)
        exact = set() if part is None else {i for i, _ in part[1]}
        k = [_samples(self.param_groups[L.group_of[i]]) if on and i not in exact else 0
             for i, on in enumerate(self._onebit.participating(L))]
        return torch.tensor(k) if any(k) else None

    def _clean_norm_parts(self, L: FlatLayout, segs, bounds: List[Optional[float]]):
        """Per parameter (fp64, this rank's shard), an estimate of ||u*||^2 where u* is the
        direction an uncompressed allreduce would give: u* = clamp(m* / d, -U, U) + wd theta
        with m* the mean over the ranks of exp_avg_local; and the set of the parameters
        estimated (`_estimate_slots`). (None, empty) when no parameter needs it.

        The ranks' mean of clamp(m_r / d) is projected on the decoded direction u0 where u0
        is neither clamped nor masked (one scalar per parameter); where it is, the compression
        error is largest and not independent of u0, so norm_samples of those coordinates (the
        same ones on every rank) are averaged exactly, clamped, and their squares scaled up
        to all of them. One fp64 allreduce of (samples + 1) per parameter; one pass over each
        parameter, STAGE elements at a time (nothing model-sized is allocated)."""
        slots = self._estimate_slots(L)
        if slots is None:
            return None, set()
        dev = self._device(L)
        rows = [i for i in range(len(L.params)) if slots[i] > 0]
        row_of = {i: r for r, i in enumerate(rows)}
        sent = torch.zeros(len(rows), 1 + int(slots.max()), dtype=torch.float64, device=dev)
        out = torch.zeros(len(L.params), dtype=torch.float64, device=dev)
        number = self._param_indices()  # torch's numbering: the same on every shard
        picked: List[Tuple[int, int, int]] = []
        for seg in segs:
            group = self.param_groups[seg.group]
            if not _samples(group):
                continue
            for i in seg.idx:
                if i not in row_of:  # averaged exactly
                    continue
                r = row_of[i]
                edges = self._projection(L, seg, i, bounds[i], sent[r, :1], out[i:i + 1])
                n_edge = sum(int(e.numel()) if isinstance(e, Tensor) else e for e in edges)
                k = min(int(slots[i]), n_edge)
                if k:  # the same draw on every rank: the decoded u0, and so the edge, is the same
                    if n_edge > k:
                        gen = torch.Generator().manual_seed(1009 * (self._global_step + 1) + number[id(L.params[i])])
                        draws = torch.randint(n_edge, (k,), generator=gen).to(dev)
                    else:
                        draws = torch.arange(n_edge, device=dev)
                    self._sample(L, seg, i, bounds[i], edges, draws, sent[r, 1:1 + k])
                picked.append((i, k, n_edge))
        self.transport.all_reduce(sent, op="sum")
        sent.div_(self.transport.world_size)
        for i, k, n_edge in picked:
            r, bound = row_of[i], bounds[i]
            z = sent[r, 1:1 + k]
            if bound is not None:
                z = z.clamp(-bound, bound)
            out[i] += sent[r, 0] + (z.square().sum() * (n_edge / k) if k else 0.0)
        return out, set(row_of)

    def _edge(self, L: FlatLayout, seg: Segment, i: int, bound: Optional[float], lo: int, hi: int):
        """(d, u0, edge) of parameter i's elements [lo, hi) in the staging buffers: d =
        sqrt(v^) + eps, u0 = clamp(m^ / d, -U, U), edge: the coordinates that u0 holds at
        the bound or that the momentum mask holds at zero."""
        m, v = self._flat["exp_avg"], self._flat["exp_avg_sq"]
        group = self.param_groups[seg.group]
        bc1, bc2 = self._bias_corrections(group, seg)
        o = L.offsets[i]
        stage, u_buf = self._onebit.stage_buffer(L), self._update_buffer(L)
        d = F.denominator(v[o + lo:o + hi], bc2, group["eps"], out=stage[:hi - lo])
        u0 = torch.div(m[o + lo:o + hi], bc1, out=u_buf[:hi - lo]).div_(d)
        if bound is not None:
            u0.clamp_(-bound, bound)
            edge = torch.abs(u0) >= bound * AT_BOUND
        else:
            edge = torch.zeros(hi - lo, dtype=torch.bool, device=u0.device)
        self._onebit.masks.mark(edge, o + lo, o + hi)
        return d, u0, edge

    def _projection(self, L: FlatLayout, seg: Segment, i: int, bound: Optional[float], proj: Tensor,
                    decay: Tensor) -> list:
        """The pass over parameter i: proj = sum over the non-edge coordinates of
        clamp(m_local^ / d) u0 (this rank's), decay = the weight decay's part of ||u*||^2
        (2 wd <u0, theta> + wd^2 ||theta||^2, with the decoded u0). Returns each STAGE
        range's edge: its positions (a tensor) while they take at most STAGE elements in
        all, its count (an int) after that."""
        group = self.param_groups[seg.group]
        bc1, wd = self._bias_corrections(group, seg)[0], group["weight_decay"]
        ml, o, n = self._flat["exp_avg_local"], L.offsets[i], L.numels[i]
        theta = L.tensor(i).reshape(-1)
        y_buf = torch.empty(min(n, F.STAGE), dtype=torch.float32, device=self._device(L))
        edges, kept = [], 0
        for lo in range(0, n, F.STAGE):
            hi = min(n, lo + F.STAGE)
            d, u0, edge = self._edge(L, seg, i, bound, lo, hi)
            y = torch.div(ml[o + lo:o + hi], bc1, out=y_buf[:hi - lo]).div_(d)
            if bound is not None:
                y.clamp_(-bound, bound)
            where = edge.nonzero().view(-1)
            y.mul_(u0)
            proj += (y.sum() - y[where].sum()).double()  # the sum off the edge
            kept += where.numel()
            edges.append(where if kept <= F.STAGE else where.numel())
            if wd != 0:
                th = theta[lo:hi].float()
                decay += 2 * wd * torch.dot(u0, th).double() + wd * wd * torch.dot(th, th).double()
        return edges

    def _sample(self, L: FlatLayout, seg: Segment, i: int, bound: Optional[float], edges: list, draws: Tensor,
                out: Tensor) -> None:
        """out[j] = m_local^ / d at the draws[j]-th edge coordinate (in order); the ranges
        whose edge positions were not kept are computed again."""
        group = self.param_groups[seg.group]
        bc1, bc2 = self._bias_corrections(group, seg)
        ml, v, o = self._flat["exp_avg_local"], self._flat["exp_avg_sq"], L.offsets[i]
        seen = 0
        for c, where in enumerate(edges):
            lo = c * F.STAGE
            count = where.numel() if isinstance(where, Tensor) else where
            mine = ((draws >= seen) & (draws < seen + count)).nonzero().view(-1)
            if mine.numel():
                if not isinstance(where, Tensor):
                    where = self._edge(L, seg, i, bound, lo, min(L.numels[i], lo + F.STAGE))[2].nonzero().view(-1)
                at = o + lo + where[draws[mine] - seen]
                d = F.denominator(v[at], bc2, group["eps"], out=torch.empty_like(v[at]))
                out[mine] = torch.div(ml[at], bc1).div_(d).double()
            seen += count

    @staticmethod
    def _estimated_norm(sq: Tensor, un: Tensor, group) -> Tensor:
        """The live ratio's ||u*||: the estimate's root, at least 0.1 ||u|| and, under
        norm_step_bound tau, at least ||u|| / max(1, tau / lr_peak), lr_peak the largest lr
        of the group in the compression stage: the coefficient is at most that factor times
        the decoded direction's, so a layer's step is at most max(lr, tau lr / lr_peak)
        ||theta||, and shrinks with the schedule. `un` = ||u|| of the decoded direction."""
        un64 = un.double()
        est = torch.sqrt(torch.maximum(sq, 0.01 * un64.square()))
        tau = group.get("norm_step_bound")
        if tau is not None:
            est = torch.maximum(est, un64 / max(1.0, tau / max(group["lr"], group.get("lr_peak", 0.0))))
        return est.float().reshape(1)

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
    own gradients (``exp_avg_local``, 4 bytes per parameter, never sent), whose mean over
    the ranks is the uncompressed momentum :math:`m^*`. Where the decoded :math:`u_0` is
    neither clamped nor masked, :math:`\mathrm{clamp}(\hat{m}_r / d)` is projected on
    :math:`u_0`: there the 1-bit error is nearly uncorrelated with the clean direction, so
    the projection keeps the clean part of the norm and drops the error's; on the other
    coordinates, where the error is largest, ``norm_samples`` of them (the same on every
    rank) are averaged exactly, clamped, and their squares scaled up to all of them; the
    weight decay's terms are added with the decoded :math:`u_0`. That costs one fp64
    allreduce of (``norm_samples`` + 1) values per parameter and step
    (``bytes_per_step()["norm_estimate"]``). The estimate may raise the coefficient above
    the decoded direction's by at most :math:`\max(1, \sigma/\gamma_{peak})`
    (``norm_step_bound`` :math:`\sigma`; :math:`\gamma_{peak}` the largest lr of the group
    in the compression stage, kept as the group's ``lr_peak``): a run at an lr of
    :math:`\sigma` or more divides by the decoded norm as before, where the larger step would
    carry more 1-bit error than the lr can take, and the factor stays fixed as the schedule
    decays the lr. Parameters averaged exactly (``exact_numel``) and a single rank have
    nothing compressed: :math:`\nu = \|u\|`.

    The mask, the
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
        freeze_step (int or str, optional): warmup steps before the variance is frozen and
            the momentum compressed; "auto": once the variance has settled and the lr warmup
            is over, as `OneBitAdam`'s (default: 100000)
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

    A parameter group may also set, e.g.
    ``OneBitLamb([{"params": model.parameters(), "norm_samples": 0}])`` (details rarely
    tuned, kept out of the constructor):

    * ``factor_threshold``: :math:`\tau` above, the largest relative change of f from one
      step to the next (default: 0.1);
    * ``norm_samples``: the coordinates sampled per parameter for the live ratio's norm
      (default: 256); 0 divides by the decoded direction's norm :math:`\|u\|` (the rule
      before the estimate; a checkpoint saved without the option continues with it);
    * ``norm_step_bound``: :math:`\sigma` above (default: 0.1); None: no bound.

    Example::

        >>> # xdoctest: +SKIP
        >>> optimizer = lbcomm.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=1000)
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()
    """
