"""What `onebit_hook` compresses besides plain gradients: the per-coordinate weights of
``normalize="warmup"`` estimated over the full-precision start (`GradientStats`), and the
per-unit `Transform` of ``momentum=`` and ``normalize="adaptive"`` with its factored
second-moment statistics (`factored_squares`, `factored_weights`)."""
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..common import ring_allreduce_bytes

__all__ = ["GradientStats", "Transform", "factored_squares", "factored_weights"]

Key = Tuple[int, ...]


class GradientStats:
    """Per-coordinate sum of squares of the averaged gradients of the full-precision start,
    per parameter (by its number, so that DDP's initial and rebuilt bucket layouts add up
    alike), and the weights of a unit made from it (`weights`): the RMS over the start,
    floored at `floor` x the unit's RMS of it (coordinates never or rarely seen get the
    floor; an all-zero unit gets weight 1), rounded to bfloat16. Sync-free (device ops
    only). Every rank accumulates the same averaged gradients, so every rank makes the same
    weights."""

    __slots__ = ("sums", "counts", "moms")

    def __init__(self):
        self.sums: Dict[int, Tensor] = {}
        self.counts: Dict[int, int] = {}
        self.moms: Dict[int, Tensor] = {}  # momentum of the averaged gradients (OneBitHookState(momentum=))

    def add(self, key: Key, numels: List[int], avg: Tensor, momentum: Optional[float] = None) -> None:
        """Add the averaged bucket `avg` holding the parameters `key` of `numels` elements
        (and, with `momentum`, update their momentum m = momentum m + avg, as torch's SGD)."""
        g = avg.detach().float()
        finite = torch.isfinite(g)
        ok = finite.all()  # a device scalar: no sync; an optimizer skips a NaN step, the momentum too
        sq = torch.where(finite, g * g, 0.0)  # a skipped (NaN) bucket adds nothing
        for k, piece, gk in zip(key, sq.split(numels), g.split(numels)):
            acc = self.sums.get(k)
            if acc is None:
                self.sums[k], self.counts[k] = piece.clone(), 1
            else:
                acc.add_(piece)
                self.counts[k] += 1
            if momentum is not None:
                m = self.moms.get(k)
                self.moms[k] = torch.where(ok, gk, 0.0) if m is None else \
                    torch.where(ok, torch.add(gk, m, alpha=momentum), m)

    def start(self, key: Key, shapes: List[Tuple[int, ...]]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """(factored mean squares, momentum) of the unit `key` over the start, each None
        where a parameter's start was not seen; pops them."""
        sums = [self.sums.pop(k, None) for k in key]
        counts = [self.counts.pop(k, 1) for k in key]
        moms = [self.moms.pop(k, None) for k in key]
        stats = None
        if key and all(x is not None for x in sums):
            stats = factored_squares(torch.cat([x / c for x, c in zip(sums, counts)]), shapes, squared=True)
        mom = torch.cat(moms) if key and all(x is not None for x in moms) else None
        return stats, mom

    def weights(self, key: Key, floor: float) -> Optional[Tensor]:
        """The weights of the unit `key`, or None if the start of one of its parameters was
        not seen (a resumed run restores the weights from the checkpoint instead)."""
        if not key or any(k not in self.sums for k in key):
            return None
        rms = torch.cat([self.sums.pop(k).div_(self.counts.pop(k)) for k in key]).sqrt_()
        w = torch.maximum(rms, floor * rms.square().mean().sqrt())
        # bf16: the compressed call reads the weights twice per call, and any w > 0 does (the
        # call divides and multiplies by the same bf16 value, exact in fp32)
        return torch.where(w > 0, w, 1.0).to(torch.bfloat16)

    def state_dict(self) -> List[Dict[str, Any]]:
        return [{"param": k, "sumsq": v, "count": self.counts[k], "momentum": self.moms.get(k)}
                for k, v in self.sums.items()]

    def load_state_dict(self, entries: List[Dict[str, Any]]) -> None:
        self.sums = {int(e["param"]): e["sumsq"].clone() for e in entries}
        self.counts = {int(e["param"]): int(e["count"]) for e in entries}
        self.moms = {int(e["param"]): e["momentum"].clone() for e in entries if e.get("momentum") is not None}


def _matrix(shape: Tuple[int, ...]) -> bool:
    """Factored as rows x columns: at least 2-D with more than one row and column."""
    return len(shape) >= 2 and shape[0] > 1 and math.prod(shape[1:]) > 1


def factored_squares(x: Tensor, shapes: List[Tuple[int, ...]], squared: bool = False) -> Tensor:
    """Second-moment statistics of a unit `x` holding parameters of `shapes` in order: per
    parameter viewed as [shape[0], rest], the sums of x^2 over each row and over each
    column; x^2 itself for the others (biases, norm weights). Concatenated, fp32.
    ``squared``: x already holds the squares."""
    out, at = [], 0
    for shp in shapes:
        n = math.prod(shp)
        piece = x[at:at + n] if squared else x[at:at + n].square()  # per parameter: stays in cache
        at += n
        if _matrix(shp):
            v = piece.view(shp[0], -1)
            out += [v.sum(1), v.sum(0)]
        else:
            out.append(piece)
    return torch.cat(out)


def factored_weights(stats: Tensor, shapes: List[Tuple[int, ...]], floor: float,
                     out: Optional[Tensor] = None) -> Tensor:
    """Per-coordinate weights from `factored_squares` statistics: for a matrix the outer
    product sqrt(r / sum(r)) sqrt(c)^T (the square root of the rank-1 fit r c^T / sum(r)
    of its mean squares, as in Adafactor), sqrt(v) for the others; floored at `floor` x
    the unit's RMS of them (computed from the factors); an all-zero unit gets 1. Written
    into `out` when given (two passes over the weights)."""
    tiny = torch.finfo(torch.float32).tiny
    factors, at, sumsq, numel = [], 0, stats.new_zeros(()), 0
    for shp in shapes:
        if _matrix(shp):
            k = math.prod(shp[1:])
            r, c = stats[at:at + shp[0]], stats[at + shp[0]:at + shp[0] + k]
            at += shp[0] + k
            a = (r / r.sum().clamp(min=tiny)).sqrt()
            b = c.sqrt()
            sumsq = sumsq + a.square().sum() * b.square().sum()
            factors.append((a, b))
            numel += shp[0] * k
        else:
            n = math.prod(shp)
            v = stats[at:at + n].sqrt()
            at += n
            sumsq = sumsq + v.square().sum()
            factors.append((v, None))
            numel += n
    w = torch.empty(numel, dtype=torch.float32, device=stats.device) if out is None else out
    at = 0
    for a, b in factors:
        if b is None:
            w[at:at + a.numel()].copy_(a)
            at += a.numel()
        else:
            torch.outer(a, b, out=w[at:at + a.numel() * b.numel()].view(a.numel(), b.numel()))
            at += a.numel() * b.numel()
    rms = float((sumsq / numel).sqrt())
    if not rms > 0:
        return w.fill_(1.0)
    return w.clamp_min_(floor * rms)


class Transform:
    """What a unit compresses in place of its averaged gradient (OneBitHookState's
    ``momentum=`` and ``normalize="adaptive"``), per rank:

    * momentum mu: x = g + mu m_local (this rank's momentum of its own gradients) is
      compressed, and the unit returns m^_t - mu m^_{t-1} with m^ the decoded mean of the
      ranks' momenta: an SGD with momentum mu then holds exactly m^ in its buffer (1-bit
      Adam's reason to compress the momentum: the compression error of a step enters the
      parameters once, not summed over the momentum's memory). m_local and m^ start from
      the momentum of the averaged gradients over the full-precision start.
    * adaptive: the weights (x / w compressed, decoded times w) are re-estimated every call
      from an EMA (`beta`) of the ranks' mean factored squares of x (`factored_squares`,
      rows + columns per matrix: one small allreduce per call, whose result every rank
      receives bitwise alike, so that every rank makes the same weights), started from the full-precision start's
      averaged gradients. When the weights change the error feedback is rescaled by
      w_old / w_new, so that it stays the same in gradient units (the error-feedback
      telescoping, sum of outputs = sum of the ranks' mean inputs - carried error, holds
      for x, not only for x / w). A non-finite statistic on any rank
      (NaN/Inf in x) skips the call on every rank before any state changes.
    """

    __slots__ = ("momentum", "adaptive", "beta", "floor", "local", "decoded", "ema", "transport", "spare",
                 "scratch")

    def __init__(self, momentum: Optional[float], adaptive: bool, beta: float, floor: float, transport,
                 local: Optional[Tensor] = None, ema: Optional[Tensor] = None):
        self.momentum, self.adaptive, self.beta, self.floor, self.transport = momentum, adaptive, beta, floor, transport
        self.local = local  # this rank's momentum (None: zeros at the first call)
        self.decoded = None if local is None else local.clone()  # m^ of the last call (the same on every rank)
        self.ema = ema  # factored mean squares (adaptive)
        self.spare: Optional[Tensor] = None  # a weights buffer to reuse
        self.scratch: Optional[Tuple[Tensor, Tensor]] = None  # x and d of a call

    def extra_bytes(self, shapes: List[Tuple[int, ...]]) -> int:
        """Bytes per call besides the compressed allreduce: the statistics' allreduce, fp32
        rows + columns per matrix of `shapes`, counted as a ring allreduce."""
        if not self.adaptive or self.transport is None:
            return 0
        numel = sum(shp[0] + math.prod(shp[1:]) if _matrix(shp) else math.prod(shp) for shp in shapes)
        return int(ring_allreduce_bytes(4 * numel, self.transport.world_size))

    def reduce(self, unit, t: Tensor) -> bool:
        """Reduce the unit's gradient `t` in place; True if skipped for NaN/Inf on some rank.
        Works in two scratch buffers swapped with the state's (no allocation per call)."""
        g = t.detach().float()
        mu = self.momentum
        if self.scratch is None or self.scratch[0].shape != g.shape or self.scratch[0].device != g.device:
            self.scratch = (torch.empty_like(g), torch.empty_like(g))
        x, d = self.scratch
        if mu is not None:
            if self.local is None:
                self.local, self.decoded = torch.zeros_like(g), torch.zeros_like(g)
            torch.add(g, self.local, alpha=mu, out=x)
        else:
            x.copy_(g)
        if self.adaptive:
            # the same bits on every rank (an allreduce's result is), and each rank sends
            # O(rows + columns) bytes whatever the world size
            total = factored_squares(x, unit.shapes)
            self.transport.all_reduce(total, "sum")
            total = total / self.transport.world_size
            if not bool(torch.isfinite(total).all()):
                return True
            self.ema = total if self.ema is None else torch.add(total * (1 - self.beta), self.ema, alpha=self.beta)
            w = factored_weights(self.ema, unit.shapes, self.floor, out=self.spare)
            self.spare = unit.weights  # the weights of the last call: the next call writes over them
            if self.spare is not None:
                unit.rescale_errors(self.spare / w)
            unit.weights = w
        unit.mean_(x, out=d)
        if unit.last_skipped:
            return True
        if mu is None:
            t.copy_(d)
            return False
        if t.dtype == torch.float32:
            torch.sub(d, self.decoded, alpha=mu, out=t)
        else:
            t.copy_(torch.sub(d, self.decoded, alpha=mu))
        # x is the new momentum and d the new decoded one; the old buffers become scratch
        self.scratch = (self.local, self.decoded)
        self.local, self.decoded = x, d
        return False

    def state_dict(self) -> Dict[str, Any]:
        copy = lambda v: None if v is None else v.clone()  # noqa: E731 - the buffers are reused in place
        return {"momentum": self.momentum, "adaptive": self.adaptive, "local": copy(self.local),
                "decoded": copy(self.decoded), "ema": copy(self.ema)}

    def load_state_dict(self, sd: Dict[str, Any], device) -> None:
        to = lambda v: None if v is None else v.to(device, copy=True)  # noqa: E731 - reused in place
        self.local, self.decoded, self.ema = to(sd.get("local")), to(sd.get("decoded")), to(sd.get("ema"))

