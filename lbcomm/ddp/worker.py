"""The thread that runs `onebit_hook`'s compressed bucket reductions in bucket order
(`BucketWorker`), on a private duplicate of the DDP process group and its transport."""
import logging
import queue
import threading
import weakref
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import get_transport, world_info
from ..common import new_future

__all__ = ["BucketWorker"]

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
