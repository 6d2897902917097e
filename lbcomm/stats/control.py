"""What the statistics steer: the learning rate (`AdaScale`) and the batch size
(`BatchSizeController`)."""
import logging
import math
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .noise import GradientNoiseScale

__all__ = ["AdaScale", "BatchSizeController"]

_log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- AdaScale
class AdaScale:
    r"""AdaScale SGD (Johnson et al. 2020) around any torch optimizer: each step multiplies
    every group's learning rate by the gain r_t of the current global batch over
    `base_batch` (the batch the schedule was tuned for), and counts scale-invariant
    iterations tau += r_t. Drive the learning-rate schedule by `scale_invariant_steps`
    (the schedule of the base run, read at tau) and stop when tau reaches the base run's
    step count: that is AdaScale's rule, which this wrapper makes available, not enforces.

    The gain comes from `stats` as it stands when `step` runs: with the statistics folded in
    before the step (`allreduce_gradients_`, `stats_hook`) it is this step's; with an lbcomm
    optimizer measuring inside its own step it is the previous step's.

    Args:
        optimizer (Optimizer): any torch optimizer (SGD, LARS, ...); its lrs are the base lrs.
        stats (GradientNoiseScale): the gradient statistics of this training.
        base_batch (int): global batch the learning rate was tuned for.
        batch (int or callable, optional): the current global batch, or a function returning
            it (e.g. a `BatchSizeController`'s); default: stats.local_batch x world size of
            the last observation.

    Example::

        >>> # xdoctest: +SKIP
        >>> opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), stats, base_batch=256)
        >>> while opt.scale_invariant_steps < base_steps:
        ...     ...; opt.step()
    """

    def __init__(self, optimizer, stats: GradientNoiseScale, base_batch: int,
                 batch: Union[None, int, Callable[[], int]] = None):
        if not base_batch > 0:
            raise ValueError(f"Invalid base_batch: {base_batch} (the global batch the lr was tuned for, > 0)")
        self.optimizer = optimizer
        self.stats = stats
        self.base_batch = base_batch
        self.batch = batch
        self.scale_invariant_steps = 0.0
        self.steps = 0
        self.gain = 1.0

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    def current_batch(self) -> float:
        if callable(self.batch):
            return float(self.batch())
        if self.batch is not None:
            return float(self.batch)
        return float(self.stats.last.get("global_batch", self.base_batch))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One step of the wrapped optimizer at lr x gain; the lrs are restored afterwards."""
        self.gain = self.stats.gain(self.base_batch, self.current_batch())
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = g["lr"] * self.gain
        try:
            loss = self.optimizer.step(closure)
        finally:
            for g, lr in zip(self.optimizer.param_groups, lrs):
                g["lr"] = lr
        if not getattr(self.optimizer, "last_step_skipped", False):
            self.scale_invariant_steps += self.gain
            self.steps += 1
        return loss

    def state_dict(self) -> Dict[str, Any]:
        return dict(optimizer=self.optimizer.state_dict(), stats=self.stats.state_dict(),
                    adascale=dict(base_batch=self.base_batch, scale_invariant_steps=self.scale_invariant_steps,
                                  steps=self.steps, gain=self.gain))

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(sd["optimizer"])
        self.stats.load_state_dict(sd["stats"])
        a = sd["adascale"]
        self.base_batch, self.scale_invariant_steps = a["base_batch"], float(a["scale_invariant_steps"])
        self.steps, self.gain = int(a["steps"]), float(a["gain"])


# ---------------------------------------------------------------------- adaptive batch size
class BatchSizeController:
    r"""Adaptive global batch size by the norm test (Byrd et al. 2012; AdAdaGrad, Lau et al.
    2024): the batch B passes while the variance of its mean gradient is small against the
    gradient, tr(Sigma)/B <= eta^2 |G|^2; when it fails, the next batch is the smallest that
    would pass, ceil(tr(Sigma) / (eta^2 |G|^2)), rounded up to whole micro batches on every
    rank, at most max_growth times the current one and at most max_batch. The batch never
    shrinks. It tells the loop how many micro batches to accumulate per step and keeps
    ``stats.local_batch`` in step.

    Args:
        stats (GradientNoiseScale): the statistics of this training.
        micro_batch (int): samples per rank and forward/backward pass.
        world_size (int): data-parallel ranks.
        eta (float, optional): the test's tolerance (default: 1.0).
        start_accumulation (int, optional): micro batches per step at the start (default: 1).
        max_batch (int, optional): the largest global batch (default: no limit).
        max_growth (float, optional): largest growth factor of one decision (default: 2.0).
        check_every (int, optional): steps between decisions (default: 1).

    Example::

        >>> # xdoctest: +SKIP
        >>> ctl = BatchSizeController(stats, micro_batch=16, world_size=4, eta=0.5, max_batch=4096)
        >>> for step in range(steps):
        ...     for _ in range(ctl.accumulation_steps):
        ...         (loss_fn(model(*next(it))) / ctl.accumulation_steps).backward()
        ...     lbcomm.stats.allreduce_gradients_(model.parameters(), stats); opt.step(); opt.zero_grad()
        ...     ctl.update()
    """

    def __init__(self, stats: GradientNoiseScale, micro_batch: int, world_size: int, *, eta: float = 1.0,
                 start_accumulation: int = 1, max_batch: Optional[int] = None, max_growth: float = 2.0,
                 check_every: int = 1):
        if not micro_batch > 0 or not world_size > 0:
            raise ValueError(f"Invalid micro_batch {micro_batch} or world_size {world_size} (both > 0)")
        if not eta > 0:
            raise ValueError(f"Invalid eta: {eta} (the norm test's tolerance, > 0)")
        if not max_growth > 1:
            raise ValueError(f"Invalid max_growth: {max_growth} (> 1, or the batch could never grow)")
        if not start_accumulation >= 1 or not check_every >= 1:
            raise ValueError(f"Invalid start_accumulation {start_accumulation} or check_every {check_every} (>= 1)")
        self.stats = stats
        self.micro_batch, self.world_size = micro_batch, world_size
        self.eta, self.max_batch, self.max_growth, self.check_every = eta, max_batch, max_growth, check_every
        self.accumulation_steps = start_accumulation
        self.calls = 0
        self.history: List[Tuple[int, int]] = []  # (call, new global batch) at every change
        self.stats.local_batch = self.local_batch

    @property
    def local_batch(self) -> int:
        return self.micro_batch * self.accumulation_steps

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.world_size

    def norm_test(self, batch: Optional[int] = None) -> bool:
        """Whether `batch` (default: the current one) passes with the smoothed statistics."""
        B = self.global_batch if batch is None else batch
        g, t = self.stats.grad_sq, self.stats.trace_sigma
        if self.stats.steps == 0 or math.isnan(g):
            return True
        return max(t, 0.0) / B <= self.eta ** 2 * max(g, 0.0)

    def wanted_batch(self) -> int:
        """The global batch the norm test asks for (before rounding and limits)."""
        g, t = self.stats.grad_sq, self.stats.trace_sigma
        if self.norm_test():
            return self.global_batch
        if not g > 0:
            return math.inf
        return math.ceil(max(t, 0.0) / (self.eta ** 2 * g))

    def update(self) -> int:
        """Decide after a step: returns the next global batch (accumulation_steps updated)."""
        self.calls += 1
        if self.calls % self.check_every or self.norm_test():
            return self.global_batch
        cur = self.global_batch
        target = min(self.wanted_batch(), cur * self.max_growth)
        if self.max_batch is not None:
            target = min(target, self.max_batch)
        per_step = self.micro_batch * self.world_size
        acc = max(self.accumulation_steps, math.ceil(target / per_step))
        if self.max_batch is not None and acc * per_step > self.max_batch:
            acc = max(self.accumulation_steps, self.max_batch // per_step)
        if acc != self.accumulation_steps:
            self.accumulation_steps = acc
            self.stats.local_batch = self.local_batch
            self.history.append((self.calls, self.global_batch))
            _log.info("BatchSizeController: norm test failed (tr(Sigma)/B %.4g > eta^2 |G|^2 %.4g); global batch %d "
                      "-> %d (%d accumulation steps)", max(self.stats.trace_sigma, 0.0) / cur,
                      self.eta ** 2 * self.stats.grad_sq, cur, self.global_batch, acc)
        return self.global_batch

    def state_dict(self) -> Dict[str, Any]:
        return dict(accumulation_steps=self.accumulation_steps, calls=self.calls, history=list(self.history))

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.accumulation_steps, self.calls = int(sd["accumulation_steps"]), int(sd["calls"])
        self.history = [tuple(h) for h in sd["history"]]
        self.stats.local_batch = self.local_batch
