"""The gradient noise estimators and `GradientNoiseScale`, the statistics every source
feeds (see `lbcomm.stats` for the estimators and their sources)."""
import logging
import math
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["noise_estimates", "adascale_gain", "GradientNoiseScale", "allreduce_gradients_"]

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
    from ..comm import get_transport

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
