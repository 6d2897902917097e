"""The communication side of bench/robust_sim.py: p simulated ranks in one process.

A vectorized error-feedback compressed allreduce of p ranks (the algorithm of
lbcomm/compressed.py, with the study's scale rules, block sizes and exactly averaged
parameters; `check_against_reference` holds it to lbcomm.testing.kernels), the model's
parameters as one flat vector, and every rank's local gradient on its share of a step's
global batch.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lbcomm.reference import chunk_size


# ---------------------------------------------------------------------- compressed allreduce
def _scales(y: Tensor, real: Tensor, block: Optional[int], rule: str) -> Tensor:
    """Per-element scale of y [rows, m] (real: bool mask of real elements), per block or whole row."""
    rows, m = y.shape
    mag = y * y if rule == "rms" else y.abs()
    mag = torch.where(real, mag, 0.0).double()
    cnt = real.double()
    if block is None:
        s, c = mag.sum(1, keepdim=True), cnt.sum(1, keepdim=True)
        val = s / c.clamp(min=1)
        val = (val.sqrt() if rule == "rms" else val).float()
        return val.expand(rows, m).contiguous()
    nb = (m + block - 1) // block
    pad = nb * block - m
    s = torch.nn.functional.pad(mag, (0, pad)).view(rows, nb, block).sum(-1)
    c = torch.nn.functional.pad(cnt, (0, pad)).view(rows, nb, block).sum(-1)
    val = s / c.clamp(min=1)
    val = (val.sqrt() if rule == "rms" else val).float()
    return val.repeat_interleave(block, dim=1)[:, :m]


def _code(y: Tensor, scale: Tensor) -> Tensor:
    return torch.where(torch.signbit(y), -scale, scale)


class Compressor:
    """Error-feedback state of p simulated ranks for one flat tensor of n elements."""

    def __init__(self, n: int, p: int, block: Optional[int], scale_rule: str = "rms"):
        self.n, self.p, self.block, self.rule = n, p, block, scale_rule
        self.m = chunk_size(n, p)
        self.worker = torch.zeros(p, p * self.m)
        self.server = torch.zeros(p, self.m)
        self.real = (torch.arange(p * self.m) < n)
        self.exact: Optional[Tensor] = None  # bool [n]: averaged exactly, zero error (CommConfig.exact_numel)

    def __call__(self, xs: Tensor) -> Tensor:
        """xs [p, n] -> approximate mean [n]."""
        p, m, n = self.p, self.m, self.n
        y = torch.zeros(p, p * m)
        y[:, :n] = xs
        y = torch.where(self.real, y + self.worker, 0.0)
        # worker: one scale set per (rank, chunk); block None: one scale per rank over all chunks
        if self.block is None:
            sc = _scales(y, self.real.expand(p, -1), None, self.rule)
        else:
            sc = _scales(y.view(p * p, m), self.real.view(p, m).repeat(p, 1), self.block, self.rule).reshape(p, p * m)
        dec = torch.where(self.real, _code(y, sc), 0.0)
        self.worker = y - dec
        real_k = self.real.view(p, m)
        z = dec.view(p, p, m).sum(0) * (1.0 / p)  # [chunk, m]
        z = torch.where(real_k, z + self.server, 0.0)
        sc2 = _scales(z, real_k, self.block, self.rule)
        out = torch.where(real_k, _code(z, sc2), 0.0)
        self.server = z - out
        res = out.reshape(-1)[:n].clone()
        if self.exact is not None:
            res = torch.where(self.exact, xs.mean(0), res)
            keep = torch.nn.functional.pad(~self.exact, (0, p * m - n))
            self.worker = self.worker * keep
            self.server = self.server * keep.view(p, m)
        return res


def exact_mask(flat: "Flat", rule: str) -> Optional[Tensor]:
    """Rule parts ``_exN``: the parameters of at most N elements averaged exactly;
    ``_exlayerK``: parameter K of the flat order (the hook's: reversed) only; ``_exvec``:
    the 1-D parameters."""
    if "_exvec" in rule:  # the vectors (biases, norm weights) only
        return torch.cat([torch.full((k,), len(q.shape) < 2) for k, q in zip(flat.numels, flat.params)])
    if "_exlayer" in rule:
        k = int(rule.split("_exlayer")[1].split("_")[0])
        sl = flat.slices()[k]
        return (torch.arange(flat.n) >= sl.start) & (torch.arange(flat.n) < sl.stop)
    if "_ex" in rule:
        limit = int(rule.split("_ex")[1].split("_")[0])
        return torch.cat([torch.full((k,), k <= limit) for k in flat.numels])
    return None


def check_against_reference(n=5000, p=4, block=256, steps=3) -> float:
    """Largest difference of the simulated allreduce (rms) from lbcomm.testing.kernels."""
    from lbcomm.testing import kernels as R
    torch.manual_seed(0)
    m = chunk_size(n, p)
    we, se = [torch.zeros(p, m) for _ in range(p)], [torch.zeros(m) for _ in range(p)]
    worst = 0.0
    for blk in (block, None):
        c = Compressor(n, p, blk)
        we, se = [torch.zeros(p, m) for _ in range(p)], [torch.zeros(m) for _ in range(p)]
        for _ in range(steps):
            xs = torch.randn(p, n) * torch.rand(n) * 3
            ref, we, se = R.compressed_allreduce(list(xs), we, se, blk)
            worst = max(worst, float((c(xs) - ref).abs().max()))
    return worst


# ---------------------------------------------------------------------- the model as flat vectors
class Flat:
    def __init__(self, model, reverse: bool = False):
        self.params = [p for p in model.parameters()]
        if reverse:  # DDP buckets hold the parameters in reverse order
            self.params = self.params[::-1]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.n = sum(self.numels)

    def get(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def set(self, flat: Tensor) -> None:
        with torch.no_grad():
            for p, o, k in zip(self.params, self.offsets, self.numels):
                p.copy_(flat[o:o + k].view_as(p))

    def slices(self):
        return [slice(o, o + k) for o, k in zip(self.offsets, self.numels)]


def rank_grads(task, model, flat: Flat, step: int, p: int) -> Tensor:
    """[p, n]: every rank's gradient on its share of the global batch of this step."""
    batch = task.batch(step)
    per = batch[0].shape[0] // p
    out = torch.empty(p, flat.n)
    losses = []
    for r in range(p):
        part = tuple(t[r * per:(r + 1) * per] for t in batch)
        model.zero_grad(set_to_none=False)
        loss = task.loss(model, part)
        loss.backward()
        losses.append(float(loss))
        out[r] = torch.cat([q.grad.reshape(-1) if q.grad is not None else torch.zeros(q.numel())
                            for q in flat.params])
    return out, sum(losses) / p
