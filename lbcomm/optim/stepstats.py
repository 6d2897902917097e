"""Gradient noise statistics fed by an optimizer's own steps (``optimizer.gradient_stats``,
a `lbcomm.stats.GradientNoiseScale`).

Where the local gradients reach the optimizer, each step measures them with one small
collective that is already there or is started early and finished after the update:

* warmup, the optimizer averaging: exact, the averaged gradient's norm (taken by the warmup)
  against the ranks' local norms (an async allreduce of its own);
* compression stage, several ranks: a coordinate sample that rides in the 1-bit stage's
  finiteness agreement (`OneBitStage.grads_finite`; an allreduce of its own on a step
  without it, ZeroOneAdam's variance steps);
* compression stage, one rank: the sample alone.

With a DDP hook averaging the warmup gradients, the optimizer never sees the local ones:
`lbcomm.stats.stats_hook` measures them instead and nothing happens here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["StepStats"]


@dataclass
class _Pending:
    """A step's measurement in flight: riding in the 1-bit stage's agreement, or an
    async allreduce (`work`, exact in warmup)."""

    ride: Any = None  # the OneBitStage whose agreement carries the sample
    exact: bool = False
    work: Any = None


class StepStats:
    """The statistics of one optimizer's steps, over its flat state `fs` (a `FlatState`)."""

    def __init__(self, fs):
        self.fs = fs
        self.tracker = None  # the GradientNoiseScale to feed (None: no statistics)
        self._gsq: Optional[Tensor] = None  # this warmup step's |averaged gradient|^2

    def begin(self, L, stage, grads_averaged: bool) -> Optional[_Pending]:
        """Start this step's measurement (None: nothing to measure); `stage`: the 1-bit
        optimizer's `OneBitStage` (None for the full-precision ones)."""
        frozen = stage is not None and stage.frozen
        if self.tracker is None or (grads_averaged and not frozen):
            return None
        grads = [p.grad for p in L.params]
        if frozen and self.fs.transport.world_size > 1:
            stage.stats_ride = self.tracker.measure(grads, exact=False)
            return _Pending(ride=stage)
        return _Pending(exact=not frozen,
                        work=self.tracker.begin(grads, self.fs.transport, exact=not frozen))

    def note_averaged(self, buf: Tensor, numel: int, grads_averaged: bool) -> None:
        """The warmup's averaged flat gradient `buf` (its first `numel` elements): its
        squared norm is the exact measurement's global side."""
        if self.tracker is not None and not grads_averaged:
            self._gsq = torch.linalg.vector_norm(buf[:numel]).square()

    def finish(self, pending: Optional[_Pending], skipped: bool) -> None:
        """Fold this step's measurement in (a skipped step's is dropped on every rank)."""
        if pending is None:
            return
        if pending.ride is not None:
            mean, ride = pending.ride.take_stats_mean(), pending.ride.stats_ride_only()
            if skipped:  # agreed on every rank: nothing to fold, no collective
                return
            if mean is None:  # a step without the agreement: an allreduce of its own
                mean = ride
                self.fs.transport.all_reduce(mean, op="mean")
            self.tracker.observe(mean, self.fs.transport.world_size)
            return
        if pending.work is None:
            return
        gsq, self._gsq = self._gsq, None
        self.tracker.finish(pending.work, gsq, fold=not skipped and (gsq is not None or not pending.exact))
