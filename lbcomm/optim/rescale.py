"""rescale_variance: the frozen variance of each parameter tensor follows the change of its
gradients' mean square since it was last updated (see `OneBitAdam`'s docs).

`VarianceRescale` is held by `OneBitAdam` and `ZeroOneAdam`. Per step, the statistic q
(the ranks' mean squared local gradient norm per parameter tensor) rides in collectives
the optimizer makes anyway: the full-precision gradient allreduce (warmup, ZeroOneAdam's
variance steps) and the finiteness agreement of every other step (it is the flat state's
``local_stat``). When a warmup hook averages the gradients, it hands the local ones over
first (`note_local_grads`) and one small allreduce averages their norms. The EMA of q
(beta2, the variance's window, fp32 per parameter, checkpointed as ``grad_sq``) and its
bias-corrected value when the variance was last updated (``grad_sq_frozen``: OneBitAdam's
freeze, ZeroOneAdam's latest variance step) give the factor min(q^_t / q^_ref, 1) by which
the stale v^ is scaled (never up: see `factors`); -1 marks an untracked parameter.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from .flat import FlatLayout

__all__ = ["VarianceRescale", "grad_norm", "local_sq_"]

_log = logging.getLogger(__name__)

VECTORS: Dict[str, float] = {"grad_sq": -1.0, "grad_sq_frozen": -1.0}


def grad_norm(g: Tensor) -> Tensor:
    """The L2 norm of a gradient as one flat fp32 vector (one read, no temporary); squared,
    the local statistic of rescale_variance, as lbcomm.testing.optim computes it."""
    return torch.linalg.vector_norm(g.reshape(-1).float())


def local_sq_(L: FlatLayout, flat: Optional[Tensor], out: Tensor) -> Tensor:
    """out[i] = `grad_norm` squared of parameter i's gradient (its view of `flat`, or its
    .grad when flat is None; 0 without one)."""
    norms = []
    for i in range(len(L.params)):
        g = L.view(flat, i) if flat is not None else L.grad(i)
        norms.append(out.new_zeros(()) if g is None else grad_norm(g))
    if norms:
        torch.stack(norms, out=out).square_()
    return out




class VarianceRescale:
    """rescale_variance over the flat state `fs` (a `FlatState`; of a OneBitAdam or a ZeroOneAdam)."""

    def __init__(self, fs):
        self.fs = fs
        self.now: Optional[Tensor] = None  # this step's statistic, folded once the step is taken
        self._pending: Optional[Tensor] = None  # the EMA of a step under way, kept by `commit`
        self._noted: Dict[int, Tensor] = {}  # id(param) -> local squared norm, from a warmup hook
        self._warned = False

    def tracking(self) -> bool:
        return any(g["rescale_variance"] for g in self.fs.param_groups)

    def loaded(self) -> None:
        """After load_state_dict: a checkpoint saved before the option existed continues with
        the rule it was trained with, the unscaled variance (said once, at WARNING)."""
        old = [g for g in self.fs.param_groups if "rescale_variance" not in g]
        for g in old:
            g["rescale_variance"] = False
        if old:
            _log.warning("%s: the checkpoint predates rescale_variance; it continues without it, as it was trained "
                         "(set param_group['rescale_variance'] = True to turn it on)", self.fs.name)

    def slots(self, L: FlatLayout) -> int:
        """How many values ride in the step's collective: one per parameter while tracking."""
        return len(L.params) if self.tracking() else 0

    def fill(self, L: FlatLayout, buf: Optional[Tensor], out: Tensor) -> None:
        """This rank's squared gradient norms (buf: the local flat gradients, or None)."""
        local_sq_(L, buf[:L.total] if buf is not None else None, out)

    def note(self, params, grads) -> None:
        """A warmup hook's local gradients, before it averages them."""
        if not self.tracking():
            return
        for p, g in zip(params, grads):
            self._noted[id(p)] = grad_norm(g.detach()).square()

    def reduced(self, L: FlatLayout, sq: Tensor, averaged: bool = False) -> None:
        """This step's statistic after the collective (`averaged`: a warmup whose gradients
        arrived averaged: from a hook's notes), kept until the step is taken."""
        fs = self.fs
        if averaged:  # a hook averaged them: its notes, one small allreduce
            noted, self._noted = self._noted, {}
            if not noted:
                self._untrack("the gradients were averaged before the optimizer saw them, and no warmup hook "
                              "handed over the local ones (note_local_grads), so their squared norms are unknown")
                return
            for i, p in enumerate(L.params):
                # -1: a parameter with a gradient that the hook did not see (its tracking stops)
                sq[i] = noted[id(p)] if id(p) in noted else (0.0 if L.grad(i) is None else -1.0)
            if fs.transport.world_size > 1:
                fs.transport.all_reduce(sq, op="mean")
        if fs.sharded():  # the shards' sums
            sq = fs.per_tensor(L, sq.reshape(-1, 1)).reshape(-1)
        self.now = sq.clone()

    def _untrack(self, why: str) -> None:
        """Stop rescale_variance for every parameter (the variance then stays frozen), with a warning."""
        self.fs.vectors["grad_sq"].fill_(-1.0)
        if not self._warned:
            self._warned = True
            _log.warning("%s: rescale_variance is off for this run: %s. The variance stays frozen as published. "
                         "Use lbcomm's warmup hook (or let the optimizer average the gradients) to keep it",
                         self.fs.name, why)

    def _ema(self, L: FlatLayout):
        """This step's statistic (consumed) and the EMA before and after it, per parameter:
        (sq, old, new), new = max(old, 0) b2 + (1 - b2) sq in float64 rounded to fp32 (the
        vectors' dtype), as the reference computes it; -1 in old: untracked."""
        fs = self.fs
        sq, self.now = self.now.tolist(), None
        old = fs.vectors["grad_sq"].tolist()
        b2 = [fs.param_groups[gi]["betas"][1] for gi in L.group_of]
        new = [max(o, 0.0) * b + (1 - b) * x for o, x, b in zip(old, sq, b2)]
        return sq, old, torch.tensor(new, dtype=torch.float32).tolist()

    def fold_warmup(self, L: FlatLayout, taken: bool) -> None:
        """After a full-precision step (OneBitAdam's warmup, ZeroOneAdam's variance step),
        taken or skipped: if taken, the EMA of the statistic for the parameters whose
        variance moved (a gradient on some rank: the has-grad flags of the averaged buffer),
        started at their first step; the step's statistic is consumed either way."""
        if self.now is None or not taken:
            self.now = None
            return
        active = (self.fs.grad_buf[L.total:L.total + len(L.params)] > 0).tolist()
        sq, old, new = self._ema(L)
        steps = self.fs.vectors["step"].tolist()
        out = list(old)
        for i in range(len(L.params)):
            # tracked: started at the parameter's first step (steps[i] is 1 by now); -1 (a hook
            # that did not see it) stays untracked; a norm that overflowed fp32 (finite
            # gradients over 1e19) leaves the EMA as it was
            if active[i] and 0 <= sq[i] < math.inf and (old[i] >= 0 or steps[i] == 1):
                out[i] = new[i]
            elif active[i] and sq[i] < 0:
                out[i] = -1.0
        self.fs.vectors["grad_sq"].copy_(torch.tensor(out, dtype=torch.float32))

    def _bc(self, L: FlatLayout, i: int, step: int) -> float:
        """The bias correction of parameter i's statistic after `step` steps (beta2's, as v's)."""
        group = self.fs.param_groups[L.group_of[i]]
        return 1 - group["betas"][1] ** step if group["bias_correction"] else 1.0

    def record_reference(self, L: FlatLayout) -> None:
        """grad_sq_frozen = the bias-corrected EMA, the reference of the rescale until the
        variance is updated again (-1: untracked, no rescale); called after the step that
        last updated the variance."""
        vec = self.fs.vectors
        q, steps = vec["grad_sq"].tolist(), vec["step"].tolist()
        out = [q[i] / self._bc(L, i, steps[i]) if q[i] >= 0 and steps[i] > 0 else -1.0 for i in range(len(L.params))]
        vec["grad_sq_frozen"].copy_(torch.tensor(out, dtype=torch.float32))

    def factors(self, L: FlatLayout, include: List[bool]):
        """Compression stage: per parameter, the factor f by which its frozen variance is
        scaled this step (None: unscaled), f = min(EMA_t / EMA_freeze, 1), both
        bias-corrected (steps already advanced); and the new EMA vector to keep once the step is taken.
        (None, None) when nothing is tracked."""
        if self.now is None:
            return None, None
        fs = self.fs
        sq, old, new = self._ema(L)
        frz, steps = fs.vectors["grad_sq_frozen"].tolist(), fs.vectors["step"].tolist()
        factors: List[Optional[float]] = [None] * len(L.params)
        keep = list(old)
        for i, gi in enumerate(L.group_of):
            if not (include[i] and old[i] >= 0 and frz[i] > 0 and 0 <= sq[i] < math.inf):
                continue
            keep[i] = new[i]
            if not fs.param_groups[gi]["rescale_variance"]:
                continue
            f = new[i] / self._bc(L, i, steps[i]) / frz[i]
            # never above 1: a tensor whose gradients grew mostly grew in a few coordinates
            # (max_update bounds those); scaling all of its v^ up would shrink every other step
            factors[i] = min(f, 1.0) if 0.0 < f < math.inf else None
        return factors, torch.tensor(keep, dtype=torch.float32)

    def factors_of(self, L: FlatLayout) -> Callable[[List[bool]], Optional[List[Optional[float]]]]:
        """`factors` as the update functions take them (called once the step counts have
        advanced): the factors, the new EMA held until `commit`."""
        self._pending = None

        def of(include: List[bool]) -> Optional[List[Optional[float]]]:
            factors, self._pending = self.factors(L, include)
            return factors
        return of

    def commit(self) -> None:
        """The step whose factors were taken is done: keep its EMA."""
        if self._pending is not None:
            self.fs.vectors["grad_sq"].copy_(self._pending)
            self._pending = None
