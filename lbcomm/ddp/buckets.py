"""The machinery behind `onebit_hook`: which error feedback reduces which DDP bucket
(`BucketPlanner`), and the thread that runs the compressed allreduces in bucket order
(`BucketWorker`). Internal to lbcomm.ddp; `OneBitHookState` holds one of each.

A unit is one compressed tensor with its own error feedback: the gradients of a fixed
list of parameters, in order. A unit is keyed by the parameters' numbers (the order in
which DDP's first iteration showed them), not by bucket index, so that a checkpoint
outlives DDP's rebuild of its buckets.
"""
import logging
import queue
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import world_info
from ..common import new_future
from ..compressed import CompressionState, compressed_allreduce
from ..topology import HierarchicalState, hierarchical_allreduce_

__all__ = ["Unit", "GradientStats", "BucketPlanner", "BucketWorker"]

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

    __slots__ = ("key", "shapes", "compression", "weights")

    def __init__(self, key: Key, shapes: List[Tuple[int, ...]], compression: CompressionState,
                 weights: Optional[Tensor] = None):
        self.key, self.shapes, self.compression, self.weights = key, shapes, compression, weights

    def reduce(self, buf: Tensor, slices: Optional[Slices]) -> CompressionState:
        """Compressed allreduce of this unit's gradients in `buf`, in place: all of `buf`
        (slices None) or the given slices of it."""
        if slices is None:
            self._allreduce(buf)
            return self.compression
        flat = torch.cat([buf[o:o + n] for o, n in slices])
        self._allreduce(flat)
        at = 0
        for o, n in slices:
            buf[o:o + n].copy_(flat[at:at + n])
            at += n
        return self.compression

    def _allreduce(self, t: Tensor) -> None:
        w = self.weights
        if not isinstance(self.compression, HierarchicalState) and (w is None or t.dtype == torch.float32):
            # the weights fused into the compression's own passes (bitwise as divide, reduce, multiply)
            compressed_allreduce(t, self.compression, out=t, weights=w)
            return
        # hierarchical (intra-node mean first) or half gradients: separate passes
        if w is not None:
            t.div_(w)
        if isinstance(self.compression, HierarchicalState):
            hierarchical_allreduce_(t, self.compression)
        else:
            compressed_allreduce(t, self.compression, out=t)
        if w is not None:
            t.mul_(w)


class GradientStats:
    """Per-coordinate sum of squares of the averaged gradients of the full-precision start,
    per parameter (by its number, so that DDP's initial and rebuilt bucket layouts add up
    alike), and the weights of a unit made from it (`weights`): the RMS over the start,
    floored at `floor` x the unit's RMS of it (coordinates never or rarely seen get the
    floor; an all-zero unit gets weight 1). Sync-free (device ops only). Every rank
    accumulates the same averaged gradients, so every rank makes the same weights."""

    __slots__ = ("sums", "counts")

    def __init__(self):
        self.sums: Dict[int, Tensor] = {}
        self.counts: Dict[int, int] = {}

    def add(self, key: Key, numels: List[int], avg: Tensor) -> None:
        """Add the averaged bucket `avg` holding the parameters `key` of `numels` elements."""
        g = avg.detach().float()
        sq = torch.where(torch.isfinite(g), g * g, 0.0)  # a skipped (NaN) bucket adds nothing
        for k, piece in zip(key, sq.split(numels)):
            acc = self.sums.get(k)
            if acc is None:
                self.sums[k], self.counts[k] = piece.clone(), 1
            else:
                acc.add_(piece)
                self.counts[k] += 1

    def weights(self, key: Key, floor: float) -> Optional[Tensor]:
        """The weights of the unit `key`, or None if the start of one of its parameters was
        not seen (a resumed run restores the weights from the checkpoint instead)."""
        if not key or any(k not in self.sums for k in key):
            return None
        rms = torch.cat([self.sums.pop(k).div_(self.counts.pop(k)) for k in key]).sqrt_()
        w = torch.maximum(rms, floor * rms.square().mean().sqrt())
        return torch.where(w > 0, w, 1.0)

    def state_dict(self) -> List[Dict[str, Any]]:
        return [{"param": k, "sumsq": v, "count": self.counts[k]} for k, v in self.sums.items()]

    def load_state_dict(self, entries: List[Dict[str, Any]]) -> None:
        self.sums = {int(e["param"]): e["sumsq"].clone() for e in entries}
        self.counts = {int(e["param"]): int(e["count"]) for e in entries}


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
                unit.weights = None if w is None else w.to(device)
        self._units[key] = unit
        return unit

    def state_dict(self) -> List[Dict[str, Any]]:
        """Every unit's error feedback, the unmatched loaded ones included."""
        units = [{"params": list(u.key), "shapes": list(u.shapes), "compression": u.compression.state_dict(),
                  "weights": u.weights} for u in self._units.values()]
        return units + [{"params": list(k), **entry} for k, entry in self._saved.items()]

    def load_state_dict(self, entries: List[Dict[str, Any]]) -> None:
        """Drop the current units; `entries` (from `state_dict`) are matched to buckets as
        they appear. The parameter numbering is kept."""
        self._units.clear()
        self.bucket_units.clear()
        self._saved = {tuple(e["params"]): {"shapes": e["shapes"], "compression": e["compression"],
                                            "weights": e.get("weights")} for e in entries}


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
            threading.Thread(target=_serve, args=(weakref.ref(self), self._jobs), name="lbcomm-onebit-hook",
                             daemon=True).start()
            weakref.finalize(self, self._jobs.put, None)  # the thread ends with the worker
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


def _serve(ref, jobs: queue.SimpleQueue) -> None:
    """The thread of a BucketWorker. Holds the worker weakly."""
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
