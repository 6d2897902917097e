"""torch.distributed transport: gloo for CPU tensors, NCCL for CUDA tensors."""
from __future__ import annotations

import atexit
import collections
import os
import threading
import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import NotInitializedError
from .base import (GatherVThroughBytes, RowsThroughBytes, StagedRows, all_gather_one_round, all_reduce_one_round,
                   buckets, check_all_reduce, check_sendrecv, completed_future, finish_all_reduce, one_round,
                   small_for_one_round)

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# torch 2.13 renamed all_gather_into_tensor; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# A gloo worker thread drops its reference to a finished collective some time after the
# caller's wait() has returned. When that is the last reference to a tensor Python created
# (the views and pieces handed to the collectives below), freeing it takes the GIL, and a
# thread that takes the GIL while the interpreter finalizes is ended inside a noexcept
# destructor: the process aborts at exit ("terminate called without an active exception").
# The most recent works and their tensors are held here, so that the main thread frees
# the last ones, with the GIL, when the module is torn down. Bounded: only the final few
# collectives of a process can still be in a worker's hands at exit.
_RECENT: collections.deque = collections.deque(maxlen=32)
# A worker also releases the Python callbacks chained on a collective's future (the async
# paths' `then`) just after it has completed the future, and that release takes the GIL
# too: no reference held here can delay it. So at exit, before the interpreter starts to
# finalize, the main thread lets go of the GIL for a moment. Nothing is waited on, so a
# rank that exits with collectives in flight (an error) does not hang here.
_EXIT_GRACE_S = 0.2
_drain_registered = False


def _drain_at_exit() -> None:
    time.sleep(_EXIT_GRACE_S)


def _keep(work, tensors) -> None:
    """Hold `work` and its tensors in `_RECENT` (see above)."""
    global _drain_registered
    _RECENT.append((work, tensors))
    if not _drain_registered:
        _drain_registered = True
        atexit.register(_drain_at_exit)


def _issue(collective, *tensors: Tensor, group, async_op: bool, **kwargs):
    """Run `collective(*tensors, group=group, async_op=True, **kwargs)`, keep its work and
    tensors in `_RECENT`, and return its future (async_op) or wait for it (None)."""
    work = collective(*tensors, group=group, async_op=True, **kwargs)
    _keep(work, tensors)
    if async_op:
        return work.get_future()
    work.wait()
    return None


def _waited(works, value) -> torch.futures.Future:
    """A Future of `value` completed by a helper thread once every work has finished (or
    failed with the first work's error)."""
    fut = torch.futures.Future()

    def wait() -> None:
        try:
            for w in works:
                w.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
            fut.set_exception(exc)
            return
        fut.set_result(value)

    threading.Thread(target=wait, name="lbcomm-sendrecv", daemon=True).start()
    return fut


def env_world_size() -> int:
    """The world size that torchrun (or any env:// launcher) put in WORLD_SIZE; 1 when unset
    (or not an int, which init_process_group itself reports)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def check_not_launched_alone(launched: int, where: str, fix: str = "") -> None:
    """Raise `NotInitializedError` when a launcher started `launched` > 1 ranks but this
    process is about to communicate as a world of one: each rank would train alone."""
    if launched > 1:
        raise NotInitializedError(
            f"lbcomm: {where} says this job has {launched} ranks, but torch.distributed is not initialized, so "
            f"every rank would train alone with nothing averaged. Call torch.distributed.init_process_group"
            f"(\"gloo\") (\"nccl\" for CUDA tensors) at the start of every rank, before lbcomm's first step{fix}.")


def world_info(group=None) -> Tuple[int, int]:
    """(world_size, rank) of `group`; (1, 0) when torch.distributed is not initialized and
    nothing says the job has more ranks. The one place where lbcomm decides it runs alone:
    under torchrun (WORLD_SIZE > 1) without ``init_process_group`` it raises
    `lbcomm.errors.NotInitializedError` instead."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        world = env_world_size()
        check_not_launched_alone(world, f"WORLD_SIZE={world} (set by torchrun)",
                                 ", or unset WORLD_SIZE for a single-process run")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def gather_objects(obj, dst: int = 0, group=None) -> Optional[list]:
    """Every rank's picklable `obj`, in rank order, on rank `dst` of `group` (None on the
    others); ``[obj]`` without torch.distributed. For small metadata (checkpoint shards of
    the integrations): the transports move tensors only."""
    world, rank = world_info(group)
    if world == 1:
        return [obj]
    out = [None] * world if rank == dst else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, dst) if group is not None else dst, group=group)
    return out


def all_gather_objects(obj, group=None) -> list:
    """Every rank's picklable `obj`, in rank order, on every rank of `group` (``[obj]``
    without torch.distributed)."""
    world, _ = world_info(group)
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


class TorchTransport(RowsThroughBytes, GatherVThroughBytes):
    """The byte collectives over a torch.distributed process group."""

    def __init__(self, group=None):
        self.group = group
        self.world_size, self.rank = world_info(group)
        # Kept at world size 1 too: a one-rank NCCL group still needs CUDA buffers.
        initialized = dist.is_available() and dist.is_initialized()
        self.backend = dist.get_backend(group) if initialized else None
        self._rows = StagedRows(self)

    def check_device(self, device: torch.device) -> None:
        """Clear error for a tensor the group's backend cannot move."""
        if self.backend is None:
            return
        backend = str(self.backend).lower()
        if backend == "nccl" and device.type != "cuda":
            raise ValueError(f"the process group uses NCCL, which needs CUDA tensors; got a tensor on {device}. "
                             "Use a gloo group for CPU tensors.")
        if backend == "gloo" and device.type not in ("cpu", "cuda"):
            raise ValueError(f"the process group uses gloo, which moves CPU tensors (and CUDA tensors through host "
                             f"memory); got a tensor on {device}")

    def all_to_all(self, out: Tensor, inp: Tensor, async_op: bool = False):
        return _issue(dist.all_to_all_single, out.reshape(-1), inp.reshape(-1), group=self.group, async_op=async_op)

    def all_gather(self, out: Tensor, inp: Tensor, async_op: bool = False):
        if one_round(self.backend, inp) and self.world_size > 1:
            return all_gather_one_round(self.all_to_all, out, inp, self.world_size, async_op)
        return _issue(_all_gather_single, out.reshape(-1), inp.reshape(-1), group=self.group, async_op=async_op)

    def all_reduce(self, tensor: Tensor, op: str = "sum", async_op: bool = False,
                   bucket_bytes: Optional[int] = None):
        """In-place allreduce of a contiguous tensor (see `lbcomm.comm`)."""
        check_all_reduce(tensor, op, bucket_bytes)
        if self.world_size == 1:
            return completed_future(tensor, tensor.device) if async_op else None
        flat = tensor.view(-1)
        if one_round(self.backend, flat) and small_for_one_round(flat, self.world_size):
            return all_reduce_one_round(self.all_to_all, tensor, op, self.world_size, async_op)
        futures = [_issue(dist.all_reduce, piece, op=_OPS[op], group=self.group, async_op=True)
                   for piece in buckets(flat, bucket_bytes)]
        return finish_all_reduce(tensor, op, self.world_size, futures, async_op)

    def barrier(self) -> None:
        if self.world_size > 1:
            _issue(dist.barrier, group=self.group, async_op=False)

    # point-to-point of variable length (the model-parallel boundary of lbcomm.dct_mp)
    def send_v(self, inp: Tensor, dst: int) -> None:
        """Send the 1-D uint8 `inp` to rank `dst` of the group (blocking): its length, then
        its bytes; `recv_v(src=this rank)` on `dst` receives it."""
        if not isinstance(inp, Tensor) or inp.dtype != torch.uint8 or inp.dim() != 1:
            raise TypeError("send_v: expected a 1-D uint8 tensor")
        n = torch.tensor([inp.numel()], dtype=torch.int64, device=inp.device)
        for t in (n, inp)[:2 if inp.numel() else 1]:
            work = dist.isend(t, group=self.group, group_dst=dst)
            _RECENT.append((work, (t,)))
            work.wait()

    def recv_v(self, src: int, device=None) -> Tensor:
        """The 1-D uint8 tensor rank `src` of the group sends with `send_v` (blocking)."""
        n = torch.empty(1, dtype=torch.int64, device=device)
        work = dist.irecv(n, group=self.group, group_src=src)
        _RECENT.append((work, (n,)))
        work.wait()
        out = torch.empty(int(n), dtype=torch.uint8, device=device)
        if out.numel():
            work = dist.irecv(out, group=self.group, group_src=src)
            _RECENT.append((work, (out,)))
            work.wait()
        return out

    def sendrecv(self, sends, recvs, async_op: bool = False):
        """Point-to-point messages with a few peers, all in flight at once (one
        ``batch_isend_irecv``); see `lbcomm.comm.base.Transport.sendrecv`."""
        check_sendrecv(sends, recvs, self.world_size, self.rank, "TorchTransport")
        out = [t for _, t in recvs]
        if not sends and not recvs:
            return completed_future(out) if async_op else None

        def peer(r: int) -> int:  # P2POp takes global ranks
            return r if self.group is None else dist.get_global_rank(self.group, r)

        ops = [dist.P2POp(dist.isend, t, peer(r), self.group) for r, t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer(r), self.group) for r, t in recvs]
        works = dist.batch_isend_irecv(ops)
        _keep(works, tuple(t for _, t in list(sends) + list(recvs)))
        if not async_op:
            for w in works:
                w.wait()
            return None
        try:
            futures = [w.get_future() for w in works]
        except RuntimeError:  # gloo's point-to-point works have no future: a thread waits for them
            return _waited(works, out)
        return torch.futures.collect_all(futures).then(lambda f: ([x.value() for x in f.value()], out)[1])

