"""The machinery behind `onebit_hook`: which error feedback reduces which DDP bucket
(`BucketPlanner`), and the thread that runs the compressed allreduces in bucket order
(`BucketWorker`). Internal to lbcomm.ddp; `OneBitHookState` holds one of each.

A unit is one compressed tensor with its own error feedback: the gradients of a fixed
list of parameters, in order. A unit is keyed by the parameters' numbers (the order in
which DDP's first iteration showed them), not by bucket index, so that a checkpoint
outlives DDP's rebuild of its buckets.
"""
import logging
import math
import queue
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import get_transport, world_info
from ..common import new_future
from ..compressed import CompressionState, NonFiniteError, compressed_allreduce
from ..topology import HierarchicalState, hierarchical_allreduce_, hierarchical_mean_

__all__ = ["Unit", "GradientStats", "Transform", "BucketPlanner", "BucketWorker", "factored_squares",
           "factored_weights"]

_log = logging.getLogger(__name__)

Key = Tuple[int, ...]
# (offset, numel) of each parameter of a unit inside a bucket that holds several units
Slices = List[Tuple[int, int]]
Plan = List[Tuple["Unit", Optional[Slices]]]


class Unit:
    """One compressed tensor: the gradients of the parameters `key` (of `shapes`), in
    order, its error feedback (`compression`) and its per-coordinate weights (`weights`,
    or None): the unit compresses g / weights and decodes times weights, so that the
    compression noise of a coordinate is proportional to its own weight rather than to its
    block's largest gradients. The weights are the same on every rank."""

    __slots__ = ("key", "shapes", "compression", "weights", "transform", "last_skipped", "exact", "exact_transport")

    def __init__(self, key: Key, shapes: List[Tuple[int, ...]], compression: CompressionState,
                 weights: Optional[Tensor] = None):
        self.key, self.shapes, self.compression, self.weights = key, shapes, compression, weights
        self.transform: Optional["Transform"] = None  # momentum / adaptive weights, see Transform
        self.last_skipped = False
        # (max numel, index or None): the coordinates of the parameters of at most max numel
        # elements, averaged exactly (fp32 allreduce on `exact_transport`) instead of compressed
        self.exact: Optional[Tuple[int, Optional[Tensor]]] = None
        self.exact_transport = None

    def set_exact(self, max_numel: int, group, device: torch.device, whole: Optional[List[int]] = None) -> None:
        """Average the parameters of at most `max_numel` elements exactly, on `group` (0:
        none, every parameter compressed). `whole`: per piece of the unit, the numel of the
        parameter it belongs to (a shard of it, for FSDP; default: the piece's own)."""
        if self.exact_transport is None or self.exact_transport.group is not group:
            self.exact_transport = get_transport(group, backend="torch")
        if self.exact is not None and self.exact[0] == max_numel:
            return
        spans, at = [], 0
        for k, shp in enumerate(self.shapes):
            n = math.prod(shp)
            if n and 0 < (n if whole is None else whole[k]) <= max_numel:
                spans.append(torch.arange(at, at + n))
            at += n
        index = torch.cat(spans).to(device) if spans else None
        self.exact = (max_numel, index)

    def exact_numel(self) -> int:
        index = self.exact[1] if self.exact is not None else None
        return 0 if index is None else index.numel()

    def fully_exact(self) -> bool:
        """Every parameter of the unit is averaged exactly: no compressed call at all."""
        return self.exact_numel() == self.compression.numel

    def reduce(self, buf: Tensor, slices: Optional[Slices]) -> CompressionState:
        """Compressed allreduce of this unit's gradients in `buf`, in place: all of `buf`
        (slices None) or the given slices of it. ``last_skipped`` tells whether the call
        was skipped for NaN/Inf on some rank (every rank alike; `buf` is then untouched)."""
        run = self._allreduce if self.transform is None else self._transformed
        if slices is None:
            run(buf)
            return self.compression
        flat = torch.cat([buf[o:o + n] for o, n in slices])
        run(flat)
        at = 0
        for o, n in slices:
            buf[o:o + n].copy_(flat[at:at + n])
            at += n
        return self.compression

    def _transformed(self, t: Tensor) -> None:
        skipped = self.transform.reduce(self, t)
        self.last_skipped = skipped or self.compression.last_skipped

    def _allreduce(self, t: Tensor, out: Optional[Tensor] = None) -> None:
        """t (or, given, `out`: then t is left alone) <- the compressed mean of t, with the
        exact coordinates (`set_exact`) replaced by their exact mean and their error
        feedback kept at zero. Their fp32 allreduce runs beside the compressed call; they
        stay in its input, so its NaN/Inf consensus covers them (a non-finite value on any
        rank skips the call on every rank before anything changes)."""
        index = self.exact[1] if self.exact is not None else None
        if index is None:
            self._compressed(t, out)
            return
        dst = t if out is None else out
        exact = t.index_select(0, index).float()  # before the compressed call writes over t
        st = self.compression
        if isinstance(st, HierarchicalState) and not st.topology.flat:
            work = None  # the mean across nodes at 1/G of a flat allreduce's inter-node bytes
            hierarchical_mean_(exact, st.topology)
        else:
            work = self.exact_transport.all_reduce(exact, "mean", async_op=True)

        def mean() -> Tensor:
            if work is not None:
                work.wait()
            return exact

        if self.fully_exact():  # no compressed call to check the values: a consensus of its own
            self.last_skipped = not bool(torch.isfinite(mean()).all())
            if self.last_skipped and self.compression.nonfinite == "raise":
                raise NonFiniteError("onebit_hook: a parameter averaged exactly (exact_numel) holds NaN or Inf on "
                                     "at least one rank")
            if not self.last_skipped:
                dst.copy_(exact)
            return
        try:
            self._compressed(t, out)
        finally:
            mean()  # also when the compressed call raised: no collective left in flight
        if self.last_skipped:
            return
        dst.index_copy_(0, index, exact.to(t.dtype))
        self.compression.zero_errors_at(index)  # flat or hierarchical: they never enter the error feedback

    def _compressed(self, t: Tensor, out: Optional[Tensor]) -> None:
        w = self.weights
        if not isinstance(self.compression, HierarchicalState) and (w is None or t.dtype == torch.float32):
            # the weights fused into the compression's own passes (bitwise as divide, reduce, multiply)
            compressed_allreduce(t, self.compression, out=t if out is None else out, weights=w)
            self.last_skipped = self.compression.last_skipped
            return
        if out is not None:
            out.copy_(t)
            t = out
        # hierarchical (intra-node mean first) or half gradients: separate passes
        if w is not None:
            t.div_(w)
        if isinstance(self.compression, HierarchicalState):
            hierarchical_allreduce_(t, self.compression)
        else:
            compressed_allreduce(t, self.compression, out=t)
        if w is not None:
            t.mul_(w)
        self.last_skipped = self.compression.last_skipped

    def rescale_errors(self, ratio: Tensor) -> None:
        """Multiply the error feedback of every coordinate by `ratio` (numel): it is kept
        in the units of the weights, which then change from w_old to w_new with ratio =
        w_old / w_new, so that the carried error stays the same in gradient units (flat
        CompressionState only: the worker error holds the padded tensor, the server error
        this rank's chunk)."""
        st = self.compression
        st.worker_error[:st.numel].mul_(ratio)
        lo, hi = st.served_span()
        st.server_error[:hi - lo].mul_(ratio[lo:hi])


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
      rows + columns per matrix: one small reduce + broadcast per call, so that every
      rank makes the same weights), started from the full-precision start's
      averaged gradients. When the weights change the error feedback is rescaled by
      w_old / w_new, so that it stays the same in gradient units (the error-feedback
      telescoping, sum of outputs = sum of the ranks' mean inputs - carried error, holds
      for x, not only for x / w). A non-finite statistic on any rank
      (NaN/Inf in x) skips the call on every rank before any state changes.
    """

    __slots__ = ("momentum", "adaptive", "beta", "floor", "local", "decoded", "ema", "group", "spare", "scratch")

    def __init__(self, momentum: Optional[float], adaptive: bool, beta: float, floor: float, group,
                 local: Optional[Tensor] = None, ema: Optional[Tensor] = None):
        self.momentum, self.adaptive, self.beta, self.floor, self.group = momentum, adaptive, beta, floor, group
        self.local = local  # this rank's momentum (None: zeros at the first call)
        self.decoded = None if local is None else local.clone()  # m^ of the last call (the same on every rank)
        self.ema = ema  # factored mean squares (adaptive)
        self.spare: Optional[Tensor] = None  # a weights buffer to reuse
        self.scratch: Optional[Tuple[Tensor, Tensor]] = None  # x and d of a call

    def extra_bytes(self, unit: "Unit") -> int:
        """Bytes per call besides the compressed allreduce: the statistics' reduce and
        broadcast, counted as two fp32 vectors of rows + columns (what a rank sends at
        most in a tree; the first rank of a flat broadcast sends more)."""
        if not self.adaptive or self.group is None:
            return 0
        return 2 * 4 * sum(shp[0] + math.prod(shp[1:]) if _matrix(shp) else math.prod(shp) for shp in unit.shapes)

    def reduce(self, unit: "Unit", t: Tensor) -> bool:
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
            # summed on the group's first rank and broadcast from it: the same bits on every
            # rank, and each rank sends O(rows + columns) bytes whatever the world size
            total = factored_squares(x, unit.shapes)
            root = dist.get_global_rank(self.group, 0)
            dist.reduce(total, dst=root, group=self.group)
            dist.broadcast(total, src=root, group=self.group)
            total = total / dist.get_world_size(self.group)
            if not bool(torch.isfinite(total).all()):
                return True
            self.ema = total if self.ema is None else torch.add(total * (1 - self.beta), self.ema, alpha=self.beta)
            w = factored_weights(self.ema, unit.shapes, self.floor, out=self.spare)
            self.spare = unit.weights  # the weights of the last call: the next call writes over them
            if self.spare is not None:
                unit.rescale_errors(self.spare / w)
            unit.weights = w
        unit._allreduce(x, out=d)
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


class BucketPlanner:
    """Maps DDP buckets to units.

    Normally a bucket is one unit. In the first iteration of a DDP model resumed from a
    checkpoint DDP still has its initial buckets, which hold several of the saved (rebuilt)
    units: such a bucket is reduced unit by unit, so that the run continues bitwise as if
    it had never stopped. A bucket that matches neither starts a new unit (its parameters'
    earlier errors are dropped with a warning).

    ``bucket_units``: bucket index -> keys of the units that reduced it last.
    """

    __slots__ = ("bucket_units", "_units", "_saved", "_numbers")

    def __init__(self):
        self.bucket_units: Dict[int, Tuple[Key, ...]] = {}
        self._units: Dict[Key, Unit] = {}
        self._saved: Dict[Key, Dict[str, Any]] = {}  # loaded entries not yet matched to a bucket
        self._numbers: Dict[int, int] = {}  # id(param) -> its number

    def number(self, bucket: dist.GradBucket) -> Tuple[Key, List[Tensor], List[Tensor]]:
        """The key of the bucket's parameters, its parameters, and those of them seen for
        the first time (numbered now)."""
        params = bucket.parameters()
        num = self._numbers
        seen = len(num)
        key = tuple(num.setdefault(id(p), len(num)) for p in params)
        return key, params, [p for k, p in zip(key, params) if k >= seen]

    def units(self) -> List[Unit]:
        return list(self._units.values())

    def num_saved(self) -> int:
        """Loaded units not matched to a bucket yet."""
        return len(self._saved)

    def plan(self, bucket: dist.GradBucket, key: Key, params: List[Tensor],
             new_compression: Callable[[int, torch.device], CompressionState],
             new_weights: Callable[[Key], Optional[Tensor]] = lambda key: None) -> Plan:
        """[(unit, None)] to reduce the whole bucket, or [(unit, slices), ...] to reduce it as
        several saved units; `key` and `params` are `number`'s, `new_compression(numel,
        device)` makes the state of a new unit and `new_weights(key)` its weights (saved
        units keep their saved weights)."""
        buf = bucket.buffer()
        index = bucket.index()
        unit = self._units.get(key)
        if unit is None and key in self._saved:
            unit = self._make_unit(key, params, buf.device, new_compression, self._saved.pop(key))
        if unit is not None:
            self.bucket_units[index] = (key,)
            return [(unit, None)]
        where, offset = {}, 0
        for k, p in zip(key, params):
            where[k] = (offset, p.numel(), p)
            offset += p.numel()
        candidates = [k for k in (*self._units, *self._saved) if k and k[0] in where]
        covered = [k for k in candidates if all(x in where for x in k)]
        if covered and sorted(x for k in covered for x in k) == sorted(key):
            plan = []
            for k in covered:
                unit = self._units.get(k)
                if unit is None:
                    unit = self._make_unit(k, [where[x][2] for x in k], buf.device, new_compression,
                                           self._saved.pop(k))
                plan.append((unit, [where[x][:2] for x in k]))
            self.bucket_units[index] = tuple(covered)
            return plan
        stale = [k for k in (*self._units, *self._saved) if any(x in where for x in k)]
        if stale:
            _log.warning("onebit_hook: bucket %s holds parameters whose error feedback belongs to another bucket "
                         "layout (%s earlier units); their errors are reset to zero", index, len(stale))
            for k in stale:
                self._units.pop(k, None)
                self._saved.pop(k, None)
        unit = self._make_unit(key, params, buf.device, new_compression, None)
        unit.weights = new_weights(key)
        self.bucket_units[index] = (key,)
        return [(unit, None)]

    def _make_unit(self, key: Key, params: List[Tensor], device, new_compression,
                   saved: Optional[Dict[str, Any]]) -> Unit:
        state = new_compression(sum(p.numel() for p in params), device)
        unit = Unit(key, [tuple(p.shape) for p in params], state)
        if saved is not None:
            if [tuple(s) for s in saved["shapes"]] != unit.shapes:
                _log.warning("onebit_hook: the saved error feedback of parameters %s belongs to parameters of other "
                             "shapes; it is reset to zero", list(key))
            else:
                state.load_state_dict(saved["compression"])  # warns and resets on another world size
                w = saved.get("weights")
                unit.weights = None if w is None else w.to(device, copy=True)  # adaptive weights are rewritten
                if saved.get("transform") is not None:  # completed by the hook's settings (OneBitHookState)
                    unit.transform = Transform(None, False, 0.0, 0.0, None)
                    unit.transform.load_state_dict(saved["transform"], device)
        self._units[key] = unit
        return unit

    def state_dict(self) -> List[Dict[str, Any]]:
        """Every unit's error feedback, the unmatched loaded ones included."""
        units = [{"params": list(u.key), "shapes": list(u.shapes), "compression": u.compression.state_dict(),
                  "weights": None if u.weights is None else u.weights.clone(),  # adaptive ones are rewritten
                  "transform": None if u.transform is None else u.transform.state_dict()}
                 for u in self._units.values()]
        return units + [{"params": list(k), **entry} for k, entry in self._saved.items()]

    def load_state_dict(self, entries: List[Dict[str, Any]]) -> None:
        """Drop the current units; `entries` (from `state_dict`) are matched to buckets as
        they appear. The parameter numbering is kept."""
        self._units.clear()
        self.bucket_units.clear()
        self._saved = {tuple(e["params"]): {"shapes": e["shapes"], "compression": e["compression"],
                                            "weights": e.get("weights"), "transform": e.get("transform")}
                       for e in entries}


class BucketWorker:
    """Runs bucket reductions on one background thread, in submission (bucket) order, so
    that every rank issues its collectives in the same order; `group` is a private
    duplicate of the DDP process group, so that they never interleave with DDP's own
    collectives (e.g. find_unused_parameters) or the user's. The thread starts with the
    first job and ends when the worker is collected.
    """

    __slots__ = ("world_size", "group", "_jobs", "_inflight", "_lock", "_streams", "__weakref__")

    def __init__(self, process_group=None):
        self.world_size = world_info(process_group)[0]
        self.group = None
        if self.world_size > 1:
            base = process_group if process_group is not None else dist.group.WORLD
            self.group = dist.new_group(ranks=dist.get_process_group_ranks(base), backend=dist.get_backend(base),
                                        use_local_synchronization=True)
        self._jobs: Optional[queue.SimpleQueue] = None
        self._inflight = 0
        self._lock = threading.Lock()
        self._streams: Dict[torch.device, Any] = {}

    def busy(self) -> int:
        """Jobs submitted and not finished."""
        with self._lock:
            return self._inflight

    def submit(self, buf: Tensor, run: Callable[[Tensor], None]) -> torch.futures.Future[torch.Tensor]:
        """Call ``run(buf)`` on the thread after the jobs before it; the future completes
        with `buf` (or `run`'s exception). For CUDA, the job waits on the GPU for the work
        queued on the current stream, and runs on a side stream."""
        event = None
        if buf.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(buf.device))  # the bucket is ready here
        fut = new_future(buf.device)
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._jobs, torch.get_num_threads()),
                                      name="lbcomm-onebit-hook", daemon=True)
            thread.start()
            # The thread ends with the worker, and at the latest at exit (weakref.finalize
            # runs its callbacks from atexit): a daemon thread still inside a torch op when
            # the interpreter finalizes would abort the process as it takes the GIL back.
            weakref.finalize(self, _stop, self._jobs, thread)
        with self._lock:
            self._inflight += 1
        self._jobs.put((fut, buf, run, event))
        return fut

    def _stream(self, device: torch.device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _finish(self) -> None:
        with self._lock:
            self._inflight -= 1


_STOP_TIMEOUT_S = 60.0


def _stop(jobs: queue.SimpleQueue, thread: threading.Thread) -> None:
    """End a BucketWorker's thread after the jobs already queued, and wait for it (unless
    called on it: the worker's last reference can be dropped there). Bounded, so that a
    job stuck on a collective (a rank died) cannot hang the exit."""
    jobs.put(None)
    if thread is not threading.current_thread():
        thread.join(_STOP_TIMEOUT_S)
        if thread.is_alive():
            _log.warning("onebit_hook: a bucket reduction was still running %.0f s after the end of the job (a rank "
                         "stopped taking part?); exiting with it in flight", _STOP_TIMEOUT_S)


def _serve(ref, jobs: queue.SimpleQueue, threads: int) -> None:
    """The thread of a BucketWorker. Holds the worker weakly. Its torch ops use the
    submitting thread's intra-op thread count (OpenMP's is per thread: a new thread would
    otherwise take every core, and ranks sharing cores would oversubscribe them)."""
    torch.set_num_threads(threads)
    while True:
        job = jobs.get()
        worker = ref() if job is not None else None
        if worker is None:
            return
        fut, buf, run, event = job
        error: Optional[BaseException] = None
        stream = worker._stream(buf.device) if event is not None else None
        try:
            if stream is None:
                run(buf)
            else:
                with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                    stream.wait_event(event)  # a GPU-side wait for the bucket, not a host sync
                    run(buf)
        except BaseException as exc:  # noqa: BLE001 - handed to DDP through the future
            error = exc
        worker._finish()  # idle before DDP can see the result
        del worker
        if error is not None:
            fut.set_exception(error)
        elif stream is None:
            fut.set_result(buf)
        else:
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                fut.set_result(buf)  # DDP's stream waits for this one
        # Hold nothing between jobs: a finished job keeps the units, their process group
        # and the bucket alive, and an idle daemon thread must not outlive them at exit.
        del job, fut, buf, run, event, error, stream
