"""An in-process transport: rank 0 of p ranks that all hold the same data (cost model)."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from .base import GatherVThroughBytes, RowsThroughBytes, StagedRows, check_all_reduce, completed_future

__all__ = ["LoopTransport"]


class LoopTransport(RowsThroughBytes, GatherVThroughBytes):
    """A transport for one process that acts as rank 0 of `world_size` ranks which all
    sent the same data: no network, the same buffers and kernels as a real call, so the
    cost model can time the compute of a compressed allreduce alone."""

    backend = None

    def __init__(self, world_size: int):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"LoopTransport: invalid world_size {world_size!r} (must be an int >= 1)")
        self.world_size, self.rank = world_size, 0
        self._rows = StagedRows(self)

    def check_device(self, device) -> None:
        pass

    @staticmethod
    def _done(async_op: bool, value=None):
        return completed_future(value) if async_op else None

    def all_to_all(self, out: Tensor, inp: Tensor, async_op: bool = False):
        out.copy_(inp)
        return self._done(async_op, [out])

    def all_gather(self, out: Tensor, inp: Tensor, async_op: bool = False):
        p = self.world_size
        out.view(p, -1).copy_(inp.reshape(1, -1).expand(p, -1))
        return self._done(async_op, [out])

    def all_reduce(self, tensor: Tensor, op: str = "sum", async_op: bool = False,
                   bucket_bytes: Optional[int] = None):
        check_all_reduce(tensor, op, bucket_bytes)
        if op == "sum":
            tensor.mul_(self.world_size)
        return self._done(async_op, tensor)

    def barrier(self) -> None:
        pass

    def sendrecv(self, sends, recvs, async_op: bool = False):
        """Every peer sent what this rank sends: the k-th recv is filled with the k-th send
        (the counts must match)."""
        if len(sends) != len(recvs):
            raise ValueError(f"LoopTransport.sendrecv: {len(sends)} sends and {len(recvs)} recvs; the loop transport "
                             "plays ranks that all send what this one sends, so the counts must match")
        for (_, s), (_, r) in zip(sends, recvs):
            r.copy_(s)
        return self._done(async_op, [t for _, t in recvs])

