"""The 1-bit compressed allreduce with two-stage error feedback (DESIGN.md §1), once.

Every backend, optimizer and hook goes through `compressed_allreduce`; transports only
move bytes. Per call and rank:

    phase 0  worker_compress(x, e)            -> signs + block scales of x + e
    phase 1  all-to-all                          rank k receives chunk k from every rank
    phase 2  server_compress(chunks, s)       -> signs + block scales of the chunk mean + s
    phase 3  all-gather                          every rank receives every server chunk
    decode   unpack                            -> approximate mean, bitwise equal on all ranks

Wire rows: a chunk's m/8 sign bytes, its fp32 block scales, then a 16-byte header
(numel, call count, block size), so each phase is one collective and every rank sees
every other rank's header in the all-to-all: ranks that call with different tensors, or
out of step, all raise the same clear error. Different row lengths would abort the
process inside gloo, so each state first checks the layout once with a fixed-size
all-gather (its first call). New errors are written to spare buffers and swapped in only after phase
3, once every rank has seen every server scale: a non-finite value anywhere is detected
identically everywhere and leaves the error state exactly as it was.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Union

import torch
from torch import Tensor

from . import ops
from .comm import get_transport
from .reference import ALIGN, chunk_size, num_blocks

__all__ = ["CompressionState", "compressed_allreduce", "NonFiniteError", "DEFAULT_BLOCK_SIZE"]

_log = logging.getLogger(__name__)

# Elements per scale block. Chosen by the convergence measurements in bench/convergence.py
# (README, "Choosing the block size"); 1.6 % of the sign bits in scale overhead.
DEFAULT_BLOCK_SIZE = 2048
_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
_NONFINITE = ("raise", "skip")
_HEADER = 16  # int32 numel low, numel high, call count, block size (0: none)


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
        self._nb = num_blocks(self.chunk, block_size)
        self._row = self.chunk // 8 + 4 * self._nb + _HEADER  # bytes per chunk on the wire
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
        """Bytes this rank sends per call (both collectives, own chunk excluded)."""
        return 2 * (self.world_size - 1) * self._row if self.world_size > 1 else 0

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
        if self._bufs is None:
            p, row, m = self.world_size, self._row, self.chunk
            u8 = dict(dtype=torch.uint8, device=self.device)
            self._spare = (torch.empty_like(self._worker), torch.empty_like(self._server))
            self._bufs = (torch.empty(p, row, **u8), torch.empty(p, row, **u8), torch.empty(row, **u8),
                          torch.empty(p * row, **u8))
            _log.info("lbcomm: compressed allreduce of %s elements over %s ranks: chunk %s, block_size %s, "
                      "%s bytes sent per call", self.numel, p, m, self.block_size, self.bytes_per_call())
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

    def _header(self) -> Tensor:
        st = self.state
        return torch.tensor([st.numel & 0x7FFFFFFF, st.numel >> 31, st.calls & 0x7FFFFFFF, st.block_size or 0],
                            dtype=torch.int32)

    def _handshake(self) -> None:
        """Once per state: every rank's layout, compared before any variable-size collective."""
        st = self.state
        mine = torch.tensor([st.numel, st.block_size or 0, st.chunk, st.calls], dtype=torch.int64)
        everyone = torch.empty(st.world_size * 4, dtype=torch.int64, device=st.device)
        st.transport.all_gather(everyone.view(torch.uint8), mine.to(st.device).view(torch.uint8))
        rows = everyone.view(st.world_size, 4).cpu()
        if not bool((rows == mine).all()):
            desc = ", ".join(f"rank {r}: numel={int(v[0])} block_size={int(v[1]) or None} calls={int(v[3])}"
                             for r, v in enumerate(rows))
            raise ValueError("compressed_allreduce: ranks called with different tensors or state layouts "
                             f"({desc}); every rank must reduce the same sizes in the same order")
        st._verified = True

    def _check_headers(self, rows: Tensor) -> None:
        heads = rows[:, -_HEADER:].contiguous().view(torch.int32).cpu()
        mine = self._header()
        if not bool((heads == mine).all()):
            desc = ", ".join(f"rank {r}: numel={int(h[0]) + (int(h[1]) << 31)} call={int(h[2])} "
                             f"block_size={int(h[3]) or None}" for r, h in enumerate(heads))
            raise ValueError("compressed_allreduce: ranks called with different tensors or are out of step "
                             f"({desc}); the error buffers are unchanged")

    def phase0(self) -> Tensor:
        st = self.state
        send, _, _, _ = st._buffers()
        if not st._verified:
            self._handshake()
        st._busy = True
        m8, sc_end = st.chunk // 8, st._row - _HEADER
        packed, scales = ops.worker_compress(self.tensor, st._worker, st.block_size, error_out=st._spare[0])
        send[:, :m8].copy_(packed)
        send[:, m8:sc_end].view(torch.float32).copy_(scales)
        send[:, sc_end:].copy_(self._header().view(torch.uint8))
        return send

    def phase2(self) -> Tensor:
        st = self.state
        _, recv, gsend, _ = st._bufs
        self._check_headers(recv)  # every rank sees every header: all raise, or none
        m, m8, sc_end = st.chunk, st.chunk // 8, st._row - _HEADER
        real = min(max(st.numel - st.rank * m, 0), m)
        packed, scales = ops.server_compress(recv[:, :m8], recv[:, m8:sc_end].view(torch.float32), st._server,
                                             st.block_size, real, error_out=st._spare[1])
        gsend[:m8].copy_(packed)
        gsend[m8:sc_end].view(torch.float32).copy_(scales)
        gsend[sc_end:].copy_(self._header().view(torch.uint8))
        return gsend

    def finish(self) -> Tensor:
        st = self.state
        gathered = st._bufs[3].view(st.world_size, st._row)
        m8 = st.chunk // 8
        scales = gathered[:, m8:st._row - _HEADER].view(torch.float32)
        st.calls += 1
        st._busy = False
        # Every rank holds every server scale now, so all reach the same verdict.
        if not bool(torch.isfinite(scales).all()):
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
        return ops.unpack_into(gathered[:, :m8], scales, st.block_size, out)

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
    if not async_op:
        try:
            send = call.phase0()
            tr.all_to_all(state._bufs[1], send)
            tr.all_gather(state._bufs[3], call.phase2())
            return call.finish()
        except BaseException:
            call.abort()
            raise

    result = _future(tensor.device)

    def fail(exc: BaseException) -> None:
        call.abort()
        result.set_exception(exc)

    def after_gather(fut) -> None:
        try:
            fut.value()
            result.set_result(call.finish())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
            fail(exc)

    def after_all_to_all(fut) -> None:
        try:
            fut.value()
            tr.all_gather(state._bufs[3], call.phase2(), async_op=True).add_done_callback(after_gather)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
            fail(exc)

    try:
        send = call.phase0()
        tr.all_to_all(state._bufs[1], send, async_op=True).add_done_callback(after_all_to_all)
    except BaseException:
        call.abort()
        raise
    return result
