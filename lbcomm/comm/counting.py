"""`CountingTransport`: any transport, with the bytes this rank sends and the collectives
it starts counted (what `lbcomm.ZeroOneAdam.comm_stats` and bench/convergence.py report).

Bytes are those of the algorithms the transports run: a ring all-reduce of B bytes sends
2 (p-1)/p B per rank and bucket, an all-gather of a B-byte contribution (p-1) B, an
all-to-all of a [p, L] buffer (p-1) L (its own row stays), a sendrecv the bytes of its sends. Each collective call is one
communication round (an all-reduce cut into buckets: one round per bucket, all in flight
at once).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..common import ring_allreduce_bytes
from .base import GatherVThroughBytes, RowsThroughBytes, StagedRows, buckets

__all__ = ["CountingTransport"]


class CountingTransport(RowsThroughBytes, GatherVThroughBytes):
    """Wraps `inner` (a transport of `lbcomm.comm`); every attribute other than the counted
    calls is the inner transport's.

    Attributes:
        bytes_sent (int): bytes this rank sent so far.
        rounds (int): collectives started so far (buckets counted one by one).
    """

    def __init__(self, inner):
        self.inner = inner
        self.bytes_sent = 0
        self.rounds = 0
        self._rows = StagedRows(self)  # rows through the counted byte collectives

    def __getattr__(self, name):
        if name.startswith("__") or name in ("inner", "_rows"):  # not yet set (copy, pickle)
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def backend(self):
        return self.inner.backend

    def check_device(self, device) -> None:
        self.inner.check_device(device)

    def barrier(self) -> None:
        self.inner.barrier()

    def _count(self, nbytes: float, rounds: int = 1) -> None:
        if self.inner.world_size > 1:
            self.bytes_sent += int(round(nbytes))
            self.rounds += rounds

    def all_to_all(self, out: Tensor, inp: Tensor, async_op: bool = False):
        p = self.inner.world_size
        self._count(inp.numel() * inp.element_size() * (p - 1) / p)
        return self.inner.all_to_all(out, inp, async_op=async_op)

    def all_gather(self, out: Tensor, inp: Tensor, async_op: bool = False):
        self._count(inp.numel() * inp.element_size() * (self.inner.world_size - 1))
        return self.inner.all_gather(out, inp, async_op=async_op)

    def send_v(self, inp: Tensor, dst: int) -> None:
        """The inner transport's point-to-point send, counted: its length (8 bytes) and bytes."""
        self.inner.send_v(inp, dst)
        if self.inner.world_size > 1:  # one message, the length riding along
            self.bytes_sent += 8 + inp.numel() * inp.element_size()
            self.rounds += 1

    def recv_v(self, src: int, device=None) -> Tensor:
        return self.inner.recv_v(src, device)

    def sendrecv(self, sends, recvs, async_op: bool = False):
        """Counted: the bytes of every send, one round for the whole exchange."""
        self._count(sum(t.numel() * t.element_size() for _, t in sends))
        return self.inner.sendrecv(sends, recvs, async_op=async_op)

    def all_reduce(self, tensor: Tensor, op: str = "sum", async_op: bool = False,
                   bucket_bytes: Optional[int] = None):
        parts = buckets(tensor.reshape(-1), bucket_bytes)
        self._count(sum(ring_allreduce_bytes(b.numel() * b.element_size(), self.inner.world_size) for b in parts),
                    len(parts))
        return self.inner.all_reduce(tensor, op=op, async_op=async_op, bucket_bytes=bucket_bytes)

