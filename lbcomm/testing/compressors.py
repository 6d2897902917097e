"""The parts the optimizer simulations share (lbcomm.testing.optim, .zeroone, .local): the
error-feedback state of p simulated ranks for a flat momentum, flat (`_Compressor`),
hierarchical (`_HierCompressor`) or per FSDP shard (`_ShardCompressor`), all through the
whole-algorithm simulations of `lbcomm.testing.kernels`; and the formulas they have in
common (the Adam denominator, the update bounds and the capped decode's caps)."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from . import kernels as R

__all__ = ["decode_caps"]


def _mean(per_rank: Sequence[Tensor]) -> Tensor:
    return torch.stack(list(per_rank)).sum(0) / len(per_rank)


class _Compressor:
    """Error-feedback state of all p ranks for one flat momentum of n elements."""

    def __init__(self, n: int, p: int, block_size: Optional[int], exact: Optional[Tensor] = None):
        m = R.chunk_size(n, p)
        self.p, self.block_size, self.m = p, block_size, m
        self.worker = [torch.zeros(p, m) for _ in range(p)]
        self.server = [torch.zeros(m) for _ in range(p)]
        # exact_numel: these coordinates get the exact mean, their errors are held at zero
        self.exact = exact.nonzero().view(-1) if exact is not None and bool(exact.any()) else None

    def __call__(self, xs: List[Tensor], exact_values: Optional[Tensor] = None, cap: Optional[Tensor] = None) -> Tensor:
        """exact_values: the new momentum from the exactly averaged gradients (what the
        exact coordinates get); cap: the capped decode's per-coordinate bounds."""
        if self.p == 1:
            return xs[0].clone()
        out, self.worker, self.server = R.compressed_allreduce(xs, self.worker, self.server, self.block_size,
                                                               cap=cap)
        if self.exact is not None:
            e = self.exact
            out[e] = exact_values[e]
            for r in range(self.p):
                self.worker[r].view(-1)[e] = 0.0
                self.server[r][e[(e >= r * self.m) & (e < (r + 1) * self.m)] - r * self.m] = 0.0
        return out


class _HierCompressor:
    """Error-feedback state of N nodes x G ranks for the hierarchical call (lbcomm.topology):
    rank r = a G + l is local rank l of node a."""

    def __init__(self, n: int, p: int, nodes: int, block_size: Optional[int], exact: Optional[Tensor] = None):
        if p % nodes:
            raise ValueError(f"{nodes} nodes do not divide {p} ranks")
        self.N, self.G, self.block_size = nodes, p // nodes, block_size
        self.L = L = R.chunk_size(n, self.G)
        self.worker, self.server, self.chunk = [], [], []
        for l in range(self.G):
            real = max(0, min((l + 1) * L, n) - min(l * L, n))
            m = R.chunk_size(real, self.N) if real else 0
            self.chunk.append(m)
            self.worker.append([torch.zeros(self.N, m) for _ in range(self.N)])
            self.server.append([torch.zeros(m) for _ in range(self.N)])
        self.exact = exact.nonzero().view(-1) if exact is not None and bool(exact.any()) else None

    def __call__(self, xs: List[Tensor], exact_values: Optional[Tensor] = None, cap: Optional[Tensor] = None) -> Tensor:
        per_node = [xs[a * self.G:(a + 1) * self.G] for a in range(self.N)]
        out, self.worker, self.server = R.hierarchical_allreduce(per_node, self.worker, self.server, self.block_size,
                                                                 cap)
        if self.exact is not None:  # slice l = e // L, chunk c of it served by node c
            out[self.exact] = exact_values[self.exact]
            for e in self.exact.tolist():
                l, o = divmod(e, self.L)
                c, oc = divmod(o, self.chunk[l])
                for a in range(self.N):
                    self.worker[l][a].view(-1)[o] = 0.0
                self.server[l][c][oc] = 0.0
        return out


class _ShardCompressor:
    """FSDP2 sharding inside the node (lbcomm.fsdp.onebit_optimizer): every parameter is cut
    into `shards` pieces along dim 0 (torch.chunk, as FSDP2 does); the pieces of shard l of
    all parameters, in order, form one flat momentum compressed across the p ranks (the
    nodes) with its own error feedback, independently of the other shards. exact_numel
    counts whole parameters."""

    def __init__(self, like: Sequence[Tensor], p: int, shards: int, block_size: Optional[int],
                 exact_numel: int = 0):
        self.like, self.shards = list(like), shards
        self.pieces = [[t.chunk(shards)[l] if t.dim() else t for t in like] for l in range(shards)]
        self.comps = [_Compressor(sum(t.numel() for t in pieces), p, block_size,
                                  _exact_mask(like, exact_numel, pieces)) for pieces in self.pieces]

    def __call__(self, xs: List[Tensor], exact_values: Optional[Tensor] = None, cap: Optional[Tensor] = None) -> Tensor:
        per_rank = [_split(x, self.like) for x in xs]
        ex = None if exact_values is None else _split(exact_values, self.like)
        caps = None if cap is None else _split(cap, self.like)
        out_shards = []
        for l, comp in enumerate(self.comps):
            flat = [_cat([t.chunk(self.shards)[l] for t in params]) for params in per_rank]
            ex_l = None if ex is None else _cat([t.chunk(self.shards)[l] for t in ex])
            cap_l = None if caps is None else _cat([t.chunk(self.shards)[l] for t in caps])
            out_shards.append(_split(comp(flat, ex_l, cap_l), self.pieces[l]))
        return _cat([torch.cat([out_shards[l][i] for l in range(self.shards)]) for i in range(len(self.like))])


def _exact_mask(like: Sequence[Tensor], exact_numel: int, pieces: Optional[Sequence[Tensor]] = None):
    """True on the coordinates of the parameters of at most exact_numel elements (of their
    `pieces`, when sharded); None for exact_numel 0."""
    if not exact_numel:
        return None
    return _cat([torch.full((q.numel(),), 0 < t.numel() <= exact_numel)
                 for t, q in zip(like, like if pieces is None else pieces)])


def _compressor(like: Sequence[Tensor], p: int, nodes: Optional[int], block_size: Optional[int],
                shards: Optional[int] = None, exact_numel: int = 0):
    """The flat call over p ranks, the hierarchical one on `nodes` nodes of p / nodes ranks,
    or one flat call per FSDP shard (`shards`); exact_numel: the parameters of at most that
    many elements averaged exactly."""
    n = sum(t.numel() for t in like)
    if shards is not None and shards > 1:
        return _ShardCompressor(like, p, shards, block_size, exact_numel)
    if nodes is None or nodes == 1 or nodes == p:
        return _Compressor(n, p, block_size, _exact_mask(like, exact_numel))
    return _HierCompressor(n, p, nodes, block_size, _exact_mask(like, exact_numel))


def _split(flat: Tensor, like: Sequence[Tensor]) -> List[Tensor]:
    out, o = [], 0
    for t in like:
        out.append(flat[o:o + t.numel()].view(t.shape).clone())
        o += t.numel()
    return out


def _cat(ts: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _keep(v: Sequence[Tensor], mask_threshold: float) -> List[Tensor]:
    """The automatic mask at the freeze: False where the variance is at most
    mask_threshold times the mean variance of all coordinates (always where it is 0)."""
    thr = mask_threshold * float(_cat(v).mean())
    return [vi > thr for vi in v]


def _f32(xs: Sequence[float]) -> List[float]:
    """Python floats rounded to fp32 (the optimizers' per-parameter vectors)."""
    return torch.tensor(list(xs), dtype=torch.float32).tolist()


def _denom(v: Tensor, bc2: float, eps: float, frozen: bool = False) -> Tensor:
    """sqrt(v^) + eps: torch's root as AdamW's (the warmup), or with frozen the correctly
    rounded root (fp64, rounded once) of the compression stage's steps."""
    root = torch.sqrt(v.double()).float() if frozen else v.sqrt()
    return (root / bc2 ** 0.5).add_(eps)


def decode_caps(v: Sequence[Tensor], bounds: Sequence[Optional[float]], bc1: float, bc2s: Sequence[float],
                eps: float) -> Optional[Tensor]:
    """The capped decode's bounds on the reduced momentum: per coordinate of parameter i,
    U_i bc1 (sqrt(v^_i) + eps) (its step is exactly max_update's bound; bc2s: v's bias
    correction per parameter, rescale folded in), +inf without a bound; None when no
    parameter is bounded."""
    if all(b is None for b in bounds):
        return None
    out = []
    for vi, b, c in zip(v, bounds, bc2s):
        if b is None:
            out.append(torch.full_like(vi, math.inf))
        else:  # a sqrt(v) + b, a = U bc1 / sqrt(bc2), b = U bc1 eps, each op rounded, the root
            # correctly rounded (the fp64 root rounded to fp32), as the optimizers compute them
            out.append(torch.sqrt(vi.double()).float().mul_(b * bc1 / c ** 0.5).add_(b * bc1 * eps))
    return _cat(out)


def _bounds(max_update, betas, m, v, bc1: float, bc2: float, eps: float) -> List[Optional[float]]:
    """max_update's bound U on |m^ / (sqrt(v^) + eps)| per parameter, taken at the freeze:
    a number, "auto" (Adam's largest possible |m^ / sqrt(v^)|), "warmup" (the parameter's
    largest |m^ / (sqrt(v^) + eps)| after the last warmup step, kept in fp32) or None."""
    if max_update is None:
        return [None] * len(m)
    if max_update == "warmup":
        return [float(((mi / bc1) / _denom(vi, bc2, eps)).abs().max()) for mi, vi in zip(m, v)]
    if max_update == "auto":
        b1, b2 = betas
        return [(1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))] * len(m)
    return [float(max_update)] * len(m)
