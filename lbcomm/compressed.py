"""The 1-bit compressed allreduce with two-stage error feedback (DESIGN.md §1), once.

Every backend, optimizer and hook goes through `compressed_allreduce`; transports only
move bytes. Per call and rank:

    phase 0  worker_compress(x, e)            -> signs + block scales of x + e
    phase 1  all-to-all                          rank k receives chunk k from every rank
    phase 2  server_compress(chunks, s)       -> signs + block scales of the chunk mean + s
    phase 3  all-gather                          every rank receives every server chunk
    decode   unpack                            -> approximate mean, bitwise equal on all ranks

Pipelining: with block scales, every block is independent, so each chunk is cut into
`pieces` runs of whole blocks and the phases run piece by piece: piece s+1 is compressed
while piece s crosses the network, and the server reduces piece s while later pieces
travel. Results are bitwise those of one piece (tests check it); a call then costs 2 x
pieces collectives, so only tensors of at least PIECE_MIN elements per chunk and piece
are cut (block_size=None, one scale per tensor, is never cut).

Wire rows: a piece's sign bytes, its fp32 block scales, then a 24-byte header (numel,
call count, block size, piece, pieces), so every rank sees every other rank's header in
the all-to-all: ranks that call with different tensors, or out of step, all raise the
same clear error. Different row lengths would abort the process inside gloo, so each
state first checks the layout once with a fixed-size all-gather (its first call). New
errors are written to spare buffers and swapped in only after the last all-gather, once
every rank has seen every server scale: a non-finite value anywhere is detected
identically everywhere and leaves the error state exactly as it was; the output is
decoded only then, so `out` is untouched by a skipped call.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Union

import torch
from torch import Tensor

from . import ops
from .comm import get_transport
from .reference import ALIGN, chunk_size, num_blocks

__all__ = ["CompressionState", "compressed_allreduce", "NonFiniteError", "DEFAULT_BLOCK_SIZE", "PIECE_MIN"]

_log = logging.getLogger(__name__)

# Elements per scale block. Chosen by the convergence measurements in bench/convergence.py
# (README, "Choosing the block size"); 1.6 % of the sign bits in scale overhead.
DEFAULT_BLOCK_SIZE = 2048
_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
_NONFINITE = ("raise", "skip")
_HEADER = 24  # int32 numel low, numel high, call count, block size (0: none), piece, pieces
# Automatic pipelining: pieces of at least PIECE_MIN elements of a chunk (256 KB of sign
# bits per row), at most MAX_PIECES. Measured at 1 Gbit/s (README, "Pipelining").
PIECE_MIN = 1 << 21
MAX_PIECES = 4


class NonFiniteError(FloatingPointError):
    """A compressed allreduce saw NaN/Inf; raised on every rank, error state untouched."""


def _check_block_size(block_size: Optional[int]) -> None:
    if block_size is None:
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 or block_size % ALIGN:
        raise ValueError(f"Invalid block_size: {block_size!r} (use None or a positive multiple of {ALIGN})")


class CompressionState:
    """Error-feedback state of compressed allreduces of one tensor size on one group.

    Args:
        numel (int): elements of the tensors this state will reduce.
        group (ProcessGroup, optional): the torch.distributed group (default: the world).
        device (torch.device, optional): where the error buffers live (default: the current
            CUDA device for an NCCL group, else the CPU).
        block_size (int or None, optional): elements per scale block, a multiple of 32;
            None selects the published single-scale algorithm (default: 2048).
        nonfinite (str, optional): what a call does when an input holds NaN/Inf:
            "raise" a NonFiniteError on every rank, or "skip" (the result is all NaN,
            ``last_skipped`` is True). Errors stay exactly as before either way.
            (default: "raise")
        backend (str, optional): "torch" (a torch.distributed group), "mpi" (mpi4py; `group`
            is then an mpi4py communicator) or "auto": torch.distributed when initialized,
            else MPI under mpirun; see `lbcomm.comm.get_transport` (default: "auto").
        pieces (int, optional): runs of whole blocks each chunk is cut into, so that
            compression overlaps the transfers (see the module docs); results do not
            depend on it. Every rank must use the same value. None: one piece per
            PIECE_MIN elements of a chunk, at most MAX_PIECES, for CPU tensors; 1 for
            CUDA tensors (not measured there yet) and for block_size=None (default: None).

    Attributes:
        worker_error (Tensor): this rank's worker error, n (padded numel) fp32 elements.
        server_error (Tensor): the error of the chunk this rank serves, n / p elements.
    """

    def __init__(
        self,
        numel: int,
        group=None,
        device: Optional[Union[str, torch.device]] = None,
        block_size: Optional[int] = DEFAULT_BLOCK_SIZE,
        *,
        nonfinite: str = "raise",
        transport=None,
        backend: str = "auto",
        pieces: Optional[int] = None,
    ):
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"Invalid numel: {numel!r} (must be a non-negative int)")
        _check_block_size(block_size)
        if nonfinite not in _NONFINITE:
            raise ValueError(f"Invalid nonfinite policy: {nonfinite!r} (use one of {_NONFINITE})")
        self.transport = transport if transport is not None else get_transport(group, backend=backend)
        self.group = group
        self.world_size = self.transport.world_size
        self.rank = self.transport.rank
        if device is None:
            backend = str(getattr(self.transport, "backend", "") or "").lower()
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self.transport_check = getattr(self.transport, "check_device", None)
        if self.transport_check is not None:
            self.transport_check(self.device)
        self.numel = numel
        self.block_size = block_size
        self.nonfinite = nonfinite
        self.chunk = chunk_size(numel, self.world_size)  # m: elements per rank's chunk
        self._set_pieces(self._count_pieces(pieces))
        f32 = dict(dtype=torch.float32, device=self.device)
        self._worker = torch.zeros(self.world_size, self.chunk, **f32)
        self._server = torch.zeros(self.chunk, **f32)
        self._spare: Optional[tuple] = None  # (worker, server) receiving the next errors
        self._bufs: Optional[tuple] = None  # wire buffers, allocated on first use
        self._busy = False
        self._verified = False
        self.calls = 0
        self.skipped = 0
        self.last_skipped = False

    # ------------------------------------------------------------------ state
    @property
    def worker_error(self) -> Tensor:
        return self._worker.view(-1)

    @property
    def server_error(self) -> Tensor:
        return self._server

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.world_size

    def bytes_per_call(self) -> int:
        """Bytes this rank sends per call (all collectives, own chunk excluded)."""
        return 2 * (self.world_size - 1) * sum(self._rows) if self.world_size > 1 else 0

    def _count_pieces(self, pieces: Optional[int]) -> int:
        """Pieces per chunk: the requested count, or automatically one per PIECE_MIN
        elements of a chunk, at most MAX_PIECES."""
        if pieces is not None:
            if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
                raise ValueError(f"Invalid pieces: {pieces!r} (use None or a positive int)")
            if pieces > 1 and self.block_size is None:
                raise ValueError("pieces > 1 needs block scales: block_size=None has one scale for the whole tensor")
            return pieces
        if self.block_size is None or self.device.type != "cpu":  # CUDA: pipelining not measured yet
            return 1
        return min(MAX_PIECES, max(1, self.chunk // PIECE_MIN))

    def _set_pieces(self, count: int) -> None:
        m, block = self.chunk, self.block_size
        if block is None or self.world_size == 1 or m <= block or count <= 1:
            self.pieces = [(0, m)]
        else:
            per = -(-m // count)
            q = -(-per // block) * block  # m / count, rounded up to whole blocks
            self.pieces = [(lo, min(lo + q, m)) for lo in range(0, m, q)]
        # bytes per row (one chunk's piece) on the wire
        self._rows = [(hi - lo) // 8 + 4 * num_blocks(hi - lo, block) + _HEADER for lo, hi in self.pieces]

    def reset(self) -> None:
        """Zero both error buffers (e.g. after a change of world size)."""
        self._worker.zero_()
        self._server.zero_()

    def state_dict(self) -> Dict[str, Any]:
        """This rank's error buffers and the layout they belong to (one shard per rank)."""
        return {
            "numel": self.numel,
            "world_size": self.world_size,
            "rank": self.rank,
            "block_size": self.block_size,
            "worker_error": self._worker.clone(),
            "server_error": self._server.clone(),
            "calls": self.calls,
            "skipped": self.skipped,
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> bool:
        """Restore error buffers saved by `state_dict`. Returns False, with a logged
        warning and zeroed errors, when they were saved for another world size, rank,
        size or block size (they cannot be mapped onto this layout)."""
        self._ensure_idle()
        layout = (sd.get("numel"), sd.get("world_size"), sd.get("rank"), sd.get("block_size"))
        mine = (self.numel, self.world_size, self.rank, self.block_size)
        self.calls = int(sd.get("calls", 0))
        self.skipped = int(sd.get("skipped", 0))
        if layout != mine:
            _log.warning(
                "lbcomm: compression error buffers were saved for (numel, world_size, rank, block_size)=%s "
                "but this run has %s; resetting them to zero and continuing",
                layout,
                mine,
            )
            self.reset()
            return False
        self._worker.copy_(sd["worker_error"].reshape(self._worker.shape))
        self._server.copy_(sd["server_error"].reshape(self._server.shape))
        return True

    def _ensure_idle(self) -> None:
        if self._busy:
            raise RuntimeError("a compressed allreduce on this CompressionState is still in flight; wait for its "
                               "future before starting another call or touching its state")

    def _buffers(self):
        """Per piece: (send [p, row], receive [p, row], server send [row], gathered [p, row])."""
        if self._bufs is None:
            p = self.world_size
            u8 = dict(dtype=torch.uint8, device=self.device)
            self._spare = (torch.empty_like(self._worker), torch.empty_like(self._server))
            self._bufs = [(torch.empty(p, row, **u8), torch.empty(p, row, **u8), torch.empty(row, **u8),
                           torch.empty(p, row, **u8)) for row in self._rows]
            _log.info("lbcomm: compressed allreduce of %s elements over %s ranks: chunk %s, block_size %s, "
                      "%s piece(s), %s bytes sent per call", self.numel, p, self.chunk, self.block_size,
                      len(self.pieces), self.bytes_per_call())
        return self._bufs


class _Call:
    """One compressed allreduce in flight: the phases, shared by the sync and async drivers."""

    def __init__(self, tensor: Tensor, state: CompressionState, group, out: Optional[Tensor]):
        if not isinstance(state, CompressionState):
            raise TypeError(f"compressed_allreduce: state must be a CompressionState, got {type(state).__name__}")
        if not isinstance(tensor, Tensor):
            raise TypeError(f"compressed_allreduce: expected a tensor, got {type(tensor).__name__}")
        if tensor.dtype not in _FLOAT_TYPES:
            raise TypeError(f"compressed_allreduce: expected a float32/float16/bfloat16 tensor, got {tensor.dtype}")
        if tensor.numel() != state.numel:
            raise ValueError(f"compressed_allreduce: the tensor has {tensor.numel()} elements but the state was built "
                             f"for {state.numel}; use one CompressionState per tensor size")
        if tensor.device != state.device:
            raise ValueError(f"compressed_allreduce: the tensor is on {tensor.device} but the state's error buffers "
                             f"are on {state.device}; build the state with device={tensor.device!s}")
        if group is not None and group is not state.group:
            raise ValueError("compressed_allreduce: the state was built for another process group; build one "
                             "CompressionState per group")
        if out is not None and (not isinstance(out, Tensor) or out.dtype not in _FLOAT_TYPES
                                or out.numel() != tensor.numel() or out.device != tensor.device):
            raise ValueError("compressed_allreduce: out must be a float32/float16/bfloat16 tensor with as many "
                             "elements as the input, on the same device")
        state._ensure_idle()
        self.tensor, self.state, self.out = tensor, state, out
        self.flat: Optional[Tensor] = None  # the input as one flat view (made when cut into pieces)

    def _header(self, piece: int) -> Tensor:
        st = self.state
        return torch.tensor([st.numel & 0x7FFFFFFF, st.numel >> 31, st.calls & 0x7FFFFFFF, st.block_size or 0,
                             piece, len(st.pieces)], dtype=torch.int32)

    def _handshake(self) -> None:
        """Once per state: every rank's layout, compared before any variable-size collective."""
        st = self.state
        mine = torch.tensor([st.numel, st.block_size or 0, st.chunk, st.calls, len(st.pieces)], dtype=torch.int64)
        k = mine.numel()
        everyone = torch.empty(st.world_size * k, dtype=torch.int64, device=st.device)
        st.transport.all_gather(everyone.view(torch.uint8), mine.to(st.device).view(torch.uint8))
        rows = everyone.view(st.world_size, k).cpu()
        if not bool((rows == mine).all()):
            desc = ", ".join(f"rank {r}: numel={int(v[0])} block_size={int(v[1]) or None} calls={int(v[3])} "
                             f"pieces={int(v[4])}" for r, v in enumerate(rows))
            raise ValueError("compressed_allreduce: ranks called with different tensors or state layouts "
                             f"({desc}); every rank must reduce the same sizes in the same order")
        st._verified = True

    def _check_headers(self, rows: Tensor, piece: int) -> None:
        heads = rows[:, -_HEADER:].contiguous().view(torch.int32).cpu()
        mine = self._header(piece)
        if not bool((heads == mine).all()):
            desc = ", ".join(f"rank {r}: numel={int(h[0]) + (int(h[1]) << 31)} call={int(h[2])} "
                             f"block_size={int(h[3]) or None} piece={int(h[4])}/{int(h[5])}"
                             for r, h in enumerate(heads))
            raise ValueError("compressed_allreduce: ranks called with different tensors or are out of step "
                             f"({desc}); the error buffers are unchanged")

    def _piece(self, s: int):
        """(lo, hi, sign bytes, end of the scales) of piece s, in elements and row bytes."""
        lo, hi = self.state.pieces[s]
        return lo, hi, (hi - lo) // 8, self.state._rows[s] - _HEADER

    def phase0(self, s: int) -> Tensor:
        """Worker compress of piece s of every chunk into its send rows."""
        st = self.state
        send = st._buffers()[s][0]
        if not st._verified:
            self._handshake()
        st._busy = True
        lo, hi, q8, sc_end = self._piece(s)
        if len(st.pieces) == 1:  # the whole tensor (the only way with one scale for everything)
            rows = [(ops.worker_compress(self.tensor, st._worker, st.block_size, error_out=st._spare[0]), slice(None))]
        else:
            if self.flat is None:
                self.flat = self.tensor.reshape(-1)
            m, n0 = st.chunk, st.numel
            rows = [(ops.worker_compress(self.flat[j * m + lo:max(j * m + lo, min(j * m + hi, n0))],
                                         st._worker[j, lo:hi], st.block_size, error_out=st._spare[0][j, lo:hi]), j)
                    for j in range(st.world_size)]
        for (packed, scales), j in rows:
            send[j, :q8].copy_(packed)
            send[j, q8:sc_end].view(torch.float32).copy_(scales)
        send[:, sc_end:].copy_(self._header(s).view(torch.uint8))
        return send

    def phase2(self, s: int) -> Tensor:
        """Server reduce + compress of piece s of this rank's chunk into its all-gather row."""
        st = self.state
        _, recv, gsend, _ = st._bufs[s]
        self._check_headers(recv, s)  # every rank sees every header: all raise, or none
        lo, hi, q8, sc_end = self._piece(s)
        real = min(max(st.numel - st.rank * st.chunk - lo, 0), hi - lo)
        packed, scales = ops.server_compress(recv[:, :q8], recv[:, q8:sc_end].view(torch.float32),
                                             st._server[lo:hi], st.block_size, real, error_out=st._spare[1][lo:hi])
        gsend[:q8].copy_(packed)
        gsend[q8:sc_end].view(torch.float32).copy_(scales)
        gsend[sc_end:].copy_(self._header(s).view(torch.uint8))
        return gsend

    def finish(self) -> Tensor:
        st = self.state
        pieces = [(st._bufs[s][3], *self._piece(s)) for s in range(len(st.pieces))]
        st.calls += 1
        st._busy = False
        # Every rank holds every server scale now, so all reach the same verdict.
        if not all(bool(torch.isfinite(g[:, q8:end].view(torch.float32)).all()) for g, _, _, q8, end in pieces):
            st.skipped += 1
            st.last_skipped = True
            if st.nonfinite == "raise":
                raise NonFiniteError(
                    "compressed_allreduce: the input holds NaN or Inf on at least one rank (the error buffers are "
                    "unchanged); check for overflow, or pass nonfinite='skip' to the CompressionState")
            return self.out if self.out is not None else torch.full_like(self.tensor, float("nan"))
        st.last_skipped = False
        (new_worker, new_server), st._spare = st._spare, (st._worker, st._server)
        st._worker, st._server = new_worker, new_server
        out = self.out if self.out is not None else torch.empty_like(self.tensor, memory_format=torch.contiguous_format)
        if len(pieces) == 1:
            g, _, _, q8, end = pieces[0]
            return ops.unpack_into(g[:, :q8], g[:, q8:end].view(torch.float32), st.block_size, out)
        direct = out.dtype == torch.float32 and out.is_contiguous()
        flat = out.view(-1) if direct else torch.empty(st.numel, dtype=torch.float32, device=out.device)
        m, n0 = st.chunk, st.numel
        for g, lo, hi, q8, end in pieces:
            for k in range(st.world_size):
                a, b = k * m + lo, min(k * m + hi, n0)
                if b > a:
                    ops.unpack_into(g[k:k + 1, :q8], g[k:k + 1, q8:end].view(torch.float32), st.block_size, flat[a:b])
        if not direct:
            out.copy_(flat.view(out.shape))
        return out

    def abort(self) -> None:
        self.state._busy = False


def _future(device: torch.device) -> torch.futures.Future:
    # A CUDA-aware future records the producing stream, so waiters on other streams sync.
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


def compressed_allreduce(
    tensor: Tensor, state: CompressionState, group=None, async_op: bool = False, out: Optional[Tensor] = None
):
    """Approximate MEAN of `tensor` over the ranks of the state's group, in 1 bit per element.

    Args:
        tensor (Tensor): float32/float16/bfloat16, `state.numel` elements, on `state.device`.
            Not modified.
        state (CompressionState): this rank's error feedback for this tensor size.
        group (ProcessGroup, optional): must be the state's group if given (default: None).
        async_op (bool, optional): return a torch.futures.Future of the result; the two
            collectives are chained through callbacks without blocking. Keep one async
            call in flight per process group: the second collective is issued from a
            callback, so two concurrent calls could interleave differently on different
            ranks (the wire headers then make every rank raise). lbcomm.ddp.onebit_hook
            serializes its buckets on a worker thread for this reason (default: False).
        out (Tensor, optional): receives the result (may be `tensor` itself, for an
            in-place reduction; a float32 contiguous out is decoded without allocating).
            Left unchanged by a call skipped for non-finite input (default: None).

    Returns:
        `out`, or a new tensor of `tensor`'s shape and dtype, bitwise identical on every
        rank (or a Future of it). With one rank nothing is compressed: the input itself
        is returned (copied into `out` when given).
    """
    call = _Call(tensor, state, group, out)
    if state.world_size == 1 or state.numel == 0:
        result = tensor if out is None else (out if out is tensor else out.copy_(tensor))
        if not async_op:
            return result
        fut = _future(tensor.device)
        fut.set_result(result)
        return fut
    tr = state.transport
    bufs = state._buffers()
    count = len(state.pieces)
    # Every rank issues the same collectives in the same order, sync or async: the
    # all-to-alls of all pieces (each as soon as its piece is compressed), then the
    # all-gathers in piece order (each as soon as its all-to-all has arrived).
    if not async_op:
        try:
            sent = [tr.all_to_all(bufs[s][1], call.phase0(s), async_op=True) for s in range(count)]
            gathered = []
            for s in range(count):
                sent[s].wait()
                gathered.append(tr.all_gather(bufs[s][3], call.phase2(s), async_op=True))
            for fut in gathered:
                fut.wait()
            return call.finish()
        except BaseException:
            call.abort()
            raise

    result = _future(tensor.device)
    gathered: list = []

    def fail(exc: BaseException) -> None:
        call.abort()
        if not result.done():
            result.set_exception(exc)

    def after_gathers(_) -> None:
        try:
            for fut in gathered:
                fut.value()
            result.set_result(call.finish())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
            fail(exc)

    def serve(s: int, fut) -> None:
        try:
            fut.value()
            gathered.append(tr.all_gather(bufs[s][3], call.phase2(s), async_op=True))
            if s + 1 < count:
                sent[s + 1].add_done_callback(lambda f: serve(s + 1, f))
            else:
                torch.futures.collect_all(gathered).add_done_callback(after_gathers)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
            fail(exc)

    try:
        sent = [tr.all_to_all(bufs[s][1], call.phase0(s), async_op=True) for s in range(count)]
    except BaseException:
        call.abort()
        raise
    sent[0].add_done_callback(lambda f: serve(0, f))
    return result
