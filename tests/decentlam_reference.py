"""Plain-torch simulation of DecentLaM and DmSGD on n ranks in one process: every rank's
flat model as one tensor, the topology as a dense mixing matrix W (test oracle of
lbcomm.DecentLaM / lbcomm.DmSGD, written from the equations, not from lbcomm's code).

Row i of W is applied as w_ii y_i + sum_{j != i, ascending} w_ij y_j, one fp32 operation
per term, so the simulation reproduces the real ranks bit for bit. Compression: the 1-bit
sign + block-RMS message of lbcomm.reference, with one estimate per (sender, channel)
that both ends of a link share.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import Tensor

from lbcomm.testing import kernels as R


def mixing_matrix(topology: str, n: int, step: int) -> Tensor:
    """W (float64 [n, n]) at `step`: ring, W = (I + S + S^-1) / 3; exponential,
    W = (I + S^(2^t)) / 2 with t = step mod ceil(log2 n), row i reading rank i + 2^t."""
    W = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        if topology == "ring":
            for j in (i, (i - 1) % n, (i + 1) % n):
                W[i, j] += 1 / 3
        elif topology == "exponential":
            tau = math.ceil(math.log2(n))
            W[i, i] = 0.5
            W[i, (i + 2 ** (step % tau)) % n] = 0.5
        else:
            raise ValueError(topology)
    return W


def mix_row(W: Tensor, ys: Sequence[Tensor], i: int) -> Tensor:
    z = ys[i] * float(W[i, i])
    for j in range(W.shape[0]):
        if j != i and W[i, j] != 0:
            z.add_(ys[j], alpha=float(W[i, j]))
    return z


def _channel(topology: str, n: int, step: int) -> int:
    return 0 if topology == "ring" else 2 ** (step % math.ceil(math.log2(n)))


def _compress_decode(v: Tensor, block_size: Optional[int]) -> Tensor:
    n = v.numel()
    m = -(-n // 32) * 32
    packed, scales, _ = R.worker_compress(v, torch.zeros(m), block_size)
    return R.unpack(packed, scales, n, block_size)


def mix_compressed(W: Tensor, ys: Sequence[Tensor], est: dict, ch: int, block_size: Optional[int],
                   c: float = 0.5) -> List[Tensor]:
    """Every rank's z_i = y_i + c (sum_j w_ij x^_(j,ch) - (1 - w_ii) x^_(i,ch)), after each
    sender's estimate took its message x^ += C(y - x^)."""
    n = len(ys)
    for i in range(n):
        e = est.setdefault((i, ch), torch.zeros_like(ys[i]))
        e.add_(_compress_decode(ys[i] - e, block_size))
    out = []
    for i in range(n):
        z = ys[i].clone()
        for j in range(n):
            if j != i and W[i, j] != 0:
                z.add_(est[(j, ch)], alpha=c * float(W[i, j]))
        z.add_(est[(i, ch)], alpha=-c * (1 - float(W[i, i])))
        out.append(z)
    return out


def simulate(algorithm: str, topology: str, x0: Sequence[Tensor],
             grads: Union[Sequence[Sequence[Tensor]], Callable[[int, int, Tensor], Tensor]],
             lr: Union[float, Sequence[float]], momentum: float, weight_decay: float = 0.0, steps: int = None,
             compress: bool = False, block_size: Optional[int] = 2048, consensus_step: float = 0.5
             ) -> List[List[Tensor]]:
    """Every rank's flat model after each step. grads: recorded [step][rank] flat gradients
    (taken at the models this simulation produces) or a function (rank, step, x) -> g."""
    n = len(x0)
    xs = [x.clone().float() for x in x0]
    ms = [torch.zeros_like(x) for x in xs]
    est: dict = {}
    steps = len(grads) if steps is None else steps
    history = []
    for k in range(steps):
        gamma = lr if isinstance(lr, (int, float)) else lr[k]
        W = mixing_matrix(topology, n, k)
        gs = [(grads(i, k, xs[i]) if callable(grads) else grads[k][i]).clone().float() for i in range(n)]
        if weight_decay:
            for i in range(n):
                gs[i].add_(xs[i], alpha=weight_decay)
        if algorithm == "dmsgd":
            ys = []
            for i in range(n):
                ms[i].mul_(momentum).add_(gs[i])
                ys.append(torch.add(xs[i], ms[i], alpha=-gamma))
        else:
            ys = [torch.add(xs[i], gs[i], alpha=-gamma) for i in range(n)]
        if compress:
            zs = mix_compressed(W, ys, est, _channel(topology, n, k), block_size, consensus_step)
        else:
            zs = [mix_row(W, ys, i) for i in range(n)]
        if algorithm == "dmsgd":
            xs = zs
        else:
            for i in range(n):
                gt = torch.sub(xs[i], zs[i]).div_(gamma)  # the gradient-like quantity
                ms[i].mul_(momentum).add_(gt)
                xs[i] = torch.add(xs[i], ms[i], alpha=-gamma)
        history.append([x.clone() for x in xs])
    return history
