"""The progress thread of the MPI transport (`lbcomm.comm.mpi.MPITransport`): every
nonblocking MPI collective is queued here as an `_Op`, started in call order on one
background thread, tested until it completes, and its torch Future completed there (its
callbacks, which may queue more collectives, run on that thread).
"""
from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
from typing import List, Optional

import torch
from torch import Tensor

__all__ = ["ENGINE"]

_log = logging.getLogger("lbcomm.comm.mpi")

_MPI_OPS = {"sum": lambda MPI: MPI.SUM, "mean": lambda MPI: MPI.SUM, "max": lambda MPI: MPI.MAX,
            "min": lambda MPI: MPI.MIN}


class _Op:
    """One collective: waits for its input, runs on MPI, completes its future."""

    __slots__ = ("transport", "kind", "out", "inp", "future", "ready_event", "request", "host_out", "stream",
                 "op", "result", "p2p")

    def __init__(self, transport, kind: str, out: Tensor, inp: Optional[Tensor],
                 op: Optional[str] = None, result=None, p2p=None):
        # kind: "all_to_all", "all_gather", "all_reduce" (in place in `out`, inp is None),
        # "barrier" (no buffers) or "sendrecv" (p2p: the (peer, send) and (peer, recv) pairs
        # of host or device-accessible buffers; out and inp are None). `result` is what the
        # future completes with (default [out]).
        self.transport, self.kind, self.out, self.inp, self.op = transport, kind, out, inp, op
        self.result = result
        self.p2p = p2p
        self.request = None
        self.host_out: Optional[Tensor] = None
        self.ready_event = None
        self.stream = None
        if out is not None and out.device.type == "cuda":
            # The input is produced on the caller's stream: MPI may touch it once this event
            # has passed. Recording an event does not block the caller.
            self.ready_event = torch.cuda.Event()
            self.ready_event.record(torch.cuda.current_stream(out.device))
            self.future = torch.futures.Future(devices=[out.device])
        else:
            self.future = torch.futures.Future()

    def ready(self) -> bool:
        return self.ready_event is None or self.ready_event.query()

    def start(self) -> None:
        tr, MPI = self.transport, self.transport.mpi
        if self.kind == "barrier":
            self.request = tr.comm.Ibarrier()
            return
        if self.kind == "sendrecv":  # one tag: MPI keeps the order of a pair's messages
            sends, recvs = self.p2p
            reqs = [tr.comm.Isend([_buffer(t), MPI.BYTE], dest=r, tag=0) for r, t in sends]
            reqs += [tr.comm.Irecv([_buffer(t), MPI.BYTE], source=r, tag=0) for r, t in recvs]
            self.request = _Requests(MPI, reqs)
            return
        inp = self.out if self.inp is None else self.inp  # all_reduce works in place
        if self.out.device.type == "cpu":
            send, recv = inp.numpy(), self.out.numpy()
        elif tr.cuda_aware:
            send, recv = inp, self.out  # device pointers straight to MPI
        else:
            dev = self.out.device
            self.stream = tr.side_stream(dev)
            with torch.cuda.device(dev), torch.cuda.stream(self.stream):
                self.host_out = torch.empty(self.out.shape, dtype=self.out.dtype, pin_memory=True)
                if self.inp is None:
                    self.host_out.copy_(self.out)  # blocking copy: waits on this (side) stream only
                    host_in = self.host_out
                else:
                    host_in = torch.empty(inp.shape, dtype=inp.dtype, pin_memory=True)
                    host_in.copy_(inp)
            send, recv = host_in.numpy(), self.host_out.numpy()
        if self.kind == "all_to_all":
            self.request = tr.comm.Ialltoall([send, MPI.BYTE], [recv, MPI.BYTE])
        elif self.kind == "all_gather":
            self.request = tr.comm.Iallgather([send, MPI.BYTE], [recv, MPI.BYTE])
        else:
            self.request = tr.comm.Iallreduce(MPI.IN_PLACE, recv, op=_MPI_OPS[self.op](MPI))
        self.inp = send  # keep the send buffer alive while MPI reads it

    def test(self) -> bool:
        return bool(self.request.Test())

    def wait(self) -> None:
        self.request.Wait()

    def complete(self) -> None:
        out, host_out = self.out, self.host_out
        result = [out] if self.result is None else self.result
        self.inp = self.host_out = self.request = self.p2p = None  # the buffers may be reused from here on
        if out is None or out.device.type == "cpu":
            self.future.set_result(result)
            return
        with torch.cuda.device(out.device):
            if host_out is not None:
                with torch.cuda.stream(self.stream):
                    out.copy_(host_out, non_blocking=True)  # the pinned block is held until the copy is done
                    out.record_stream(self.stream)  # not reused by the allocator before the copy ends
                    self.future.set_result(result)  # consumers' streams wait for this one
            else:
                self.future.set_result(result)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


def _buffer(t: Tensor):
    """A contiguous tensor as MPI sees it: a NumPy byte view on the CPU, the tensor itself
    (CUDA array interface) on a CUDA-aware MPI."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


class _Requests:
    """Several MPI requests tested and waited on as one."""

    __slots__ = ("MPI", "reqs")

    def __init__(self, MPI, reqs):
        self.MPI, self.reqs = MPI, reqs

    def Test(self) -> bool:
        return bool(self.MPI.Request.Testall(self.reqs))

    def Wait(self) -> None:
        self.MPI.Request.Waitall(self.reqs)


class _ProgressEngine:
    """The one thread that starts and completes every nonblocking MPI collective."""

    def __init__(self):
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def in_progress_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, op: _Op) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("lbcomm MPI transport: the progress thread was shut down (the interpreter is "
                                   "exiting); no more collectives can be started")
            self._queue.append(op)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lbcomm-mpi-progress", daemon=True)
                self._thread.start()
                atexit.register(self.close)
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                _log.warning("lbcomm MPI transport: collectives still in flight at exit after %s s (a rank stopped "
                             "taking part?); MPI_Finalize may hang", timeout)

    def _run(self) -> None:
        waiting: collections.deque = collections.deque()  # submitted, not started, in call order
        active: List[_Op] = []
        idle = 0
        while True:
            with self._cond:
                while not self._queue and not waiting and not active:
                    if self._closed:
                        return
                    self._cond.wait()
                waiting.extend(self._queue)
                self._queue.clear()
            progressed = False
            # Start in call order; an op whose input is still being computed on the GPU holds
            # back the ones behind it (the order of a communicator's collectives must not change).
            while waiting:
                op = waiting[0]
                try:
                    op.transport.raise_if_broken()
                    if not op.ready():
                        break
                    op.start()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
                    waiting.popleft()
                    op.transport.mark_broken(exc, op)
                    progressed = True
                    continue
                waiting.popleft()
                active.append(op)
                progressed = True
            still: List[_Op] = []
            for op in active:
                try:
                    done = op.test()
                except BaseException as exc:  # noqa: BLE001
                    op.transport.mark_broken(exc, op)
                    progressed = True
                    continue
                if not done:
                    still.append(op)
                    continue
                progressed = True
                try:
                    op.complete()  # runs the future's callbacks here, which may submit more ops
                except BaseException as exc:  # noqa: BLE001 - never let a callback kill the thread
                    if not op.future.done():
                        op.fail(exc)
                    else:
                        _log.exception("lbcomm MPI transport: a callback of a completed collective raised")
            active = still
            op = still = None  # hold no finished op (its buffers, its future) while idle
            if progressed:
                idle = 0
            else:  # back off from 20 us to 1 ms while requests are pending
                time.sleep(min(1e-3, 2e-5 * (1 << min(idle, 6))))
                idle += 1


ENGINE = _ProgressEngine()
