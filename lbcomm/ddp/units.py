"""Which error feedback reduces which DDP bucket (`BucketPlanner`) and how one of them
reduces its gradients (`Unit`). Internal to lbcomm.ddp; `OneBitHookState` holds a planner.

A unit is one compressed tensor with its own error feedback (a `lbcomm.reducer.Reducer`):
the gradients of a fixed list of parameters, in order. A unit is keyed by the parameters'
numbers (the order in which DDP's first iteration showed them), not by bucket index, so
that a checkpoint outlives DDP's rebuild of its buckets. The FSDP2/HSDP hook reduces each
parameter group's gradient shard with a unit too.
"""
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..compressed import NonFiniteError
from ..exact import ExactMean, exact_index
from .normalize import Transform

__all__ = ["Unit", "BucketPlanner", "redistribute_units"]

_log = logging.getLogger(__name__)

Key = Tuple[int, ...]
# (offset, numel) of each parameter of a unit inside a bucket that holds several units
Slices = List[Tuple[int, int]]
Plan = List[Tuple["Unit", Optional[Slices]]]


class Unit:
    """One compressed tensor: the gradients of the parameters `key` (of `shapes`), in
    order, its error feedback (`compression`, a Reducer) and its per-coordinate weights
    (`weights`, or None): the unit compresses g / weights and decodes times weights, so
    that the compression noise of a coordinate is proportional to its own weight rather
    than to its block's largest gradients. The weights are the same on every rank.

    ``fused``: the reducer takes the weights inside its own passes (the flat compressed
    call); otherwise (the hierarchical one) they are applied in separate passes.
    """

    __slots__ = ("key", "shapes", "compression", "weights", "transform", "last_skipped", "exact", "exact_mean",
                 "fused")

    def __init__(self, key: Key, shapes: List[Tuple[int, ...]], compression, weights: Optional[Tensor] = None,
                 fused: bool = True):
        self.key, self.shapes, self.compression, self.weights = key, shapes, compression, weights
        self.fused = fused
        self.transform: Optional[Transform] = None  # momentum / adaptive weights, see Transform
        self.last_skipped = False
        # (max numel, index or None): the coordinates of the parameters of at most max numel
        # elements, averaged exactly (`exact_mean`) instead of compressed
        self.exact: Optional[Tuple[int, Optional[Tensor]]] = None
        self.exact_mean: Optional[ExactMean] = None

    def set_exact(self, max_numel: int, mean: ExactMean, device: torch.device,
                  whole: Optional[Sequence[int]] = None) -> None:
        """Average the parameters of at most `max_numel` elements exactly with `mean` (0:
        none, every parameter compressed). `whole`: per piece of the unit, the numel of the
        parameter it belongs to (a shard of it, for FSDP; default: the piece's own)."""
        self.exact_mean = mean
        if self.exact is not None and self.exact[0] == max_numel:
            return
        numels = [int(torch.Size(shp).numel()) for shp in self.shapes]
        self.exact = (max_numel, exact_index(numels, max_numel, whole=whole, device=device))

    def exact_numel(self) -> int:
        index = self.exact[1] if self.exact is not None else None
        return 0 if index is None else index.numel()

    def fully_exact(self) -> bool:
        """Every parameter of the unit is averaged exactly: no compressed call at all."""
        return self.exact_numel() == self.compression.numel

    def bytes_per_call(self) -> int:
        """What this rank sends per call: the compressed call (unless fully exact), the
        exact mean and the transform's statistics."""
        sent = 0 if self.fully_exact() else self.compression.bytes_per_call()
        if self.exact_mean is not None:
            sent += self.exact_mean.bytes(self.exact_numel())
        if self.transform is not None and not self.fully_exact():
            sent += self.transform.extra_bytes(self.shapes)
        return sent

    def reduce(self, buf: Tensor, slices: Optional[Slices]) -> None:
        """Compressed allreduce of this unit's gradients in `buf`, in place: all of `buf`
        (slices None) or the given slices of it. ``last_skipped`` tells whether the call
        was skipped for NaN/Inf on some rank (every rank alike; `buf` is then untouched)."""
        run = self.mean_ if self.transform is None else self._transformed
        if slices is None:
            run(buf)
            return
        flat = torch.cat([buf[o:o + n] for o, n in slices])
        run(flat)
        at = 0
        for o, n in slices:
            buf[o:o + n].copy_(flat[at:at + n])
            at += n

    def _transformed(self, t: Tensor) -> None:
        skipped = self.transform.reduce(self, t)
        self.last_skipped = skipped or self.compression.last_skipped

    def mean_(self, t: Tensor, out: Optional[Tensor] = None) -> None:
        """t (or, given, `out`: then t is left alone) <- the compressed mean of t, with the
        exact coordinates (`set_exact`) replaced by their exact mean and their error
        feedback kept at zero. Their mean runs beside the compressed call; they stay in its
        input, so its NaN/Inf consensus covers them (a non-finite value on any rank skips
        the call on every rank before anything changes)."""
        index = self.exact[1] if self.exact is not None else None
        if index is None:
            self._compressed(t, out)
            return
        dst = t if out is None else out
        exact = t.index_select(0, index).float()  # before the compressed call writes over t
        wait = self.exact_mean.start(exact)
        if self.fully_exact():  # no compressed call to check the values: a consensus of its own
            self.last_skipped = not bool(torch.isfinite(wait()).all())
            if self.last_skipped and self.compression.nonfinite == "raise":
                raise NonFiniteError("onebit_hook: a parameter averaged exactly (exact_numel) holds NaN or Inf on "
                                     "at least one rank")
            if not self.last_skipped:
                dst.copy_(exact)
            return
        try:
            self._compressed(t, out)
        finally:
            wait()  # also when the compressed call raised: no collective left in flight
        if self.last_skipped:
            return
        dst.index_copy_(0, index, exact.to(t.dtype))
        self.compression.zero_errors_at(index)  # they never enter the error feedback

    def _compressed(self, t: Tensor, out: Optional[Tensor]) -> None:
        w = self.weights
        if self.fused and (w is None or t.dtype == torch.float32):
            # the weights fused into the compression's own passes (bitwise as divide, reduce, multiply)
            self.compression.reduce_(t, t if out is None else out, weights=w)
            self.last_skipped = self.compression.last_skipped
            return
        if out is not None:
            out.copy_(t)
            t = out
        # hierarchical (intra-node mean first) or half gradients: separate passes
        if w is not None:
            t.div_(w)
        self.compression.reduce_(t, t)
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

    def number(self, bucket: dist.GradBucket) -> Tuple[Key, List[Tensor]]:
        """The key of the bucket's parameters (numbered as first seen) and its parameters."""
        params = bucket.parameters()
        num = self._numbers
        return tuple(num.setdefault(id(p), len(num)) for p in params), params

    def units(self) -> List[Unit]:
        return list(self._units.values())

    def num_saved(self) -> int:
        """Loaded units not matched to a bucket yet."""
        return len(self._saved)

    def plan(self, bucket: dist.GradBucket, key: Key, params: List[Tensor],
             new_compression: Callable[[int, torch.device], Any],
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



def redistribute_units(saved: Sequence[List[Dict[str, Any]]], world: int, rank: int,
                       redistribute: Callable[[Sequence[Dict[str, Any]], int, int], Dict[str, Any]]
                       ) -> List[Dict[str, Any]]:
    """The `BucketPlanner.state_dict` entries of `rank` in a world of `world` ranks from
    every saved rank's entries, in rank order (elastic resume): each unit's error feedback
    through `redistribute` (the reducer's, e.g. `CompressionState.redistribute`: the total
    carried error is preserved), the momentum of a `Transform` as the mean of the saved
    ranks' (what they compress together); the weights and the decoded momentum are the same
    on every rank. The error feedback of hierarchical units belongs to one node shape: it
    is dropped (reset) with a warning."""
    per_rank = [{tuple(e["params"]): e for e in units} for units in saved]
    if any(set(units) != set(per_rank[0]) for units in per_rank):
        raise ValueError("the saved ranks hold different units; pass the state_dicts of one checkpoint")
    out, dropped = [], 0
    for key, entry in per_rank[0].items():
        shards = [units[key]["compression"] for units in per_rank]
        if "layout" in shards[0]:  # a hierarchical reducer's: its layout depends on the node shape
            dropped += 1
            continue
        tr = entry.get("transform")
        if tr is not None and tr.get("local") is not None:  # every new rank: the mean of the saved momenta
            tr = {**tr, "local": torch.stack([units[key]["transform"]["local"].double() for units in per_rank])
                  .mean(0).float()}
        out.append({"params": list(key), "shapes": entry["shapes"], "compression": redistribute(shards, world, rank),
                    "weights": entry.get("weights"), "transform": tr})
    if dropped:
        _log.warning("onebit_hook: %s hierarchical unit(s) cannot be redistributed onto another world size; their "
                     "error feedback is reset to zero", dropped)
    _log.info("onebit_hook: the error feedback of %s unit(s) saved by %s ranks was redistributed onto %s ranks (its "
              "total is preserved)", len(out), len(saved), world)
    return out
