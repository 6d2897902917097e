"""The `Transport` protocol every transport implements, and what they share: argument
checks, bucketing, the mean of an allreduce and the row collectives built on the byte
collectives (`StagedRows`)."""
from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch
from torch import Tensor

from ..common import completed_future

__all__ = ["Transport", "StagedRows", "RowsThroughBytes", "GatherVThroughBytes",
           "REDUCE_OPS", "check_all_reduce", "check_sendrecv", "buckets", "finish_all_reduce",
           "completed_future"]

REDUCE_OPS = ("sum", "mean", "max", "min")


@runtime_checkable
class Transport(Protocol):
    """What lbcomm needs from a network (see `lbcomm.comm`): the byte collectives, an
    in-place allreduce, a barrier, and the row collectives of the hierarchical call.

    With ``async_op=True`` a collective returns a torch.futures.Future that completes when
    its output is filled; otherwise it blocks and returns its result (None for the byte
    collectives). Every rank calls the collectives in the same order.

    Row collectives: ``rows_out(rows, row_bytes, device)`` hands out a uint8 [rows,
    row_bytes] buffer owned by the transport, which the caller fills with its contribution
    to the next row collective; then ``all_to_all_rows()`` (rows = world size: row j goes
    to rank j) or ``all_gather_rows()`` (rows = 1) returns the list of world-size rows this
    rank receives, row j from rank j. The returned rows are valid until the next row
    collective but one. A transport may hand out memory that other ranks read in place
    (shared memory) or exchange buffers through its byte collectives; the caller cannot
    tell. A rank need not fill the row it sends to itself in an all-to-all (it reads its
    own data from where it is).
    """

    world_size: int
    rank: int
    backend: Optional[str]

    def check_device(self, device: torch.device) -> None:
        """Raise a clear error for a device whose tensors this transport cannot move."""

    def all_to_all(self, out: Tensor, inp: Tensor, async_op: bool = False):
        """Row j of `inp` [p, L] to rank j; row j of `out` from rank j."""

    def all_gather(self, out: Tensor, inp: Tensor, async_op: bool = False):
        """Every rank's [L] `inp` into the flat [p * L] `out`, in rank order."""

    def all_reduce(self, tensor: Tensor, op: str = "sum", async_op: bool = False,
                   bucket_bytes: Optional[int] = None):
        """In place; op one of REDUCE_OPS; buckets of bucket_bytes all in flight at once."""

    def barrier(self) -> None:
        """Block until every rank has called it."""

    def sendrecv(self, sends: Sequence[Tuple[int, Tensor]], recvs: Sequence[Tuple[int, Tensor]],
                 async_op: bool = False):
        """Point-to-point exchange with a few peers (the neighbours of a decentralized
        optimizer), every message in flight at once: each (peer, tensor) of `sends` goes to
        that peer, each (peer, tensor) of `recvs` is filled from it. The k-th send from a to
        b fills the k-th recv on b from a (same numel and dtype). Only the ranks named take
        part; peers are ranks of the group other than this one. The future holds `recvs`'
        tensors."""

    def rows_out(self, rows: int, row_bytes: int, device: torch.device) -> Tensor:
        """This rank's [rows, row_bytes] uint8 contribution to the next row collective."""

    def all_to_all_rows(self, async_op: bool = False):
        """The staged [p, row_bytes] rows exchanged: a list of p rows, row j from rank j."""

    def all_gather_rows(self, async_op: bool = False):
        """The staged [1, row_bytes] row of every rank: a list of p rows, row j from rank j."""

    def all_gather_v(self, inp: Tensor) -> List[Tensor]:
        """Every rank's 1-D uint8 `inp`, of any length (ranks may differ): a list of p uint8
        tensors, entry j from rank j (blocking; the sparse exchanges of DCT)."""


class GatherVThroughBytes:
    """`Transport.all_gather_v` through a transport's own `all_gather`: the lengths first
    (one int64 per rank), then every contribution zero-padded to the longest one. A rank
    thus sends (p-1) (8 + longest) bytes; the entries returned are views of one buffer,
    valid until the next call."""

    def all_gather_v(self, inp: Tensor) -> List[Tensor]:
        if not isinstance(inp, Tensor) or inp.dtype != torch.uint8 or inp.dim() != 1:
            raise TypeError(f"all_gather_v: expected a 1-D uint8 tensor, got "
                            f"{getattr(inp, 'dtype', type(inp).__name__)} of shape {tuple(getattr(inp, 'shape', ()))}")
        p = self.world_size
        if p == 1:
            return [inp.clone()]
        n = torch.tensor([inp.numel()], dtype=torch.int64, device=inp.device)
        counts = torch.empty(p, dtype=torch.int64, device=inp.device)
        self.all_gather(counts.view(torch.uint8), n.view(torch.uint8))
        sizes = counts.tolist()
        top = max(sizes)
        if top == 0:
            return [inp.new_empty(0) for _ in range(p)]
        send = torch.zeros(top, dtype=torch.uint8, device=inp.device)
        send[:inp.numel()].copy_(inp)
        recv = torch.empty(p * top, dtype=torch.uint8, device=inp.device)
        self.all_gather(recv, send)
        return [recv[j * top:j * top + sizes[j]] for j in range(p)]


class RowsThroughBytes:
    """The row collectives of `Transport` for a transport with byte collectives: delegated
    to the `StagedRows` it holds as ``self._rows``."""

    def rows_out(self, rows: int, row_bytes: int, device) -> Tensor:
        return self._rows.rows_out(rows, row_bytes, device)

    def all_to_all_rows(self, async_op: bool = False):
        return self._rows.all_to_all_rows(async_op)

    def all_gather_rows(self, async_op: bool = False):
        return self._rows.all_gather_rows(async_op)


class StagedRows:
    """The row collectives of `Transport` through a transport's own byte collectives:
    buffers kept here per size and device (allocated once, zero-filled), exchanged with
    `all_to_all` / `all_gather` of `transport`."""

    def __init__(self, transport):
        self.transport = transport
        self._send: Dict[Tuple[int, int, torch.device], Tensor] = {}
        self._recv: Dict[Tuple[str, int, torch.device], Tensor] = {}
        self._staged: Optional[Tensor] = None

    def rows_out(self, rows: int, row_bytes: int, device: torch.device) -> Tensor:
        key = (rows, row_bytes, torch.device(device))
        buf = self._send.get(key)
        if buf is None:
            buf = self._send[key] = torch.zeros(rows, row_bytes, dtype=torch.uint8, device=device)
        self._staged = buf
        return buf

    def _take(self, rows: int, what: str) -> Tensor:
        send, self._staged = self._staged, None
        if send is None or send.shape[0] != rows:
            raise RuntimeError(f"{what}: stage {rows} row(s) with rows_out() first")
        return send

    def _receive(self, kind: str, send: Tensor) -> Tensor:
        p, key = self.transport.world_size, (kind, send.shape[1], send.device)
        buf = self._recv.get(key)
        if buf is None:
            buf = self._recv[key] = torch.empty(p, send.shape[1], dtype=torch.uint8, device=send.device)
        return buf

    @staticmethod
    def _result(fut, rows: List[Tensor], async_op: bool):
        if not async_op:
            return rows
        return fut.then(lambda f: (f.value(), rows)[1])

    def all_to_all_rows(self, async_op: bool = False):
        send = self._take(self.transport.world_size, "all_to_all_rows")
        recv = self._receive("all_to_all", send)
        fut = self.transport.all_to_all(recv, send, async_op=async_op)
        return self._result(fut, list(recv), async_op)

    def all_gather_rows(self, async_op: bool = False):
        send = self._take(1, "all_gather_rows")
        recv = self._receive("all_gather", send)
        fut = self.transport.all_gather(recv.view(-1), send.view(-1), async_op=async_op)
        return self._result(fut, list(recv), async_op)


def check_all_reduce(tensor: Tensor, op: str, bucket_bytes: Optional[int]) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"all_reduce: expected a tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("all_reduce: the tensor must be contiguous (it is reduced in place)")
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce: invalid op {op!r} (use one of {REDUCE_OPS})")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                     or bucket_bytes <= 0):
        raise ValueError(f"all_reduce: invalid bucket_bytes {bucket_bytes!r} (use None or a positive int)")


def check_sendrecv(sends, recvs, world_size: int, rank: int, who: str) -> None:
    """Raise a clear error for a malformed `Transport.sendrecv` call."""
    for what, pairs in (("sends", sends), ("recvs", recvs)):
        for item in pairs:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], Tensor)):
                raise TypeError(f"{who}.sendrecv: {what} must be (peer, tensor) pairs, got {item!r:.80}")
            peer, t = item
            if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < world_size or peer == rank:
                raise ValueError(f"{who}.sendrecv: invalid peer {peer!r} in {what} (another rank of the group: 0 .. "
                                 f"{world_size - 1}, not this rank {rank})")
            if not t.is_contiguous():
                raise ValueError(f"{who}.sendrecv: the tensors must be contiguous")


def buckets(flat: Tensor, bucket_bytes: Optional[int]) -> List[Tensor]:
    """`flat` cut into views of at most bucket_bytes each (one view when None)."""
    if bucket_bytes is None or flat.numel() == 0:
        return [flat]
    cap = max(1, bucket_bytes // flat.element_size())
    return [flat[s:s + cap] for s in range(0, flat.numel(), cap)]


def finish_all_reduce(tensor: Tensor, op: str, world_size: int, futures: List[torch.futures.Future],
                      async_op: bool):
    """Wait for (or chain onto) the bucket futures; divide by the world size for a mean."""

    def done(_=None) -> Tensor:
        for f in futures:
            f.value()  # raises the collective's error, if any
        if op == "mean":
            tensor.div_(world_size)
        return tensor

    if not async_op:
        for f in futures:
            f.wait()
        done()
        return None
    if len(futures) == 1:
        return futures[0].then(done)
    return torch.futures.collect_all(futures).then(done)


# gloo's collectives (a ring) take p - 1 (all-gather) or 2 (p - 1) (allreduce) dependent
# rounds, each a message latency (a 50 ms hop on a wide-area link) and a wake-up of every
# rank; one all-to-all takes one round for the same bytes per rank. The gloo transports
# gather through it, and allreduce through it the tensors whose copies to every other rank
# cost at most this many bytes per rank.
SMALL_ALL_REDUCE_BYTES = 128 << 10
_GATHERED = (torch.float32, torch.float64, torch.int32, torch.int64)


def one_round(backend, tensor: Tensor) -> bool:
    """Whether a collective of `tensor` goes through one all-to-all: on gloo, CPU tensors."""
    return "gloo" in str(backend).lower() and tensor.device.type == "cpu"


def small_for_one_round(tensor: Tensor, world_size: int) -> bool:
    """Whether an allreduce of `tensor` is small enough to gather (SMALL_ALL_REDUCE_BYTES)."""
    return (tensor.dtype in _GATHERED
            and tensor.numel() * tensor.element_size() * (world_size - 1) <= SMALL_ALL_REDUCE_BYTES)


def all_gather_one_round(all_to_all, out: Tensor, inp: Tensor, world_size: int, async_op: bool):
    """All-gather as one all-to-all that sends `inp` to every rank (`all_to_all` is the
    transport's; it keeps the send buffer alive while the collective runs)."""
    send = inp.reshape(1, -1).expand(world_size, -1).contiguous()
    return all_to_all(out, send, async_op=async_op)


def all_reduce_one_round(all_to_all, tensor: Tensor, op: str, world_size: int, async_op: bool):
    """Allreduce of a small tensor: every rank's copy gathered by one all-to-all and reduced
    here in rank order, one IEEE operation at a time, so every rank gets the same bits on
    any CPU."""
    p, flat = world_size, tensor.view(-1)
    rows = flat.new_empty(p, flat.numel())
    fut = all_gather_one_round(all_to_all, rows, flat, p, async_op=True)

    def done(_=None) -> Tensor:
        fut.value()  # raises the collective's error, if any
        acc = rows[0]
        for r in range(1, p):
            if op in ("sum", "mean"):
                acc.add_(rows[r])
            elif op == "max":
                torch.maximum(acc, rows[r], out=acc)
            else:
                torch.minimum(acc, rows[r], out=acc)
        flat.copy_(acc)
        if op == "mean":
            tensor.div_(p)
        return tensor

    if async_op:
        return fut.then(done)
    fut.wait()
    done()
    return None
