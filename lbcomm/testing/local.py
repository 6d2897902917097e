"""Plain-torch reference of `lbcomm.OneBitLocalUpdates` (local updates, DiLoCo-style, with
1-bit compressed outer pseudo-gradients), all ranks simulated in one process; the oracle
the tests compare the distributed implementation against, bit for bit.

Written from the algorithm (docs/local-updates.md), not from the implementation: the ranks'
inner steps are the caller's `local_step`; every H inner steps (each fragment at its own
phase) the per-rank pseudo-gradients Δ_r = θ_start − θ_r are averaged exactly in fp32, or,
compressed, each rank's outer momentum u_r = β buf + Δ_r goes through the reference
compressed allreduce (`lbcomm.testing.kernels`, flat or hierarchical, error feedback per rank kept
across rounds) and mean(u) − β buf is the mean Δ; Nesterov SGD steps θ_start with it,
spelled out as torch.optim.SGD computes it; every rank then holds the new θ_start.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .compressors import _compressor, _mean

__all__ = ["simulate_local_updates"]


def _bounds(numels: Sequence[int], k: int) -> List[int]:
    """Runs of whole parameters of about total / k elements each (a run closes at the first
    parameter where the running total reaches its share, or when the parameters left are
    just enough for the runs left)."""
    total, out, run = sum(numels), [0], 0
    for i in range(len(numels) - 1):
        run += numels[i]
        if len(out) < k and (run * k >= len(out) * total or len(numels) - i - 1 == k - len(out)):
            out.append(i + 1)
    return out + [len(numels)]


def simulate_local_updates(params0: Sequence[Tensor], local_step: Callable[[int, int, List[Tensor]], None], *,
                           world_size: int, steps: int, sync_every: int, outer_lr: float = 0.7,
                           outer_momentum: float = 0.9, nesterov: bool = True, compress: bool = True,
                           fragments: int = 1, block_size: Optional[int] = 2048, exact_numel: int = 4096,
                           nodes: Optional[int] = None, overlap: int = 0) -> Dict[int, List[List[Tensor]]]:
    """Run `steps` inner steps on `world_size` simulated ranks.

    local_step(rank, t, params): inner step t (1-based) of `rank`, in place on its list of
    parameters (fp32). nodes: the compressed mean is the hierarchical one on that many
    nodes (ranks node by node; None: flat). overlap: a fragment's new θ_start, computed
    from the ranks' θ at inner step t, reaches them after inner step t + overlap, each
    keeping its progress since t (θ_r += θ_start_new − θ_r(t)). Returns {t: [every rank's
    parameters after inner step t and its synchronization]}.
    """
    p, H = world_size, sync_every
    theta = [[t.detach().float().clone() for t in params0] for _ in range(p)]
    b = _bounds([t.numel() for t in params0], fragments)
    frags = []
    for f in range(fragments):
        like = list(params0[b[f]:b[f + 1]])
        anchor = torch.cat([t.detach().float().reshape(-1) for t in like])
        comp = _compressor(like, p, nodes, block_size, exact_numel=exact_numel) if compress else None
        frags.append({"lo": b[f], "hi": b[f + 1], "phase": -(-(f + 1) * H // fragments) % H, "anchor": anchor,
                      "buf": None, "comp": comp})
    history = {}
    for t in range(1, steps + 1):
        for r in range(p):
            local_step(r, t, theta[r])
        for fr in frags:  # overlap: the synchronizations started `overlap` steps ago arrive
            if fr.get("due") == t:
                _arrive(fr, theta)
        for fr in frags:
            if t % H != fr["phase"]:
                continue
            lo, hi, anchor = fr["lo"], fr["hi"], fr["anchor"]
            thetas = [torch.cat([x.reshape(-1) for x in theta[r][lo:hi]]) for r in range(p)]
            deltas = [anchor - th for th in thetas]
            if not compress:
                g = _mean(deltas)
            else:
                # compressed: each rank's outer momentum u_r = β buf + Δ_r; g = mean(u) − β buf
                buf = fr["buf"] if outer_momentum else None
                us = deltas if buf is None else [d.add(buf, alpha=outer_momentum) for d in deltas]
                if p == 1:
                    g = us[0].clone()
                else:
                    exact_mean = None  # what the exact coordinates get, in the reduction's order
                    if exact_numel:
                        exact_mean = _mean(us) if nodes in (None, 1, p) else _node_mean(us, nodes)
                    g = fr["comp"](us, exact_mean)
                if buf is not None:
                    g = g.sub(buf, alpha=outer_momentum)
            if outer_momentum:
                fr["buf"] = g.clone() if fr["buf"] is None else fr["buf"].mul(outer_momentum).add(g)
                g = g.add(fr["buf"], alpha=outer_momentum) if nesterov else fr["buf"]
            anchor.add_(g, alpha=-outer_lr)
            if overlap:
                fr["due"], fr["sent"] = t + overlap, thetas
                continue
            for r in range(p):
                o = 0
                for x in theta[r][lo:hi]:
                    x.copy_(anchor[o:o + x.numel()].view_as(x))
                    o += x.numel()
        history[t] = [[x.clone() for x in theta[r]] for r in range(p)]
    return history


def _arrive(fr: Dict, theta: List[List[Tensor]]) -> None:
    """An overlapped synchronization reaches every rank: θ_r += θ_start_new − θ_r(sent)."""
    for r, sent in enumerate(fr["sent"]):
        step = fr["anchor"] - sent
        o = 0
        for x in theta[r][fr["lo"]:fr["hi"]]:
            x.add_(step[o:o + x.numel()].view_as(x))
            o += x.numel()
    fr["due"] = fr["sent"] = None



def _node_mean(xs: List[Tensor], nodes: int) -> Tensor:
    """The exact mean in the hierarchical shape: each node's sum in local-rank order, the
    nodes' sums added in node order, divided by the number of ranks."""
    G = len(xs) // nodes
    sums = []
    for a in range(nodes):
        acc = xs[a * G].clone()
        for j in range(1, G):
            acc.add_(xs[a * G + j])
        sums.append(acc)
    total = sums[0].clone()
    for s in sums[1:]:
        total.add_(s)
    return total.div_(len(xs))
