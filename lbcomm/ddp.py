"""DDP communication hooks (DESIGN.md §4), torch's contract: ``hook(state, bucket) -> Future[Tensor]``.

* `onebit_optimizer_hook` (and `onebit_optimizer_fp16_hook`): registered with a OneBit
  optimizer as its state. During the optimizer's warmup the bucket is averaged at full
  precision (fp16 on the wire for the fp16 variant) and the optimizer is told that its
  gradients arrive averaged, so it does not reduce them again; once the optimizer has
  frozen its variance the hook communicates nothing at all and the gradients stay local
  (the optimizer compresses its momentum instead).
* `onebit_hook` with a `OneBitHookState`: 1-bit error-feedback compressed allreduce of
  every bucket, for any optimizer.

Example::

    >>> # xdoctest: +SKIP
    >>> model = DDP(model)
    >>> opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=1000)
    >>> model.register_comm_hook(opt, lbcomm.ddp.onebit_optimizer_hook)
    >>> # or, for SGD, AdamW, ...:
    >>> state = lbcomm.ddp.OneBitHookState(process_group=None, start_iter=100)
    >>> model.register_comm_hook(state, lbcomm.ddp.onebit_hook)
"""
import logging
import math
import queue
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .compressed import DEFAULT_BLOCK_SIZE, CompressionState, _check_block_size, compressed_allreduce

__all__ = ["onebit_optimizer_hook", "onebit_optimizer_fp16_hook", "OneBitHookState", "onebit_hook"]

_log = logging.getLogger(__name__)

_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
_NONFINITE = ("raise", "skip")
_STATE_VERSION = 1


def _completed(tensor: Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding `tensor` (with CUDA stream semantics for CUDA tensors)."""
    fut = torch.futures.Future(devices=[tensor.device]) if tensor.is_cuda else torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _allreduce_mean(group, tensor: Tensor) -> torch.futures.Future[torch.Tensor]:
    """Full-precision mean of `tensor` over `group`, in place (divided first, as torch's
    allreduce_hook does, so that fp16 buckets do not overflow)."""
    tensor.div_(_world(group))
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _ring_bytes(numel: int, element_size: int, world: int) -> int:
    """Bytes one rank sends in a ring allreduce of numel elements."""
    return 2 * (world - 1) * numel * element_size // world if world > 1 else 0


# ---------------------------------------------------------------------- OneBit optimizers
def _check_optimizer(optimizer, hook: str) -> None:
    if not (hasattr(optimizer, "frozen") and hasattr(optimizer, "grads_averaged")
            and hasattr(optimizer, "process_group")):
        raise TypeError(f"{hook}: the hook state must be the lbcomm optimizer (OneBitAdam, OneBitLamb or Lamb), "
                        f"registered as ddp_model.register_comm_hook(optimizer, lbcomm.ddp.{hook}); got "
                        f"{type(optimizer).__name__}. For any other optimizer use OneBitHookState with onebit_hook.")


def onebit_optimizer_hook(optimizer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook for `OneBitAdam`, `OneBitLamb` and `Lamb`.

    Warmup (until the optimizer freezes its variance): the bucket is averaged over the
    optimizer's ``process_group`` at full precision, and ``optimizer.grads_averaged`` is
    set so that `step` does not average the gradients a second time. Compression stage:
    no communication at all; the bucket keeps this rank's local gradients and the
    optimizer reduces its momentum with one compressed allreduce per step.

    The optimizer's ``process_group`` must be the DDP model's group. Do not wrap this hook
    in torch's ``fp16_compress_wrapper`` (it would round the local gradients of the
    compression stage); use `onebit_optimizer_fp16_hook` instead.

    Example::
        >>> # xdoctest: +SKIP
        >>> opt = lbcomm.OneBitAdam(ddp_model.parameters(), lr=1e-3, freeze_step=1000)
        >>> ddp_model.register_comm_hook(opt, lbcomm.ddp.onebit_optimizer_hook)
    """
    _check_optimizer(optimizer, "onebit_optimizer_hook")
    buf = bucket.buffer()
    if optimizer.frozen:
        return _completed(buf)
    optimizer.grads_averaged = True
    return _allreduce_mean(optimizer.process_group, buf)


def onebit_optimizer_fp16_hook(optimizer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """`onebit_optimizer_hook` with the warmup allreduce in fp16 (half the warmup traffic;
    the averaged gradients are rounded to fp16). The compression stage is unchanged: no
    communication."""
    _check_optimizer(optimizer, "onebit_optimizer_fp16_hook")
    buf = bucket.buffer()
    if optimizer.frozen:
        return _completed(buf)
    optimizer.grads_averaged = True
    group = optimizer.process_group
    half = buf.to(torch.float16).div_(_world(group))
    fut = dist.all_reduce(half, group=group, async_op=True).get_future()

    def decompress(fut):
        buf.copy_(fut.value()[0])
        return buf

    return fut.then(decompress)


# ---------------------------------------------------------------------- 1-bit gradient hook
class _Unit:
    """One compressed tensor: the gradients of a fixed list of parameters, in order."""

    __slots__ = ("key", "shapes", "state")

    def __init__(self, key: Tuple[int, ...], shapes: List[Tuple[int, ...]], state: CompressionState):
        self.key, self.shapes, self.state = key, shapes, state


class _Job:
    __slots__ = ("future", "buffer", "plan", "event", "report_iter")

    def __init__(self, future, buffer, plan, event, report_iter):
        self.future, self.buffer, self.plan, self.event, self.report_iter = future, buffer, plan, event, report_iter


class OneBitHookState:
    r"""State of `onebit_hook`: 1-bit error-feedback compressed allreduce of DDP's gradient
    buckets, for any optimizer (SGD, momentum, AdamW, ...).

    Every bucket is reduced with `lbcomm.compressed_allreduce` (DESIGN.md §1): about 1 bit
    per gradient element instead of 32, with the rounding error of every call fed back into
    the next one (per rank, per bucket), so that nothing is lost over time. Before
    ``start_iter`` the buckets are averaged at full precision.

    The compressed allreduces run on a background thread, one bucket after the other in
    bucket order (so every rank issues its collectives in the same order), on a private
    duplicate of ``process_group`` (so they never interleave with DDP's own collectives).
    The hook returns at once with a future: compression overlaps the rest of the backward
    pass, and nothing blocks or synchronizes a device inside a hook callback.

    Results are bitwise identical on every rank, so replicas stay identical.

    Checkpoints: `state_dict` holds this rank's error buffers (one shard per rank, like the
    lbcomm optimizers; e.g. ``lbcomm.save_sharded(dir, opt, model, extra=hook_state.state_dict())``)
    and `load_state_dict` restores them. They are stored per list of parameters rather than
    per bucket index, because a new DDP instance runs its first iteration with its initial
    buckets before it rebuilds them: in that iteration a bucket is split into the saved
    ones, so that with the same world size the resumed run continues bitwise identically
    to a run that never stopped. Another world size (or model) resets the errors with a
    logged warning. Create the state and register the hook on a freshly built DDP model, as
    usual, so that the parameter numbering (taken from DDP's first iteration) is stable.

    Args:
        process_group (ProcessGroup, optional): the DDP model's process group (default:
            None, the world).
        start_iter (int, optional): iterations averaged at full precision before
            compression starts; must be > 1 because DDP rebuilds its buckets after
            iteration 1 (default: 100).
        block_size (int or None, optional): elements per scale block of the compressed
            allreduce (multiple of 32), or None for the published single-scale algorithm
            (default: 2048).
        nonfinite (str, optional): what a bucket holding NaN/Inf on any rank does: "skip"
            makes the whole bucket NaN on every rank, as a plain allreduce would (so that
            e.g. ``torch.amp.GradScaler`` skips the step), leaving the error buffers
            untouched; "raise" makes the backward pass raise a NonFiniteError on every rank
            (default: "skip").
        compression_stats_logging_frequency (int, optional): log the statistics (bytes
            sent, compression ratio, error norm) every that many iterations once
            compression has started, at INFO (default: 10000).

    Example::
        >>> # xdoctest: +SKIP
        >>> state = lbcomm.ddp.OneBitHookState(process_group=None, start_iter=100)
        >>> ddp_model.register_comm_hook(state, lbcomm.ddp.onebit_hook)
        >>> ...
        >>> lbcomm.save_sharded("ckpt", optimizer, ddp_model.module, extra={"hook": state.state_dict()})
    """

    __slots__ = [
        "process_group",
        # The settings that are tuned.
        "start_iter",
        "block_size",
        # The settings that seldom change.
        "nonfinite",
        "compression_stats_logging_frequency",
        # Internal state.
        "iter",
        "error_dict",  # bucket.index() -> units of that bucket in this DDP instance
        "_units",  # parameter key -> _Unit (the error feedback)
        "_pending",  # parameter key -> saved entry not yet matched to a bucket
        "_positions",  # id(param) -> its number (order of first appearance in a bucket)
        "_world_size",
        "_comm_group",
        "_jobs",
        "_worker",
        "_inflight",
        "_lock",
        "_stream",
        "_next_stats_report",
        # Statistics.
        "total_bytes_sent",
        "total_bytes_uncompressed",
        "compressed_calls",
        "skipped_calls",
        "__weakref__",
    ]

    def __init__(
        self,
        process_group=None,
        start_iter: int = 100,
        block_size: Optional[int] = DEFAULT_BLOCK_SIZE,
        *,
        nonfinite: str = "skip",
        compression_stats_logging_frequency: int = 10_000,
    ):
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter <= 1:
            raise ValueError(f"Invalid start_iter: {start_iter!r} (must be > 1 because DDP rebuilds buckets after "
                             "iteration 1, and the error feedback belongs to the rebuilt buckets)")
        _check_block_size(block_size)
        if nonfinite not in _NONFINITE:
            raise ValueError(f"Invalid nonfinite policy: {nonfinite!r} (use one of {_NONFINITE})")
        freq = compression_stats_logging_frequency
        if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
            raise ValueError(f"Invalid compression_stats_logging_frequency: {freq!r} (must be an int >= 1)")
        _log.info("OneBitHookState config: start_iter = %s; block_size = %s; nonfinite = %s; "
                  "compression_stats_logging_frequency = %s", start_iter, block_size, nonfinite, freq)
        self.process_group = process_group
        self.start_iter = start_iter
        self.block_size = block_size
        self.nonfinite = nonfinite
        self.compression_stats_logging_frequency = freq
        self._init_internal()

    def _init_internal(self) -> None:
        self.iter = 0
        self.error_dict: Dict[int, Tuple[Tuple[int, ...], ...]] = {}
        self._units: Dict[Tuple[int, ...], _Unit] = {}
        self._pending: Dict[Tuple[int, ...], Dict[str, Any]] = {}
        self._positions: Dict[int, int] = {}
        self._world_size: Optional[int] = None
        self._comm_group = None
        self._jobs: Optional[queue.SimpleQueue] = None
        self._worker: Optional[threading.Thread] = None
        self._inflight = 0
        self._lock = threading.Lock()
        self._stream = {}
        self._next_stats_report = self.start_iter
        self.total_bytes_sent = 0
        self.total_bytes_uncompressed = 0
        self.compressed_calls = 0
        self.skipped_calls = 0

    # ------------------------------------------------------------------ pickling
    _CONFIG = ("start_iter", "block_size", "nonfinite", "compression_stats_logging_frequency")

    def __getstate__(self):
        """The settings and `state_dict`; the process group is not serializable and is left out."""
        _log.warning("NOTE: the process group is not serializable and is excluded from the saved OneBitHookState.")
        return {**{name: getattr(self, name) for name in self._CONFIG}, "state_dict": self.state_dict()}

    def __setstate__(self, state):
        """Restore a pickled state; ``process_group`` becomes the default group (None)."""
        self.process_group = None
        _log.warning("NOTE: the OneBitHookState's process group is set to the default group (the world); set "
                     "`state.process_group` before the next iteration if another group is desired.")
        for name in self._CONFIG:
            setattr(self, name, state[name])
        self._init_internal()
        self.load_state_dict(state["state_dict"])

    # ------------------------------------------------------------------ iterations
    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count iterations on the last bucket of each backward pass."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_iter:
                _log.info("onebit_hook: 1-bit compression of the gradients starts after %s iterations", self.iter)

    def _setup(self) -> int:
        if self._world_size is None:
            group = self.process_group
            self._world_size = _world(group)
            if self._world_size > 1:
                # A private group with the same ranks: the compressed allreduces run on the
                # background thread and must not share collective sequence numbers with DDP's
                # own collectives (e.g. find_unused_parameters) or the user's.
                base = group if group is not None else dist.group.WORLD
                self._comm_group = dist.new_group(ranks=dist.get_process_group_ranks(base),
                                                  backend=dist.get_backend(base), use_local_synchronization=True)
        return self._world_size

    # ------------------------------------------------------------------ units
    def _key(self, bucket: dist.GradBucket) -> Tuple[Tuple[int, ...], List[Tensor]]:
        params = bucket.parameters()
        pos = self._positions
        return tuple(pos.setdefault(id(p), len(pos)) for p in params), params

    def _make_unit(self, key, params, numel: int, device, saved: Optional[Dict[str, Any]]) -> _Unit:
        state = CompressionState(numel, group=self._comm_group, device=device, block_size=self.block_size,
                                 nonfinite=self.nonfinite, backend="torch")
        unit = _Unit(key, [tuple(p.shape) for p in params], state)
        if saved is not None:
            if [tuple(s) for s in saved["shapes"]] != unit.shapes:
                _log.warning("onebit_hook: the saved error feedback of parameters %s belongs to parameters of other "
                             "shapes; it is reset to zero", list(key))
            else:
                state.load_state_dict(saved["compression"])  # warns and resets on another world size
        self._units[key] = unit
        return unit

    def _plan(self, bucket: dist.GradBucket, buf: Tensor):
        """[(unit, None)] to reduce the whole bucket, or [(unit, [(offset, numel), ...]), ...]
        to reduce it as several saved units (the first iteration of a resumed DDP model)."""
        key, params = self._key(bucket)
        index = bucket.index()
        unit = self._units.get(key)
        if unit is None and key in self._pending:
            unit = self._make_unit(key, params, buf.numel(), buf.device, self._pending.pop(key))
        if unit is not None:
            self.error_dict[index] = (key,)
            return [(unit, None)]
        where, offset = {}, 0
        for k, p in zip(key, params):
            where[k] = (offset, p.numel(), p)
            offset += p.numel()
        candidates = [k for k in (*self._units, *self._pending) if k and k[0] in where]
        covered = [k for k in candidates if all(x in where for x in k)]
        if covered and sorted(x for k in covered for x in k) == sorted(key):
            plan = []
            for k in covered:
                unit = self._units.get(k)
                if unit is None:
                    ps = [where[x][2] for x in k]
                    unit = self._make_unit(k, ps, sum(p.numel() for p in ps), buf.device, self._pending.pop(k))
                plan.append((unit, [where[x][:2] for x in k]))
            self.error_dict[index] = tuple(k for k in covered)
            return plan
        stale = [k for k in (*self._units, *self._pending) if any(x in where for x in k)]
        if stale:
            _log.warning("onebit_hook: bucket %s holds parameters whose error feedback belongs to another bucket "
                         "layout (%s earlier units); their errors are reset to zero", index, len(stale))
            for k in stale:
                self._units.pop(k, None)
                self._pending.pop(k, None)
        unit = self._make_unit(key, params, buf.numel(), buf.device, None)
        self.error_dict[index] = (key,)
        return [(unit, None)]

    # ------------------------------------------------------------------ the worker
    def _submit(self, buf: Tensor, plan, report_iter: Optional[int]) -> torch.futures.Future[torch.Tensor]:
        event = None
        if buf.is_cuda:
            fut = torch.futures.Future(devices=[buf.device])
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(buf.device))  # the bucket is ready here
        else:
            fut = torch.futures.Future()
        if self._worker is None:
            self._jobs = queue.SimpleQueue()
            self._worker = threading.Thread(target=_work, args=(weakref.ref(self), self._jobs),
                                            name="lbcomm-onebit-hook", daemon=True)
            self._worker.start()
            weakref.finalize(self, self._jobs.put, None)  # the thread ends with the state
        with self._lock:
            self._inflight += 1
        self._jobs.put(_Job(fut, buf, plan, event, report_iter))
        return fut

    def _run(self, job: _Job) -> None:
        buf, world = job.buffer, self._world_size
        skipped = False
        for unit, pieces in job.plan:
            st = unit.state
            if pieces is None:
                compressed_allreduce(buf, st, out=buf)
            else:
                flat = torch.cat([buf[o:o + n] for o, n in pieces])
                compressed_allreduce(flat, st, out=flat)
                o2 = 0
                for o, n in pieces:
                    buf[o:o + n].copy_(flat[o2:o2 + n])
                    o2 += n
            skipped = skipped or st.last_skipped
            self.compressed_calls += 1
            self.total_bytes_sent += st.bytes_per_call()
            self.total_bytes_uncompressed += _ring_bytes(st.numel, buf.element_size(), world)
        if skipped:
            self.skipped_calls += 1
            buf.fill_(float("nan"))  # what a plain allreduce of NaN/Inf gives, on every rank
            _log.warning("onebit_hook: a bucket held NaN or Inf on some rank at iteration %s; it is NaN on every "
                         "rank and the error feedback is unchanged", self.iter)
        if job.report_iter is not None:
            stats = self.compression_stats()
            _log.info("onebit_hook stats: iter %s, %s bytes sent, %s uncompressed (ratio %.2f), %s compressed calls "
                      "(%s skipped), error norm %.6g", job.report_iter, stats["bytes_sent"],
                      stats["bytes_uncompressed"], stats["compression_ratio"], stats["compressed_calls"],
                      stats["skipped_calls"], stats["error_norm"])

    def _ensure_idle(self, what: str) -> None:
        with self._lock:
            busy = self._inflight
        if busy:
            raise RuntimeError(f"OneBitHookState.{what}: {busy} bucket(s) are still being reduced; call it after "
                               "the backward pass (DDP waits for every bucket before backward returns)")

    # ------------------------------------------------------------------ statistics
    def error_norm(self) -> float:
        """L2 norm of this rank's error feedback (worker and server errors of every unit).
        Reads device memory: call it outside the backward pass."""
        total = 0.0
        for unit in self._units.values():
            st = unit.state
            total += float(st.worker_error.double().square().sum()) + float(st.server_error.double().square().sum())
        return math.sqrt(total)

    def compression_stats(self) -> Dict[str, Any]:
        """Totals since the start (or since the checkpoint was taken, carried over):

        * ``bytes_sent``: what this rank sent through the hook (compressed calls, and the
          full-precision allreduces before ``start_iter`` counted as a ring allreduce);
        * ``bytes_uncompressed``: what ring allreduces of the same buckets would have sent;
        * ``compression_ratio``: their ratio;
        * ``compressed_calls``, ``skipped_calls`` (non-finite buckets), ``iter``;
        * ``error_norm``: see `error_norm`.
        """
        sent, full = self.total_bytes_sent, self.total_bytes_uncompressed
        return {
            "iter": self.iter,
            "bytes_sent": sent,
            "bytes_uncompressed": full,
            "compression_ratio": full / sent if sent else 0.0,
            "compressed_calls": self.compressed_calls,
            "skipped_calls": self.skipped_calls,
            "error_norm": self.error_norm(),
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """This rank's error feedback, iteration count and statistics (one shard per rank)."""
        self._ensure_idle("state_dict")
        units = [{"params": list(u.key), "shapes": list(u.shapes), "compression": u.state.state_dict()}
                 for u in self._units.values()]
        units += [{"params": list(k), **entry} for k, entry in self._pending.items()]
        return {
            "version": _STATE_VERSION,
            "iter": self.iter,
            "start_iter": self.start_iter,
            "block_size": self.block_size,
            "world_size": self._world_size if self._world_size is not None else _world(self.process_group),
            "units": units,
            "stats": {"bytes_sent": self.total_bytes_sent, "bytes_uncompressed": self.total_bytes_uncompressed,
                      "compressed_calls": self.compressed_calls, "skipped_calls": self.skipped_calls},
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a `state_dict` of this rank. The errors are attached to DDP's buckets as
        they appear; saved for another world size, they are reset with a logged warning."""
        self._ensure_idle("load_state_dict")
        if not isinstance(state_dict, dict) or state_dict.get("version") != _STATE_VERSION:
            raise ValueError("OneBitHookState.load_state_dict: not a OneBitHookState state_dict (version "
                             f"{state_dict.get('version') if isinstance(state_dict, dict) else None!r}, expected "
                             f"{_STATE_VERSION})")
        world = _world(self.process_group)
        self.iter = int(state_dict["iter"])
        self._next_stats_report = max(self.start_iter, self.iter)
        stats = state_dict.get("stats", {})
        self.total_bytes_sent = int(stats.get("bytes_sent", 0))
        self.total_bytes_uncompressed = int(stats.get("bytes_uncompressed", 0))
        self.compressed_calls = int(stats.get("compressed_calls", 0))
        self.skipped_calls = int(stats.get("skipped_calls", 0))
        self._units.clear()
        self.error_dict.clear()
        self._pending = {tuple(e["params"]): {"shapes": e["shapes"], "compression": e["compression"]}
                         for e in state_dict["units"]}
        if state_dict.get("world_size") != world and self._pending:
            _log.warning("onebit_hook: the state was saved with world size %s and this run has %s; the error feedback "
                         "is reset to zero and training continues", state_dict.get("world_size"), world)
            self._pending.clear()


def _work(ref, jobs: queue.SimpleQueue) -> None:
    """The background thread of a OneBitHookState: its buckets' compressed allreduces, in
    submission (bucket) order. Holds the state weakly and ends when the state is collected."""
    while True:
        job = jobs.get()
        self = ref() if job is not None else None
        if self is None:
            return
        error: Optional[BaseException] = None
        stream = None
        if job.event is not None:
            dev = job.buffer.device
            stream = self._stream.get(dev)
            if stream is None:
                stream = self._stream[dev] = torch.cuda.Stream(dev)
        try:
            if stream is None:
                self._run(job)
            else:
                with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                    stream.wait_event(job.event)  # a GPU-side wait for the bucket, not a host sync
                    self._run(job)
        except BaseException as exc:  # noqa: BLE001 - handed to DDP through the future
            error = exc
        with self._lock:  # idle before DDP can see the result
            self._inflight -= 1
        del self
        if error is not None:
            job.future.set_exception(error)
        elif stream is None:
            job.future.set_result(job.buffer)
        else:
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                job.future.set_result(job.buffer)  # DDP's stream waits for this one
        # Hold nothing between jobs: a finished job keeps the units, their process group
        # and the bucket alive, and an idle daemon thread must not outlive them at exit.
        del job, error, stream


def onebit_hook(state: OneBitHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: 1-bit error-feedback compressed allreduce of every bucket.

    Before ``state.start_iter`` the bucket is averaged at full precision; from then on it
    is reduced with `lbcomm.compressed_allreduce` on a background thread (in bucket order)
    and decoded in place into ``bucket.buffer()``; the returned future completes then.
    The result, about the mean of the ranks' gradients, is bitwise identical on every
    rank. See `OneBitHookState`.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = lbcomm.ddp.OneBitHookState(process_group=None, start_iter=100)
        >>> ddp_model.register_comm_hook(state, lbcomm.ddp.onebit_hook)
    """
    if not isinstance(state, OneBitHookState):
        raise TypeError(f"onebit_hook: the hook state must be a OneBitHookState, got {type(state).__name__}")
    buf = bucket.buffer()
    if buf.dtype not in _FLOAT_TYPES:
        raise TypeError(f"onebit_hook: buckets of {buf.dtype} cannot be compressed (float32, float16 or bfloat16); "
                        "use torch's allreduce_hook for this model")
    world = state._setup()
    if world == 1:
        state.maybe_increase_iter(bucket)
        return _completed(buf)
    if state.iter < state.start_iter:
        state._key(bucket)  # number the parameters in DDP's first iteration
        nbytes = _ring_bytes(buf.numel(), buf.element_size(), world)
        state.total_bytes_sent += nbytes
        state.total_bytes_uncompressed += nbytes
        fut = _allreduce_mean(state.process_group, buf)
        state.maybe_increase_iter(bucket)
        return fut
    plan = state._plan(bucket, buf)
    report = None
    if bucket.is_last() and state.iter >= state._next_stats_report:
        report = state.iter
        state._next_stats_report = state.iter + state.compression_stats_logging_frequency
    fut = state._submit(buf, plan, report)
    state.maybe_increase_iter(bucket)
    return fut
