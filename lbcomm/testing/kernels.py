"""The compressed allreduce of p ranks simulated in one process, flat and hierarchical: the
oracle the tests compare lbcomm.compressed_allreduce, the hooks and the optimizers against.

The per-rank stages are the plain-torch kernels of `lbcomm.reference` (the library's fallback
when the C++ extension is missing), re-exported here with the layout arithmetic so that a
test imports one module: `from lbcomm.testing import kernels as R`.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..reference import (ALIGN, CAP_ERROR_RATIO, chunk_size, num_blocks, pack_signs, server_compress, unpack,
                         unpack_signs, worker_compress)
from ..reference import _expand  # noqa: F401  (block scales to coordinates, for the tests)
from .. import reference as _reference

__all__ = [*_reference.__all__, "compressed_allreduce", "hierarchical_allreduce"]


def compressed_allreduce(
    xs: Sequence[Tensor],
    worker_errors: Sequence[Tensor],
    server_errors: Sequence[Tensor],
    block_size: Optional[int],
    weights: Optional[Tensor] = None,
    cap: Optional[Tensor] = None,
) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
    """The whole algorithm for p simulated ranks in one process.

    xs: p tensors of n0 elements; worker_errors: p tensors [p, m]; server_errors: p
    tensors [m]; weights (n0 fp32 or bf16, the same on every rank, optional): every rank
    compresses x / weights and the decoded mean is multiplied by weights; cap (n0 fp32, the
    same on every rank, optional): the capped decode on both stages.
    Returns (out [n0] fp32, new worker errors, new server errors).
    World size 1 returns x unchanged (no compression, weights unused), errors untouched.
    """
    p = len(xs)
    n0 = xs[0].numel()
    if p == 1:
        return xs[0].reshape(-1).to(torch.float32).clone(), list(worker_errors), list(server_errors)
    m = server_errors[0].numel()
    worker = [worker_compress(x, e.reshape(p, m), block_size, weights, cap) for x, e in zip(xs, worker_errors)]
    new_worker = [w[2].reshape(worker_errors[r].shape) for r, w in enumerate(worker)]
    packed_out, scales_out, new_server = [], [], []
    for k in range(p):
        real_k = min(max(n0 - k * m, 0), m)
        sp, ss, se = server_compress(
            torch.stack([w[0][k] for w in worker]),
            torch.stack([w[1][k] for w in worker]),
            server_errors[k],
            block_size,
            real_k,
            None if cap is None else cap.reshape(-1)[k * m:k * m + real_k],
        )
        packed_out.append(sp)
        scales_out.append(ss)
        new_server.append(se)
    out = unpack(torch.stack(packed_out), torch.stack(scales_out), n0, block_size, weights, cap)
    return out, new_worker, new_server


def hierarchical_allreduce(
    xs: Sequence[Sequence[Tensor]],
    worker_errors: Sequence[Sequence[Tensor]],
    server_errors: Sequence[Sequence[Tensor]],
    block_size: Optional[int],
    cap: Optional[Tensor] = None,
) -> Tuple[Tensor, List[List[Tensor]], List[List[Tensor]]]:
    """The hierarchical call (lbcomm.topology) for N nodes x G ranks (N, G > 1) simulated
    in one process: the mean of each slice inside each node, then the flat algorithm above
    on every slice across the nodes.

    xs[a][l]: the input of local rank l on node a (n0 elements). worker_errors[l][a] and
    server_errors[l][a]: the errors of rank (a, l), i.e. of node a in cross group l (for a
    slice of L_l elements: [N, chunk_size(L_l, N)] and [chunk_size(L_l, N)]). Slice l is
    [l L, (l + 1) L) cut to n0, L = chunk_size(n0, G). The intra-node mean is
    (x_0 + x_1 + ... + x_{G-1}) / G in fp32, added in local rank order. cap (n0 fp32,
    optional): the capped decode, each slice with its part of the caps.
    Returns (out [n0] fp32, new worker errors, new server errors), indexed like the inputs.
    """
    N, G = len(xs), len(xs[0])
    n0 = xs[0][0].numel()
    L = chunk_size(n0, G)
    out = torch.zeros(n0, dtype=torch.float32, device=xs[0][0].device)
    new_worker: List[List[Tensor]] = []
    new_server: List[List[Tensor]] = []
    for l in range(G):
        lo, hi = min(l * L, n0), min((l + 1) * L, n0)
        if hi == lo:
            new_worker.append(list(worker_errors[l]))
            new_server.append(list(server_errors[l]))
            continue
        ys = []
        for a in range(N):
            acc = xs[a][0].reshape(-1)[lo:hi].to(torch.float32)
            for j in range(1, G):
                acc = acc + xs[a][j].reshape(-1)[lo:hi].to(torch.float32)
            ys.append(acc / G)
        piece, we, se = compressed_allreduce(ys, worker_errors[l], server_errors[l], block_size,
                                             cap=None if cap is None else cap.reshape(-1)[lo:hi])
        out[lo:hi] = piece
        new_worker.append(we)
        new_server.append(se)
    return out, new_worker, new_server
