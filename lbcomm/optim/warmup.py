"""The warmup's gradient averaging over the optimizer's `FlatState`: every local gradient
copied into the flat fp32 buffer ``fs.grad_buf`` (zeros where a parameter has none) with a
per-parameter "has a gradient" flag after it, then averaged over the ranks through the
transport (one ``all_reduce`` per bucket of ``comm.bucket_cap_mb``). The values of the
flat state's ``local_stat`` (rescale_variance's statistic) and, while undecided, the
averaged-gradients probe's checksums (`agree.replica_slots`) ride in the same allreduce.
`BaseOptimizer` then applies its non-finite policy and its own update (`_warmup_update`)."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from . import agree
from .flat import FlatLayout

__all__ = ["collect_grads", "average_grads"]


def collect_grads(fs, L: FlatLayout, averaged: bool) -> Tensor:
    """Copy every gradient into ``fs.grad_buf`` and set the has-grad flags after it; returns
    that part of the buffer (which holds ``fs.local_slots`` more slots, filled unless the
    gradients arrived `averaged`, and 2 x world_size for `agree.replica_slots`)."""
    n, k = len(L.params), fs.local_slots(L)
    size = L.total + n + k + (2 * fs.transport.world_size if fs.detecting() else 0)
    if fs.grad_buf is None or fs.grad_buf.numel() != size:
        fs.grad_buf = torch.empty(size, dtype=torch.float32, device=fs.device_of(L))
    buf = fs.grad_buf[:L.total + n]
    flags = []
    for i in range(n):
        view = L.view(buf, i)
        g = L.grad(i)
        if g is None:
            view.zero_()
            flags.append(0.0)
        else:
            if g.is_sparse:
                raise RuntimeError(f"{fs.name} does not support sparse gradients")
            view.copy_(g)
            flags.append(1.0)
    if flags:
        buf[L.total:].copy_(torch.tensor(flags, dtype=torch.float32))
    if k and not averaged:
        fs.fill_local_slots(L, buf, fs.grad_buf[L.total + n:L.total + n + k])
    return buf


def average_grads(fs, L: FlatLayout, averaged: bool, frozen: bool,
                  check: Optional[Callable[[Tensor, str], bool]] = None) -> Tuple[Tensor, Optional[bool]]:
    """`collect_grads`, then (several ranks, gradients not `averaged` already) the bucketed
    mean over the ranks, the probe's slots riding along when `check` is given and the
    optimizer detects (`check(slots, "warmup")`: the optimizer's verdict on them, True when
    decided); the local slots are handed back (`frozen`: a variance step after the freeze).
    Returns (the averaged gradients and flags, the probe's verdict or None when not probed)."""
    buf = collect_grads(fs, L, averaged)
    tr = fs.transport
    k = fs.local_slots(L)
    decided = None
    if tr.world_size > 1 and not averaged:
        probe = check is not None and fs.detecting()
        width = buf.numel() + k
        if probe:  # the checksum slots ride along (undecided steps only)
            fs.grad_buf[width:].copy_(agree.replica_slots([buf[:L.total]], tr.rank, tr.world_size, buf.device))
            width = fs.grad_buf.numel()
        # sum in buckets, all in flight at once, then divide by the world size
        tr.all_reduce(fs.grad_buf[:width], op="mean", bucket_bytes=max(1, int(fs.comm.bucket_cap_mb * 2**20)))
        if probe:
            decided = check(fs.grad_buf[buf.numel() + k:], "warmup")
    if k:
        fs.reduced_local_slots(L, fs.grad_buf[buf.numel():buf.numel() + k], averaged=averaged and not frozen)
    return buf, decided
