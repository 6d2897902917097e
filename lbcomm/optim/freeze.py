"""``freeze_step="auto"``: the 1-bit optimizers decide themselves when the variance has settled.

Why a criterion on the variance: after the freeze the variance is fixed (OneBitAdam,
OneBitLamb) or updated ever more rarely (ZeroOneAdam), so it should be frozen once it
describes the gradients of the rest of the run, and not while the lr schedule is still
warming up (a frozen variance under-preconditions steps that then grow). Both are read
from what the warmup already computes, every `WINDOW` steps:

* the preconditioner ``d = sqrt(v^)`` (bias-corrected variance) on a fixed sample of at
  most `SAMPLE` coordinates, the same on every rank; its relative change since the last
  check, ``sum |d - d_prev| / sum d_prev``, scaled to `WINDOW` steps, must be at most `TOL`;
* no param group's lr may have risen since the last check (the lr warmup is over).

The freeze happens at the first check, from step `MIN_STEP` on, where both hold, and at
step `MAX_STEP` at the latest. Every rank votes and the decision is the AND of the votes
(one 4-byte allreduce per check, on the checks only), so the freeze step is the same on
every rank even where the ranks' variances differ (sharded parameters). The sample and
the last check's values are part of the checkpoint, so a resumed run freezes at the step
the uninterrupted one would have.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor

__all__ = ["AutoFreeze", "AUTO", "WINDOW", "TOL", "MIN_STEP", "MAX_STEP", "SAMPLE", "check_freeze_option",
           "preconditioner", "all_agree"]

_log = logging.getLogger(__name__)

AUTO = "auto"
WINDOW = 10  # steps between two checks
TOL = 0.1  # largest relative change of the sampled preconditioner over WINDOW steps
MIN_STEP = 20  # the earliest freeze
MAX_STEP = 100000  # the latest freeze (the fixed default's step)
SAMPLE = 4096  # coordinates of the sample
_SEED = 0x5EED  # the sample's draw: the same on every rank


def check_freeze_option(name: str, value) -> None:
    """Raise ValueError unless `value` is an int >= 1 or "auto"."""
    if value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {name}: {value!r} (must be 'auto', the optimizer freezing the variance once it "
                         "has settled, or an int >= 1: the variance is frozen after that many warmup steps)")


class AutoFreeze:
    """The decision of ``freeze_step="auto"`` (see the module docstring). It is handed what
    it reads at each check (the flat variance, each coordinate's bias correction, the lrs
    and a vote over the ranks) and keeps only the sample's last values.

    Attributes:
        decided_at (int or None): the step after which the variance was frozen.
        last_change (float or None): the last check's relative change over WINDOW steps.
    """

    def __init__(self, who: str, option: str = "freeze_step"):
        self.who, self.option = who, option
        self.decided_at: Optional[int] = None
        self.last_change: Optional[float] = None
        self._prev: Optional[Tensor] = None  # the sampled preconditioner at the last check
        self._prev_step = 0
        self._prev_lrs: Optional[List[float]] = None
        self._index: Optional[Tensor] = None
        self._numel = -1  # the flat buffer the sample was drawn from

    def due(self, step: int) -> bool:
        """Whether `step` (steps taken so far) is a check: WINDOW steps after the last one."""
        return step - self._prev_step >= WINDOW or step >= MAX_STEP

    def sample(self, numel: int, device) -> Tensor:
        """The sampled coordinates of a flat buffer of `numel` elements (sorted, fixed)."""
        if self._index is None or self._numel != numel:
            if numel <= SAMPLE:
                self._index = torch.arange(numel, device=device)
            else:
                g = torch.Generator().manual_seed(_SEED)
                self._index = torch.randperm(numel, generator=g)[:SAMPLE].sort().values.to(device)
            self._numel = numel
            if self._prev is not None and self._prev.numel() != self._index.numel():
                self._prev = None  # another layout: start afresh
        return self._index

    def check(self, step: int, precond: Callable[[Tensor], Tensor], lrs: List[float],
              agree: Callable[[bool], bool]) -> bool:
        """At a check `step`: True when the variance is to be frozen now. `precond(index)`
        gives sqrt(v^) at the sampled coordinates, `agree(vote)` the AND of every rank's vote."""
        d = precond(self._index).to(torch.float64)
        settled = False
        if self._prev is not None and self._prev.numel() == d.numel():
            base = float(self._prev.sum())
            change = float((d - self._prev).abs().sum()) / base if base > 0 else float("inf")
            self.last_change = change * WINDOW / max(1, step - self._prev_step)
            lr_done = self._prev_lrs is not None and len(lrs) == len(self._prev_lrs) and all(
                now <= then for now, then in zip(lrs, self._prev_lrs))
            settled = step >= MIN_STEP and lr_done and self.last_change <= TOL
        self._prev, self._prev_step, self._prev_lrs = d, step, list(lrs)
        if step >= MAX_STEP:
            settled = True
        if not agree(settled):
            return False
        self.decided_at = step
        why = ("the bound MAX_STEP" if self.last_change is None or self.last_change > TOL else
               f"relative change of the preconditioner {self.last_change:.3g} over {WINDOW} steps, lr no longer rising")
        _log.info("%s: %s='auto' froze the variance after step %s (%s)", self.who, self.option, step, why)
        return True

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        return {"decided_at": self.decided_at, "last_change": self.last_change, "prev": self._prev,
                "prev_step": self._prev_step, "prev_lrs": self._prev_lrs}

    def load_state_dict(self, saved: Optional[Dict[str, Any]]) -> None:
        if saved is None:  # a checkpoint of a fixed freeze_step: the decision starts afresh
            return
        self.decided_at, self.last_change = saved["decided_at"], saved["last_change"]
        self._prev, self._prev_step, self._prev_lrs = saved["prev"], int(saved["prev_step"]), saved["prev_lrs"]
        self._index, self._numel = None, -1  # drawn again: the same draw


def preconditioner(fs, L, vstep: str):
    """For `AutoFreeze.check`, of the flat state `fs` (a `FlatState`) and its layout `L`:
    index -> sqrt(v^) at those flat coordinates (each with its parameter's bias correction)."""
    steps = fs.vectors[vstep].tolist()
    bc = []
    for i, gi in enumerate(L.group_of):
        group = fs.param_groups[gi]
        b2 = group["betas"][1]
        bc.append(1 - b2 ** steps[i] if group.get("bias_correction", True) and steps[i] > 0 else 1.0)
    v = fs.buffers["exp_avg_sq"]

    def precond(index: Tensor) -> Tensor:
        starts = torch.tensor(L.offsets, dtype=torch.long, device=index.device)
        owner = (torch.searchsorted(starts, index, right=True) - 1).clamp_(min=0)
        scale = torch.tensor(bc, dtype=torch.float64, device=index.device)[owner]
        return (v[index].double() / scale).sqrt_()

    return precond


def all_agree(fs, vote: bool) -> bool:
    """The AND of every rank's vote (one 4-byte allreduce over the flat state's transport;
    the shard group's too)."""
    tr, shards = fs.transport, fs.sharded()
    if tr.world_size == 1 and not shards:
        return vote
    flag = torch.tensor([1.0 if vote else 0.0], device=fs.device)
    want = 1
    if tr.world_size > 1:
        tr.all_reduce(flag, op="sum")
        want *= tr.world_size
    if shards:
        fs.shard_transport.all_reduce(flag, op="sum")
        want *= fs.shard_transport.world_size
    return int(flag.item()) == want
