r"""Gradient statistics of data-parallel training at the cost of a few scalars per step:
the gradient noise scale, AdaScale's gain, and the norm test of adaptive batch sizes.

Estimators (McCandlish et al. 2018, appendix A). A rank's gradient over its b samples
and the average over p ranks (B = p b samples) satisfy

.. math::
    E|g_b|^2 = |G|^2 + \mathrm{tr}(\Sigma)/b, \qquad E|g_B|^2 = |G|^2 + \mathrm{tr}(\Sigma)/B

with G the true gradient and \Sigma the per-sample covariance, so

.. math::
    |G|^2 \approx \frac{B |g_B|^2 - b |g_b|^2}{B - b}, \qquad
    \mathrm{tr}(\Sigma) \approx \frac{|g_b|^2 - |g_B|^2}{1/b - 1/B}

unbiased, with |g_b|^2 the mean over the ranks of the local squared norms (one scalar).
Both are smoothed by a bias-corrected EMA before any ratio: the noise scale
B_simple = tr(\Sigma)/|G|^2 and AdaScale's gain (Johnson et al. 2020) for a batch s times
the base batch b0, r = (\sigma^2 + |G|^2) / (\sigma^2/s + |G|^2) with \sigma^2 = tr(\Sigma)/b0.

Where |g_B|^2 comes from:

* ``exact``: the averaged gradient itself (warmup of the lbcomm optimizers, DDP with an
  exact hook, `allreduce_gradients_`). Costs one fp32 scalar on the wire.
* ``sketch``: with 1-bit communication the exact mean is never formed (the compressed
  result carries the error-feedback residual, whose norm would inflate |g_B|^2). A random
  sample of k coordinates, drawn afresh each step from a seed shared by all ranks, is
  averaged exactly beside it: with x = sqrt(n/k) g[idx] (idx uniform with replacement),
  E|x|^2 = |g|^2 for every vector g, so both |g_b|^2 (mean over ranks of |x_r|^2) and
  |g_B|^2 (|mean_r x_r|^2) are unbiased, and so are the estimators, which are linear in
  them. Costs k + 2 fp32 scalars per step (sketch_size, default 4096: 16 KiB); its noise is
  averaged by the EMA (bias and spread against exact values: bench/large_batch.py).

Sources: `GradientNoiseScale.measure`/`observe` for any loop, `allreduce_gradients_` for a
plain torch loop, the lbcomm optimizers (``optimizer.gradient_stats = tracker``: exact in
warmup, sketch in the compression stage) and `stats_hook` around any DDP communication hook.

Example::

    >>> # xdoctest: +SKIP
    >>> stats = lbcomm.stats.GradientNoiseScale(local_batch=32)
    >>> opt = lbcomm.stats.AdaScale(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    ...                              stats, base_batch=128, batch=32 * world_size)
    >>> for x, y in loader:
    ...     opt.zero_grad(); loss_fn(model(x), y).backward()
    ...     lbcomm.stats.allreduce_gradients_(model.parameters(), stats)   # averages the grads too
    ...     opt.step()
    >>> stats.noise_scale, opt.gain, opt.scale_invariant_steps
"""

import logging
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["noise_estimates", "adascale_gain", "GradientNoiseScale", "allreduce_gradients_", "AdaScale",
           "BatchSizeController", "StatsHookState", "stats_hook"]

_log = logging.getLogger(__name__)

Number = Union[float, Tensor]


# ---------------------------------------------------------------------- estimators
def noise_estimates(local_sq: Number, global_sq: Number, local_batch: float, global_batch: float
                    ) -> Tuple[Number, Number]:
    """Unbiased (|G|^2, tr(Sigma)) from the mean over ranks of the local squared gradient
    norms (each over `local_batch` samples) and the squared norm of their average (over
    `global_batch` samples). Raises ValueError when global_batch <= local_batch (one rank:
    the two norms coincide and nothing can be estimated)."""
    b, B = float(local_batch), float(global_batch)
    if not 0 < b < B:
        raise ValueError(f"noise_estimates: need 0 < local_batch < global_batch, got {b} and {B} (with one rank "
                         "the local and global gradients coincide; the noise scale needs at least 2 ranks)")
    grad_sq = (B * global_sq - b * local_sq) / (B - b)
    trace = (local_sq - global_sq) / (1.0 / b - 1.0 / B)
    return grad_sq, trace


def adascale_gain(grad_sq: float, trace: float, base_batch: float, batch: float) -> float:
    """AdaScale's gain r = (tr(Sigma)/b0 + |G|^2) / (tr(Sigma)/B + |G|^2) for batch B and base
    batch b0, in [1, B/b0]. Negative estimates (noise of small samples) are clamped to zero;
    no signal at all (|G|^2 = 0) gives the maximum B/b0, nothing measured (both zero) gives 1."""
    s = float(batch) / float(base_batch)
    g, t = max(float(grad_sq), 0.0), max(float(trace), 0.0)
    if t == 0.0:
        return 1.0
    if g == 0.0:
        return max(1.0, s)
    r = (t / base_batch + g) / (t / batch + g)
    return min(max(r, 1.0 if s >= 1 else s), max(s, 1.0))


class GradientNoiseScale:
    r"""Smoothed |G|^2 and tr(Sigma) of data-parallel training, the noise scale and AdaScale's gain.

    Feed it once per step, on every rank alike, with what the ranks averaged: either the
    helpers do it (`allreduce_gradients_`, the lbcomm optimizers, `stats_hook`), or a loop
    calls ``v = stats.measure(local_grads, exact)``, averages v over the ranks (fold it into
    an existing allreduce) and calls ``stats.observe(v, world_size, global_sq)``.

    Args:
        local_batch (int): samples behind one rank's gradient per step (micro batch x
            accumulation steps); set the attribute when it changes.
        beta (float, optional): EMA factor of the two estimates, bias-corrected (default: 0.95).
        sketch_size (int, optional): coordinates sampled per step where the exact mean is
            not available (default: 4096).
        seed (int, optional): seed of the coordinate samples; the same on every rank (default: 0).
        log_every (int, optional): log the statistics at INFO every this many observations;
            0: never (default: 100).

    Attributes:
        grad_sq, trace_sigma (float): the smoothed |G|^2 and tr(Sigma) (nan before the first step).
        last (dict): the unsmoothed values of the last observation (local_sq, global_sq,
            grad_sq, trace_sigma, local_batch, global_batch, exact).
        steps (int): observations so far.
    """

    def __init__(self, local_batch: int, *, beta: float = 0.95, sketch_size: int = 4096, seed: int = 0,
                 log_every: int = 100):
        if not local_batch > 0:
            raise ValueError(f"Invalid local_batch: {local_batch} (samples per rank and step, > 0)")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta: {beta} (need 0 <= beta < 1)")
        if isinstance(sketch_size, bool) or not isinstance(sketch_size, int) or sketch_size < 1:
            raise ValueError(f"Invalid sketch_size: {sketch_size!r} (an int >= 1)")
        self.local_batch = local_batch
        self.beta = beta
        self.sketch_size = sketch_size
        self.seed = seed
        self.log_every = log_every
        self.steps = 0
        self.draws = 0  # coordinate samples drawn so far (the seed of the next one)
        self._ema = [0.0, 0.0]  # un-normalized EMAs of grad_sq and trace
        self._weight = 0.0  # 1 - beta^steps
        self.last: Dict[str, Any] = {}
        self._warned_one_rank = False

    # ------------------------------------------------------------------ values
    @property
    def grad_sq(self) -> float:
        return self._ema[0] / self._weight if self._weight > 0 else float("nan")

    @property
    def trace_sigma(self) -> float:
        return self._ema[1] / self._weight if self._weight > 0 else float("nan")

    @property
    def noise_scale(self) -> float:
        """B_simple = tr(Sigma) / |G|^2 (samples): the critical batch size estimate; inf when
        the smoothed |G|^2 is not positive, nan before the first step."""
        g, t = self.grad_sq, self.trace_sigma
        if math.isnan(g):
            return float("nan")
        return t / g if g > 0 else float("inf")

    def gain(self, base_batch: float, batch: float) -> float:
        """AdaScale's gain of global batch `batch` over `base_batch` (1 before the first step)."""
        if self.steps == 0:
            return 1.0
        return adascale_gain(self.grad_sq, self.trace_sigma, base_batch, batch)

    # ------------------------------------------------------------------ measuring
    def measure(self, grads: Sequence[Optional[Tensor]], exact: bool) -> Tensor:
        """This rank's fp32 vector to average over the ranks: [|g|^2] when the caller has the
        exact averaged gradient (`exact`: one pass over the gradient), else [|x|^2, |x|^2, x]
        with x the scaled sample of sketch_size coordinates (drawn from seed and `draws`,
        advanced here; only they are read: the estimators then use the sample's local and
        global norms alike). `grads` is the local gradient as a list of tensors (None counts
        as zeros)."""
        present = [g for g in grads if g is not None]
        dev = present[0].device if present else torch.device("cpu")
        if not exact:  # the sample alone: the whole gradient is not read (the estimators use |x|^2)
            x = self._sample(grads, dev)
            sq = x.square().sum().reshape(1)
            return torch.cat([sq, sq, x])
        if present:  # one fused pass (torch's foreach norm) over all of them
            return torch.nn.utils.get_total_norm(present, 2.0).float().square().reshape(1)
        return torch.zeros(1, dtype=torch.float32, device=dev)

    def _sample(self, grads: Sequence[Optional[Tensor]], dev: torch.device) -> Tensor:
        sizes = [0 if g is None else g.numel() for g in grads]
        n = sum(sizes)
        k = self.sketch_size
        self.draws += 1
        if n <= k:  # small: every coordinate, exactly
            parts = [torch.zeros(s, dtype=torch.float32, device=dev) if g is None else g.reshape(-1).float()
                     for g, s in zip(grads, sizes)]
            return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32, device=dev)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.draws)
        idx = torch.randint(0, n, (k,), generator=gen).sort().values
        out = torch.zeros(k, dtype=torch.float32, device=dev)
        offsets = torch.tensor([0] + sizes).cumsum(0)
        cut = torch.searchsorted(idx, offsets).tolist()
        for i, g in enumerate(grads):
            a, b = cut[i], cut[i + 1]
            if g is None or b <= a:
                continue
            local_idx = (idx[a:b] - int(offsets[i])).to(dev)
            out[a:b] = g.reshape(-1).index_select(0, local_idx).float()
        return out.mul_(math.sqrt(n / k))

    def observe(self, reduced: Tensor, world_size: int, global_sq: Optional[Number] = None) -> None:
        """Fold in one step from the mean over the ranks of `measure`'s vectors; `global_sq`
        is the exact |mean gradient|^2 when `measure` was called with exact=True."""
        if world_size < 2:
            if not self._warned_one_rank:
                _log.warning("GradientNoiseScale: one rank; the local and global gradients coincide and the noise "
                             "scale cannot be estimated (run with >= 2 ranks)")
                self._warned_one_rank = True
            return
        r = reduced.detach().double().cpu()
        exact = global_sq is not None
        if exact:
            local, glob = float(r[0]), float(global_sq)
        else:
            local, glob = float(r[1]), float(r[2:].square().sum())
        b = float(self.local_batch)
        g2, tr = noise_estimates(local, glob, b, b * world_size)
        if not (math.isfinite(g2) and math.isfinite(tr)):
            _log.info("GradientNoiseScale: non-finite gradients at observation %s; not folded in", self.steps + 1)
            return
        self.steps += 1
        self._ema[0] = self.beta * self._ema[0] + (1 - self.beta) * g2
        self._ema[1] = self.beta * self._ema[1] + (1 - self.beta) * tr
        self._weight = 1 - self.beta ** self.steps
        self.last = dict(local_sq=local, global_sq=glob, grad_sq=g2, trace_sigma=tr, local_batch=b,
                         global_batch=b * world_size, exact=exact)
        if self.log_every and self.steps % self.log_every == 0:
            _log.info("gradient statistics at step %s: |G|^2 %.4g, tr(Sigma) %.4g, noise scale B_simple %.4g "
                      "samples (global batch %d, %s)", self.steps, self.grad_sq, self.trace_sigma, self.noise_scale,
                      b * world_size, "exact" if exact else f"sketch of {self.sketch_size} coordinates")

    def begin(self, grads: Sequence[Optional[Tensor]], transport, exact: bool):
        """Measure and start the average over `transport`'s ranks (async); give the result to
        `finish`. None with one rank."""
        if transport.world_size < 2:
            self.observe(torch.zeros(1), 1)
            return None
        v = self.measure(grads, exact)
        return v, transport.all_reduce(v, op="mean", async_op=True), transport.world_size

    def finish(self, pending, global_sq: Optional[Number] = None, fold: bool = True) -> None:
        """Wait for `begin`'s average and fold it in (unless `fold` is False)."""
        if pending is None:
            return
        v, fut, p = pending
        fut.wait()
        if fold:
            self.observe(v, p, global_sq)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        return dict(local_batch=self.local_batch, beta=self.beta, sketch_size=self.sketch_size, seed=self.seed,
                    steps=self.steps, draws=self.draws, ema=list(self._ema), weight=self._weight, last=dict(self.last))

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.local_batch, self.beta = sd["local_batch"], sd["beta"]
        self.sketch_size, self.seed = sd["sketch_size"], sd["seed"]
        self.steps, self.draws = int(sd["steps"]), int(sd["draws"])
        self._ema, self._weight, self.last = list(sd["ema"]), float(sd["weight"]), dict(sd["last"])

    def __repr__(self) -> str:
        return (f"GradientNoiseScale(steps={self.steps}, grad_sq={self.grad_sq:.4g}, trace_sigma="
                f"{self.trace_sigma:.4g}, noise_scale={self.noise_scale:.4g})")


# ---------------------------------------------------------------------- plain loops
@torch.no_grad()
def allreduce_gradients_(params: Iterable[Tensor], stats: Optional[GradientNoiseScale] = None, process_group=None,
                         backend: str = "auto") -> None:
    """Average the gradients of `params` over the ranks in place (one flat fp32 allreduce)
    and, if `stats` is given, fold this step's statistics into it at the cost of one more
    fp32 slot in the same allreduce. For plain torch loops without DDP."""
    from .comm import get_transport

    tr = get_transport(process_group, backend=backend)
    grads = [p.grad for p in params if p.grad is not None]
    if tr.world_size < 2:
        if stats is not None:
            stats.observe(torch.zeros(1), 1)
        return
    n = sum(g.numel() for g in grads)
    flat = torch.empty(n + (1 if stats is not None else 0), dtype=torch.float32,
                       device=grads[0].device if grads else torch.device("cpu"))
    o = 0
    for g in grads:
        flat[o:o + g.numel()].copy_(g.reshape(-1))
        o += g.numel()
    if stats is not None:
        flat[n:] = stats.measure(grads, exact=True)
    tr.all_reduce(flat, op="mean")
    o = 0
    for g in grads:
        g.copy_(flat[o:o + g.numel()].view_as(g))
        o += g.numel()
    if stats is not None:
        stats.observe(flat[n:], tr.world_size, torch.linalg.vector_norm(flat[:n]).square())


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


# ---------------------------------------------------------------------- DDP
class StatsHookState:
    """State of `stats_hook`: the gradient statistics around any DDP communication hook.

    Per bucket, the hook measures this rank's bucket before `hook` sees it (a pass over the
    bucket; with ``exact=False`` also a coordinate sample of it); at the last bucket the
    measurements of all buckets are averaged over the ranks with ONE small async allreduce
    (a scalar, or the samples). With ``exact=True`` the global norm is read from `hook`'s
    result (a second pass, in the future's callback; the hook must return the exact mean:
    torch's allreduce or fp16 hooks, lbcomm's optimizer hooks in warmup); with
    ``exact=False`` the sampled coordinates give it (any hook, compressed ones included).
    One step's statistics are folded in when the next backward pass starts, or by `flush`
    (call it before reading them). A 1-bit optimizer state in its compression stage
    measures inside its own step (``optimizer.gradient_stats``); the hook then measures
    nothing.

    Args:
        stats (GradientNoiseScale): where to fold the statistics.
        hook (callable): the wrapped hook, hook(hook_state, bucket) -> Future[Tensor].
        hook_state: its state (e.g. None, a PowerSGDState, an lbcomm optimizer).
        exact (bool): see above.
        process_group (optional): the DDP model's group (default: the whole world).

    Example::

        >>> # xdoctest: +SKIP
        >>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        >>> state = lbcomm.stats.StatsHookState(stats, allreduce_hook, None, exact=True)
        >>> ddp_model.register_comm_hook(state, lbcomm.stats.stats_hook)
    """

    __slots__ = ("stats", "hook", "hook_state", "exact", "process_group", "_pending", "_current", "_transport")

    def __init__(self, stats: GradientNoiseScale, hook: Callable, hook_state: Any = None, *, exact: bool,
                 process_group=None):
        self.stats, self.hook, self.hook_state, self.exact = stats, hook, hook_state, bool(exact)
        self.process_group = process_group
        self._pending: Optional[tuple] = None
        self._current: list = []  # this step's (measurement, [global |result|^2]) per bucket
        self._transport = None

    @property
    def transport(self):
        if self._transport is None:
            from .comm import get_transport

            self._transport = get_transport(self.process_group)
        return self._transport

    def __getstate__(self):
        """Pickled without the process group and the step in flight (as torch's PowerSGDState);
        the default group is used after unpickling."""
        return {k: getattr(self, k) for k in ("stats", "hook", "hook_state", "exact")}

    def __setstate__(self, state):
        self.__init__(state["stats"], state["hook"], state["hook_state"], exact=state["exact"])

    def flush(self) -> None:
        """Fold in the last finished step (waits for its small allreduce)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        v, fut, sizes, results = pending
        fut.wait()
        p = self.transport.world_size
        if self.exact:
            self.stats.observe(v[:1], p, sum(float(r[0]) for r in results))
            return
        # per bucket [|g|^2, |x|^2, x]; the buckets' sums add up to the whole gradient's
        local = sub_local = glob = 0.0
        o = 0
        for n in sizes:
            part = v[o:o + n].double()
            local, sub_local, glob = local + float(part[0]), sub_local + float(part[1]), \
                glob + float(part[2:].square().sum())
            o += n
        self.stats.observe(torch.tensor([local, sub_local, math.sqrt(glob)], dtype=torch.float64), p)


def stats_hook(state: StatsHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: `state.hook` with the gradient statistics measured around it
    (see `StatsHookState`)."""
    inner_state = state.hook_state
    if getattr(inner_state, "frozen", False) or state.transport.world_size < 2:
        return state.hook(inner_state, bucket)
    if bucket.index() == 0:
        state.flush()
        state._current = []
    v = state.stats.measure([bucket.buffer()], exact=state.exact)
    result: list = [None]  # the exact result's squared norm, set by the callback (no device sync there)
    state._current.append((v, result))
    if bucket.is_last():
        parts, state._current = state._current, []
        if state.exact:
            vec = torch.stack([m[0] for m, _ in parts]).sum().reshape(1)
        else:
            vec = torch.cat([m for m, _ in parts])
        fut = state.transport.all_reduce(vec, op="mean", async_op=True)
        state._pending = (vec, fut, [m.numel() for m, _ in parts], [r for _, r in parts])
    out = state.hook(inner_state, bucket)
    if not state.exact:
        return out

    def record(f):
        res = f.value()
        t = res[0] if isinstance(res, (list, tuple)) else res
        result[0] = torch.linalg.vector_norm(t, dtype=torch.float32).square()
        return res

    return out.then(record)
