"""Soak: many compressed allreduce calls; outputs must stay bitwise identical across ranks
and the error norms bounded (error feedback must not drift or blow up).

`soak_rank` runs inside an initialized process group; the short test and bench/soak.py
(10,000 steps) both use it.
"""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from ..compressed import CompressionState, compressed_allreduce


def soak_rank(rank: int, steps: int, numel: int, block_size=256) -> Dict[str, object]:
    """Returns a per-step fingerprint of the output (identical across ranks iff the
    outputs are) and the per-step (worker, server) error norms of this rank."""
    state = CompressionState(numel, block_size=block_size)
    weights = torch.arange(1, numel + 1, dtype=torch.float64)
    digest = torch.zeros(steps, dtype=torch.float64)
    norms: List[tuple] = []
    out = torch.empty(numel)
    for t in range(steps):
        g = torch.Generator().manual_seed(7919 * t + rank)
        # magnitudes that vary over time and across ranks, like gradients over training
        x = torch.randn(numel, generator=g) * (1 + (t % 7)) * (1 + rank)
        compressed_allreduce(x, state, out=out)
        digest[t] = (out.double() * weights).sum()  # order-sensitive: any differing bit shows
        norms.append((state.worker_error.norm().item(), state.server_error.norm().item()))
    return {"digest": digest, "norms": norms}


def check(results: List[Dict[str, object]], window: int) -> Dict[str, float]:
    """Raises AssertionError if ranks diverged or errors grew; returns summary figures."""
    first = results[0]["digest"]
    for r, res in enumerate(results[1:], 1):
        diff = (res["digest"] != first).nonzero()
        assert diff.numel() == 0, f"rank {r} output differs from rank 0 first at step {int(diff[0])}"
    early = max(max(w, s) for res in results for w, s in res["norms"][:window])
    late = max(max(w, s) for res in results for w, s in res["norms"][-window:])
    assert all(math.isfinite(w) and math.isfinite(s) for res in results for w, s in res["norms"])
    assert late < 3 * early, f"error norms grew from {early:.3g} to {late:.3g}"
    return {"steps": len(first), "max_error_norm_early": early, "max_error_norm_late": late}
