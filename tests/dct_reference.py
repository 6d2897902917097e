"""Pure-torch reference of DCT (Dynamic Communication Thresholding), independent of
lbcomm: dense tensors and masks, no packing, no transport, a sort instead of topk.

`DCTReference(numel, p, density, refresh_every, exact)` simulates the p ranks of one unit:
``step(inputs)`` takes every rank's fp32 input and returns the mean every rank receives;
``residual[r]``, ``threshold[r]`` and ``sent[r]`` (what rank r sent in the last step, as a
dense tensor) are kept for the checks.
"""
from __future__ import annotations

import math

import torch

TINY = torch.finfo(torch.float32).tiny


class DCTReference:
    def __init__(self, numel, p, density, refresh_every, exact=None):
        self.numel, self.p, self.density, self.refresh_every = numel, p, density, refresh_every
        self.exact = exact  # int64 positions averaged exactly, or None
        self.residual = [torch.zeros(numel) for _ in range(p)]
        self.threshold = [None] * p
        self.steps = 0
        self.sent = [None] * p

    def _threshold(self, mag):
        n = self.numel - (0 if self.exact is None else self.exact.numel())
        k = math.ceil(self.density * n)
        return float(torch.sort(mag, descending=True).values[k - 1])

    def step(self, inputs):
        refresh = self.steps % self.refresh_every == 0
        total = torch.zeros(self.numel)
        for r, x in enumerate(inputs):
            acc = x.float() + self.residual[r]
            mag = acc.abs()
            if self.exact is not None:
                mag[self.exact] = 0.0
            if refresh or self.threshold[r] is None:
                self.threshold[r] = self._threshold(mag)
            mask = mag >= max(self.threshold[r], TINY)
            self.sent[r] = torch.where(mask, acc, torch.zeros(()))
            res = torch.where(mask, torch.zeros(()), acc)
            if self.exact is not None:
                res[self.exact] = 0.0
            self.residual[r] = res
            total = total + self.sent[r]
        mean = total / self.p
        if self.exact is not None:  # summed by the transport's allreduce: compared with a tolerance
            mean[self.exact] = torch.stack([x.float()[self.exact] for x in inputs]).sum(0) / self.p
        self.steps += 1
        return mean
