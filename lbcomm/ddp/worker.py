"""The thread that runs the compressing hooks' bucket reductions in bucket order
(`BucketWorker`), on a private duplicate of the DDP process group and its transport, and
what `onebit_hook` and `dct_hook` share around it: the reduction of a planned bucket with
its byte counts (`reduce_planned`), the idle check before a checkpoint (`ensure_idle`) and
the norm of the units' error feedback (`units_error_norm`)."""
import logging
import math
import queue
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import get_transport, world_info
from ..common import new_future, ring_allreduce_bytes

__all__ = ["BucketWorker", "reduce_planned", "ensure_idle", "units_error_norm"]

_log = logging.getLogger(__name__)


class BucketWorker:
    """Runs bucket reductions on one background thread, in submission (bucket) order, so
    that every rank issues its collectives in the same order; `group` is a private
    duplicate of the DDP process group, so that they never interleave with DDP's own
    collectives (e.g. find_unused_parameters) or the user's, and `transport` its
    `lbcomm.comm` transport (None with one rank). The thread starts with the first job and
    ends when the worker is collected.
    """

    __slots__ = ("world_size", "group", "transport", "_jobs", "_inflight", "_lock", "_streams", "__weakref__")

    def __init__(self, process_group=None):
        self.world_size = world_info(process_group)[0]
        self.group = self.transport = None
        if self.world_size > 1:
            base = process_group if process_group is not None else dist.group.WORLD
            self.group = dist.new_group(ranks=dist.get_process_group_ranks(base), backend=dist.get_backend(base),
                                        use_local_synchronization=True)
            self.transport = get_transport(self.group, backend="torch")
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

    def stream_for(self, device: torch.device):
        """The side stream the worker thread runs jobs of `device` on (CUDA), made once."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def finish_job(self) -> None:
        """One submitted job is done (called by the thread before the result is handed over)."""
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
        stream = worker.stream_for(buf.device) if event is not None else None
        try:
            if stream is None:
                run(buf)
            else:
                with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                    stream.wait_event(event)  # a GPU-side wait for the bucket, not a host sync
                    run(buf)
        except BaseException as exc:  # noqa: BLE001 - handed to DDP through the future
            error = exc
        worker.finish_job()  # idle before DDP can see the result
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


def reduce_planned(state, plan, buf: Tensor, on_unit: Optional[Callable[[Any, int, int], None]] = None) -> bool:
    """Reduce `buf` in place by each unit of `plan` ((unit, slices) pairs) and add to the
    hook state's totals: ``compressed_calls`` (units not wholly exact), ``total_bytes_sent``
    (the unit's bytes per call) and ``total_bytes_uncompressed`` (a ring allreduce of the
    same elements). ``on_unit(unit, sent, dense)`` sees each unit's two byte counts. Returns
    whether a unit skipped its call (non-finite input on some rank)."""
    skipped = False
    world = state.worker.world_size
    for unit, slices in plan:
        unit.reduce(buf, slices)
        skipped = skipped or unit.last_skipped
        sent = unit.bytes_per_call()
        dense = int(ring_allreduce_bytes(unit.compression.numel * buf.element_size(), world))
        state.compressed_calls += not unit.fully_exact()
        state.total_bytes_sent += sent
        state.total_bytes_uncompressed += dense
        if on_unit is not None:
            on_unit(unit, sent, dense)
    return skipped


def ensure_idle(worker: Optional[BucketWorker], who: str) -> None:
    """Refuse `who` (e.g. "OneBitHookState.state_dict") while buckets are in flight: the
    error feedback they update would be saved or replaced half-way."""
    busy = worker.busy() if worker is not None else 0
    if busy:
        raise RuntimeError(f"{who}: {busy} bucket(s) are still being reduced; call it after the backward pass (DDP "
                           "waits for every bucket before backward returns)")


def units_error_norm(units: Iterable[Any], server: bool = True) -> float:
    """L2 norm of the units' worker error feedback (and server errors, if `server`), in
    float64. Reads device memory: call it outside the backward pass."""
    total = 0.0
    for unit in units:
        st = unit.compression
        total += float(st.worker_error.double().square().sum())
        if server:
            total += float(st.server_error.double().square().sum())
    return math.sqrt(total)
