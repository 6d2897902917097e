"""Shared-memory transport for the ranks of one host (the inside of a node).

The byte collectives of `lbcomm.comm` (all_to_all, all_gather) through buffers in
/dev/shm that every rank of the group maps: a rank copies its input into its own buffer,
one barrier, then it copies what it needs out of the others' buffers. That is two memory
copies of the data and no socket, which is what moves full-precision slices inside a node
(the hierarchical call's row collectives, lbcomm.hierarchical) at memory speed rather than through the TCP
stack of loopback. Synchronization (a barrier, and all_reduce) goes through the group's torch.distributed
transport. The row collectives of the `Transport` protocol hand out this rank's shared
buffer to write into and return views of the other ranks' buffers, read in place.

Buffers are double: call k writes half k mod 2. A rank that has passed the barrier of
call k + 1 knows that every rank has finished reading call k, so one barrier per call is
enough. Buffers grow on demand (every rank calls with the same sizes in the same order,
as for any collective); each rank creates its own file, every rank maps all of them, and
each file is unlinked once everyone has mapped it, so nothing is left in /dev/shm even if
a rank is killed.

CPU tensors only; every rank of the group must run on the same host (checked once: host
name and boot id).
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
from typing import List, Optional

import torch
from torch import Tensor

from .base import GatherVThroughBytes, completed_future
from .torch_dist import TorchTransport

__all__ = ["ShmTransport", "SHM_DIR"]

_log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class ShmTransport(GatherVThroughBytes):
    """The byte collectives through shared memory among the ranks of `group`, which must
    all run on this host (a torch.distributed group; its transport synchronizes)."""

    backend = "shm"

    def __init__(self, group=None):
        import torch.distributed as dist

        self.sync = TorchTransport(group)
        self.group = group
        self.world_size, self.rank = self.sync.world_size, self.sync.rank
        self._cap = 0  # bytes per half
        self._buffers: List[Tensor] = []  # every rank's buffer, [2 * cap] uint8
        self._calls = 0
        self._generation = 0
        self._staged: Optional[List[Tensor]] = None
        self._row_bytes = 0
        self._arrived = torch.zeros(1, dtype=torch.int32)  # the barrier's all_reduce
        if self.world_size == 1:
            self._token = ""
            return
        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(f"ShmTransport needs {SHM_DIR} (a tmpfs); use the group's torch transport instead")
        mine = (_host_id(), secrets.token_hex(6))
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=group)
        hosts = {h for h, _ in everyone}
        if len(hosts) != 1:
            raise ValueError(f"ShmTransport: the ranks of the group run on different hosts ({sorted(hosts)}); shared "
                             "memory works inside one host only: pass the node's group, or use the torch transport")
        self._token = everyone[0][1]  # rank 0's token names this transport's files

    def check_device(self, device: torch.device) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"ShmTransport moves CPU tensors; got a tensor on {device}. Use the group's torch "
                             "transport (NCCL) for CUDA tensors")

    def _path(self, rank: int) -> str:
        return os.path.join(SHM_DIR, f"lbcomm-{self._token}-g{self._generation}-r{rank}")

    def _ensure(self, nbytes: int) -> None:
        if nbytes <= self._cap:
            return
        cap = max(nbytes, 2 * self._cap)
        self._generation += 1
        own = self._path(self.rank)
        storage = torch.UntypedStorage.from_file(own, shared=True, nbytes=2 * cap)
        try:
            self.sync.barrier()  # every rank's file exists at its new size
            buffers = []
            for r in range(self.world_size):
                s = storage if r == self.rank else torch.UntypedStorage.from_file(self._path(r), shared=True,
                                                                                 nbytes=2 * cap)
                buffers.append(torch.empty(0, dtype=torch.uint8).set_(s))
            self.sync.barrier()  # every rank has mapped every file
        finally:
            try:
                os.unlink(own)
            except OSError:
                pass
        self._buffers, self._cap = buffers, cap
        _log.debug("ShmTransport: %s bytes per half on %s ranks", cap, self.world_size)

    def _stage(self, nbytes: int) -> Tensor:
        """This rank's uint8 buffer of `nbytes` for the next collective (the other ranks'
        buffers of the same collective are kept for `_publish`)."""
        self._ensure(nbytes)
        self._staged = [b[(self._calls % 2) * self._cap:][:nbytes] for b in self._buffers]
        self._calls += 1
        return self._staged[self.rank]

    def _publish(self, async_op: bool = False):
        """Every rank's staged buffer once every rank has written its own (an all_reduce
        over the group is the barrier: no rank completes it before every rank has joined);
        a Future of them with async_op. Read them before the collective after next
        (buffers are double)."""
        views, self._staged = self._staged, None
        fut = self.sync.all_reduce(self._arrived, "max", async_op=True)
        if async_op:
            return fut.then(lambda f: (f.value(), views)[1])
        fut.wait()
        return views

    def _exchange(self, inp: Tensor, read, async_op: bool):
        """Write `inp` into this rank's buffer, wait for every rank, then read(buffers)."""
        self._stage(inp.numel() * inp.element_size()).copy_(inp.reshape(-1).view(torch.uint8))
        if not async_op:
            read(self._publish())
            return None
        return self._publish(True).then(lambda f: read(f.value()))

    def all_to_all(self, out: Tensor, inp: Tensor, async_op: bool = False):
        p = self.world_size
        if p == 1:
            out.copy_(inp)
            return completed_future([out]) if async_op else None
        row = inp.numel() * inp.element_size() // p
        dst = out.reshape(-1).view(torch.uint8).view(p, row)

        def read(views):
            for j in range(p):
                dst[j].copy_(views[j][self.rank * row:(self.rank + 1) * row])
            return [out]

        return self._exchange(inp, read, async_op)

    def all_gather(self, out: Tensor, inp: Tensor, async_op: bool = False):
        p = self.world_size
        n = inp.numel() * inp.element_size()
        dst = out.reshape(-1).view(torch.uint8).view(p, n)
        if p == 1:
            dst[0].copy_(inp.reshape(-1).view(torch.uint8))
            return completed_future([out]) if async_op else None

        def read(views):
            for j in range(p):
                dst[j].copy_(views[j])
            return [out]

        return self._exchange(inp, read, async_op)

    # row collectives (the `Transport` protocol): the rows are read in place from every
    # rank's shared buffer, nothing is copied out
    def rows_out(self, rows: int, row_bytes: int, device) -> Tensor:
        self.check_device(device)
        self._row_bytes = row_bytes
        return self._stage(rows * row_bytes).view(rows, row_bytes)

    def _rows(self, pick, async_op: bool):
        if self.world_size == 1:
            views, self._staged = self._staged, None
            rows = [pick(views[0])]
            return completed_future(rows) if async_op else rows
        if not async_op:
            return [pick(v) for v in self._publish()]
        return self._publish(True).then(lambda f: [pick(v) for v in f.value()])

    def all_to_all_rows(self, async_op: bool = False):
        lo = self.rank * self._row_bytes
        hi = lo + self._row_bytes
        return self._rows(lambda v: v[lo:hi], async_op)

    def all_gather_rows(self, async_op: bool = False):
        return self._rows(lambda v: v, async_op)

    def all_reduce(self, tensor: Tensor, op: str = "sum", async_op: bool = False,
                   bucket_bytes: Optional[int] = None):
        return self.sync.all_reduce(tensor, op, async_op=async_op, bucket_bytes=bucket_bytes)

    def barrier(self) -> None:
        self.sync.barrier()

    def send_v(self, inp: Tensor, dst: int) -> None:
        """Point-to-point through the group's torch.distributed transport (`TorchTransport.send_v`)."""
        self.sync.send_v(inp, dst)

    def recv_v(self, src: int, device=None) -> Tensor:
        return self.sync.recv_v(src, device)

    def sendrecv(self, sends, recvs, async_op: bool = False):
        """Point-to-point messages through the group's torch transport (a few peers, not
        worth a shared buffer)."""
        return self.sync.sendrecv(sends, recvs, async_op=async_op)
