"""1-bit LAMB's per-tensor quantities in the compression stage, over the optimizer's
`FlatState` and its `OneBitStage`: the update direction u = clamp(m^ / d, -U, U) [+ wd p]
(`LambNorms.direction`), and the estimate of the norm the uncompressed direction would
have, behind the live trust ratio (`LambNorms.clean_norm_parts`, from each rank's own
momentum ``exp_avg_local``, `track_local_momentum`; see `OneBitLamb`'s docs)."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import functional as F
from .flat import FlatLayout, Segment

__all__ = ["LambNorms", "AT_BOUND", "trust_mode", "samples"]

# |u0| >= U * AT_BOUND counts as clamped: the capped decode leaves coordinates at U within
# a few roundings, on either side
AT_BOUND = 1 - 1e-5


def trust_mode(group) -> str:
    """The group's trust_ratio; a checkpoint saved before the option existed continues with
    the rule it was trained with, "frozen"."""
    return group.get("trust_ratio", "frozen")


def samples(group) -> int:
    """The group's norm_samples (0: the live ratio takes the decoded direction's norm); a
    checkpoint saved before the option existed continues with that rule."""
    return 0 if trust_mode(group) == "frozen" else group.get("norm_samples", 0)


class LambNorms:
    """The direction and the clean-norm estimate of a OneBitLamb (`fs`: its flat state,
    `stage`: its `OneBitStage`); ``scratch_u`` holds one parameter's direction."""

    def __init__(self, fs, stage):
        self.fs = fs
        self.stage = stage
        self.scratch_u: Optional[Tensor] = None
        fs.layout_listeners.append(self.on_layout)

    def on_layout(self, old, new) -> None:
        """The flat state's layout changed (a `FlatState` layout listener): a new scratch."""
        self.scratch_u = None

    def direction(self, L: FlatLayout, seg: Segment, i: int, bound: Optional[float], stats: bool = True):
        """Parameter i's update direction u = clamp(m^ / d, -U, U) [+ wd p] in the update
        buffer, with (if `stats`) max(d / d~) and, under weight decay, ||u0|| and ||u||
        (1-element tensors) of this rank's elements."""
        m, v, vf = self.fs.buffers["exp_avg"], self.fs.buffers["exp_avg_sq"], self.fs.buffers["exp_avg_sq_fresh"]
        stage, u_buf = self.stage.stage_buffer(L), self.update_buffer(L)
        group = self.fs.param_groups[seg.group]
        bc1, bc2 = self.fs.bias_corrections(group, seg)
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


    def track_local_momentum(self, L: FlatLayout, segs) -> None:
        """exp_avg_local <- b1 exp_avg_local + (1 - b1) g, this rank's own gradients."""
        ml = self.fs.buffers["exp_avg_local"]
        for seg in segs:
            w = 1 - self.fs.param_groups[seg.group]["betas"][0]
            for i in seg.idx:
                g = L.grad(i)
                view = ml[L.offsets[i]:L.offsets[i] + L.numels[i]]
                view.lerp_(torch.zeros_like(view) if g is None else g.reshape(-1).float(), w)

    def estimate_slots(self, L: FlatLayout) -> Optional[Tensor]:
        """Per parameter whose live ratio takes the estimated norm: its norm_samples (a long
        tensor in layout order, 0 for the others); None when no parameter does. Nothing
        to estimate where nothing is compressed: with one rank, and for the parameters
        averaged exactly (exact_numel), the decoded momentum is the clean one."""
        if self.stage.reducer is None:
            return None
        part = self.stage.exact.part(L)
        exact = set() if part is None else {i for i, _ in part[1]}
        k = [samples(self.fs.param_groups[L.group_of[i]]) if on and i not in exact else 0
             for i, on in enumerate(self.stage.participating(L))]
        return torch.tensor(k) if any(k) else None

    def clean_norm_parts(self, L: FlatLayout, segs, bounds: List[Optional[float]]):
        """Per parameter (fp64, this rank's shard), an estimate of ||u*||^2 where u* is the
        direction an uncompressed allreduce would give: u* = clamp(m* / d, -U, U) + wd theta
        with m* the mean over the ranks of exp_avg_local; and the set of the parameters
        estimated (`estimate_slots`). (None, empty) when no parameter needs it.

        The ranks' mean of clamp(m_r / d) is projected on the decoded direction u0 where u0
        is neither clamped nor masked (one scalar per parameter); where it is, the compression
        error is largest and not independent of u0, so norm_samples of those coordinates (the
        same ones on every rank) are averaged exactly, clamped, and their squares scaled up
        to all of them. One fp64 allreduce of (samples + 1) per parameter; one pass over each
        parameter, STAGE elements at a time (nothing model-sized is allocated)."""
        slots = self.estimate_slots(L)
        if slots is None:
            return None, set()
        dev = self.fs.device_of(L)
        rows = [i for i in range(len(L.params)) if slots[i] > 0]
        row_of = {i: r for r, i in enumerate(rows)}
        sent = torch.zeros(len(rows), 1 + int(slots.max()), dtype=torch.float64, device=dev)
        out = torch.zeros(len(L.params), dtype=torch.float64, device=dev)
        number = self.fs.param_indices()  # torch's numbering: the same on every shard
        picked: List[Tuple[int, int, int]] = []
        for seg in segs:
            group = self.fs.param_groups[seg.group]
            if not samples(group):
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
                        gen = torch.Generator().manual_seed(1009 * (self.fs.global_step + 1) + number[id(L.params[i])])
                        draws = torch.randint(n_edge, (k,), generator=gen).to(dev)
                    else:
                        draws = torch.arange(n_edge, device=dev)
                    self._sample(L, seg, i, bounds[i], edges, draws, sent[r, 1:1 + k])
                picked.append((i, k, n_edge))
        self.fs.transport.all_reduce(sent, op="sum")
        sent.div_(self.fs.transport.world_size)
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
        m, v = self.fs.buffers["exp_avg"], self.fs.buffers["exp_avg_sq"]
        group = self.fs.param_groups[seg.group]
        bc1, bc2 = self.fs.bias_corrections(group, seg)
        o = L.offsets[i]
        stage, u_buf = self.stage.stage_buffer(L), self.update_buffer(L)
        d = F.denominator(v[o + lo:o + hi], bc2, group["eps"], out=stage[:hi - lo])
        u0 = torch.div(m[o + lo:o + hi], bc1, out=u_buf[:hi - lo]).div_(d)
        if bound is not None:
            u0.clamp_(-bound, bound)
            edge = torch.abs(u0) >= bound * AT_BOUND
        else:
            edge = torch.zeros(hi - lo, dtype=torch.bool, device=u0.device)
        self.stage.masks.mark(edge, o + lo, o + hi)
        return d, u0, edge

    def _projection(self, L: FlatLayout, seg: Segment, i: int, bound: Optional[float], proj: Tensor,
                    decay: Tensor) -> list:
        """The pass over parameter i: proj = sum over the non-edge coordinates of
        clamp(m_local^ / d) u0 (this rank's), decay = the weight decay's part of ||u*||^2
        (2 wd <u0, theta> + wd^2 ||theta||^2, with the decoded u0). Returns each STAGE
        range's edge: its positions (a tensor) while they take at most STAGE elements in
        all, its count (an int) after that."""
        group = self.fs.param_groups[seg.group]
        bc1, wd = self.fs.bias_corrections(group, seg)[0], group["weight_decay"]
        ml, o, n = self.fs.buffers["exp_avg_local"], L.offsets[i], L.numels[i]
        theta = L.tensor(i).reshape(-1)
        y_buf = torch.empty(min(n, F.STAGE), dtype=torch.float32, device=self.fs.device_of(L))
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
        group = self.fs.param_groups[seg.group]
        bc1, bc2 = self.fs.bias_corrections(group, seg)
        ml, v, o = self.fs.buffers["exp_avg_local"], self.fs.buffers["exp_avg_sq"], L.offsets[i]
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


    def update_buffer(self, L: FlatLayout) -> Tensor:
        """One parameter's update direction (the largest parameter's size): its norms need
        the whole of it."""
        if self.scratch_u is None:
            self.scratch_u = torch.empty(max(L.numels, default=0), dtype=torch.float32, device=self.fs.device_of(L))
        return self.scratch_u
