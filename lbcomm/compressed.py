"""The 1-bit compressed allreduce with two-stage error feedback, once (the algorithm and
its error-feedback invariant are described in docs/concepts.md).

Every entry point, optimizer and hook goes through `reduce_`; transports only move bytes.
Per call and rank:

    agree    all_reduce(max) of a small vector    every rank's input finite? same call?
    phase 0  worker_compress(x, e)            -> signs + block scales of x + e; e updated in place
    phase 1  all-to-all                          rank k receives chunk k from every rank
    phase 2  server_compress(chunks, s)       -> signs + block scales of the chunk mean + s; s in place
    phase 3  all-gather                          every rank receives every server chunk
    decode   unpack                            -> approximate mean, bitwise equal on all ranks

Entry points: `compressed_allreduce_(tensor, state)` reduces in place and allocates nothing
(torch's `dist.all_reduce` convention); `compressed_allreduce(tensor, state, out=out)`
returns the result in `out`; `reduce_(state, source, sink)` is the one call under both, and
also takes callables that produce the input and consume the result range by range, so the
optimizers never materialize a model-sized copy of either.

One schedule: the collective order of a call is written once (`_Call.steps`, a generator
that yields each future it must wait for); the sync driver waits on them in turn, the async
driver resumes the generator from each future's callback. Every rank issues the same
collectives in the same order either way.

Pipelining: with block scales, every block is independent, so each chunk is cut into
pieces (runs of whole blocks, `CompressionState.piece_spans`) and the phases run piece by
piece: piece s+1 is compressed while piece s crosses the network, and the server reduces
piece s while later pieces travel. Results are bitwise those of one piece (tests check it);
a call then costs 2 x pieces collectives, so only tensors of at least PIECE_MIN elements
per chunk and piece are cut (block_size=None, one scale per tensor, is never cut).

Wire rows (lbcomm.wire): a piece's sign bytes, its fp32 block scales, then a 24-byte
header (numel, call count, block size, piece, pieces), so every rank sees every other
rank's header in the all-to-all. Different row lengths would abort the process inside
gloo, so each state first checks the layout once with a fixed-size all-gather (its first
call).

Non-finite input and the error buffers (no spare copies: the state is 4 bytes per element
for the worker error, 4 / p for the server error, about 0.4 for the wire buffers). Before
phase 0 writes anything, every rank checks its own input (`isfinite(x.sum())`, an exact
check only when that sum is not finite) and one small all_reduce(max) tells every rank
whether any rank saw NaN/Inf, and whether every rank makes the same call (size, block
size, call count: ranks out of step raise before any error changes). A non-finite input
then skips (or raises) on every rank with both error buffers exactly as they were.
Otherwise the errors are updated in place. One case is left: every input finite but x + e
or the server's sum overflowing float32 (|values| near 3e38). Every rank holds every server
scale after phase 3, so all see it alike; the errors have already changed, so both error
buffers are reset to zero on every rank and the call skips or raises with a message that
says so. A caller that has already agreed on finiteness with the other ranks passes
`checked=True` to `reduce_` and saves the small all_reduce (every rank must then pass it).
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Dict, Generator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import ops
from .comm import get_transport
from .common import FLOAT_DTYPES, NONFINITE_POLICIES, completed_future, new_future, ring_allreduce_bytes
from .wire import (
    AGREEMENT_BYTES,
    ALIGN,
    agreement_vector,
    block_ranges,
    check_block_size,
    check_headers,
    chunk_size,
    encode_header,
    piece_spans,
    read_agreement,
    row_layout,
)

__all__ = ["CompressionState", "compressed_allreduce_", "compressed_allreduce", "reduce_", "NonFiniteError",
           "DEFAULT_BLOCK_SIZE", "PIECE_MIN", "redistribute_errors"]

_log = logging.getLogger(__name__)

# Elements per scale block: small enough that each block's scale follows the local magnitude
# of the input, large enough that the scales cost little (one fp32 per 2048 sign bits, 1.6 %).
DEFAULT_BLOCK_SIZE = 2048
# Automatic pipelining: pieces of at least PIECE_MIN elements of a chunk (256 KB of sign
# bits per row), at most MAX_PIECES: each collective's fixed cost stays small next to the
# time its piece takes on the wire.
PIECE_MIN = 1 << 21
MAX_PIECES = 4
# Elements of the staging buffer through which callable sources and sinks run (1 MB),
# rounded down to whole blocks (at least one block).
STAGING_MIN = 1 << 18

# The old private name, still imported by modules that have not moved to lbcomm.wire.

Source = Union[Tensor, Callable[[int, int, Tensor], Any]]
Sink = Union[Tensor, Callable[[int, int, Tensor], Any]]


class NonFiniteError(FloatingPointError):
    """A compressed allreduce saw NaN/Inf; raised on every rank (the message says whether
    the error buffers are unchanged or were reset)."""


class _WireBuffers(NamedTuple):
    """The uint8 buffers of one piece: rows sent to / received from every rank in the
    all-to-all, this rank's server row, and every rank's server row after the all-gather."""

    send: Tensor  # [p, row_bytes]
    recv: Tensor  # [p, row_bytes]
    server_send: Tensor  # [row_bytes]
    gathered: Tensor  # [p, row_bytes]


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
            "raise" a NonFiniteError on every rank, or "skip" (the call returns False /
            leaves its output alone, ``last_skipped`` is True). The error buffers stay
            exactly as before (or are reset to zero when finite inputs overflowed float32;
            see the module docs) (default: "raise").
        backend (str, optional): "torch" (a torch.distributed group), "mpi" (mpi4py; `group`
            is then an mpi4py communicator) or "auto": torch.distributed when initialized,
            else MPI under mpirun; see `lbcomm.comm.get_transport` (default: "auto").
        pieces (int, optional): runs of whole blocks each chunk is cut into, so that
            compression overlaps the transfers (see the module docs); results do not
            depend on it. Every rank must use the same value. None: one piece per
            PIECE_MIN elements of a chunk, at most MAX_PIECES, for CPU tensors; 1 for
            CUDA tensors (the automatic choice is tuned for CPU tensors) and for
            block_size=None (default: None).

    Attributes:
        worker_error (Tensor): this rank's worker error, n (padded numel) fp32 elements.
        server_error (Tensor): the error of the chunk this rank serves, n / p elements.
        piece_spans (list of (int, int)): the [lo, hi) element spans of a chunk's pieces.
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
        check_block_size(block_size)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid nonfinite policy: {nonfinite!r} (use one of {NONFINITE_POLICIES})")
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
        count = self._count_pieces(pieces)
        one = self.world_size == 1
        self.piece_spans = [(0, self.chunk)] if one else piece_spans(self.chunk, block_size, count)
        self._row_layouts = [row_layout(hi - lo, block_size) for lo, hi in self.piece_spans]
        f32 = dict(dtype=torch.float32, device=self.device)
        self._worker_error = torch.zeros(self.world_size, self.chunk, **f32)
        self._server_error = torch.zeros(self.chunk, **f32)
        self._wire: Optional[List[_WireBuffers]] = None  # allocated on first use
        self._staging: Optional[Tensor] = None  # fp32, for callable sources/sinks and half outputs
        self._busy = False
        self._verified = False
        self._foreign_shard: Optional[str] = None  # why the errors were reset at a load (warned at the next call)
        self.calls = 0
        self.skipped = 0
        self.last_skipped = False
        self._zeroed: Optional[Tuple[Tensor, Tuple[int, int], Tensor]] = None  # zero_errors_at's server index

    # ------------------------------------------------------------------ the Reducer protocol
    def reduce_(self, source: "Source", sink: "Sink", *, checked: bool = False, async_op: bool = False,
                weights: Optional[Tensor] = None):
        """`lbcomm.compressed.reduce_` with this state (the `lbcomm.reducer.Reducer` call)."""
        return reduce_(self, source, sink, checked=checked, async_op=async_op, weights=weights)

    def compression_stats(self) -> Dict[str, Any]:
        """Calls, skipped calls and the bytes this rank sent so far (plain numbers)."""
        return {"calls": self.calls, "skipped_calls": self.skipped, "bytes_per_call": self.bytes_per_call(),
                "world_size": self.world_size, "numel": self.numel}

    @classmethod
    def redistribute(cls, saved: Sequence[Dict[str, Any]], world_size: int, rank: int) -> Dict[str, Any]:
        """`redistribute_errors`: every saved rank's state_dict onto `rank` of `world_size`."""
        return redistribute_errors(saved, world_size, rank)

    # ------------------------------------------------------------------ state
    @property
    def worker_error(self) -> Tensor:
        return self._worker_error.view(-1)

    @property
    def server_error(self) -> Tensor:
        return self._server_error

    def served_span(self) -> Tuple[int, int]:
        """[lo, hi): the input coordinates whose server error this rank holds (its chunk,
        clamped to numel): server_error[i - lo] belongs to coordinate i; the worker error is
        indexed like the (padded) input itself."""
        lo = min(self.numel, self.rank * self.chunk)
        return lo, min(self.numel, lo + self.chunk)

    def zero_errors_at(self, index: Tensor) -> None:
        """Zero both errors of the input coordinates `index` (int64, ascending): coordinates
        averaged exactly beside the compressed call (exact_numel). The server part of
        `index` is derived once per index tensor (a boolean mask syncs on a GPU): pass the
        same tensor every call."""
        self._worker_error.view(-1).index_fill_(0, index, 0.0)
        span = self.served_span()
        if self._zeroed is None or self._zeroed[0] is not index or self._zeroed[1] != span:
            lo, hi = span
            self._zeroed = (index, span, index[(index >= lo) & (index < hi)] - lo)
        self._server_error.index_fill_(0, self._zeroed[2], 0.0)

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.world_size

    @property
    def pieces(self) -> list:
        """Deprecated alias of `piece_spans` (the constructor's `pieces` is a count)."""
        warnings.warn("CompressionState.pieces is deprecated; use CompressionState.piece_spans", DeprecationWarning,
                      stacklevel=2)
        return self.piece_spans

    def bytes_per_call(self, checked: bool = False) -> int:
        """Bytes this rank sends per call: the all-to-alls and all-gathers (own chunk
        excluded) and, unless the caller agreed on finiteness itself (`checked`), the ring
        allreduce of the finiteness agreement (AGREEMENT_BYTES)."""
        if self.world_size == 1:
            return 0
        rows = 2 * (self.world_size - 1) * sum(r.row_bytes for r in self._row_layouts)
        return rows + (0 if checked else int(ring_allreduce_bytes(AGREEMENT_BYTES, self.world_size)))

    def _count_pieces(self, pieces: Optional[int]) -> int:
        """Pieces per chunk: the requested count, or automatically one per PIECE_MIN
        elements of a chunk, at most MAX_PIECES."""
        if pieces is not None:
            if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
                raise ValueError(f"Invalid pieces: {pieces!r} (use None or a positive int)")
            if pieces > 1 and self.block_size is None:
                raise ValueError("pieces > 1 needs block scales: block_size=None has one scale for the whole tensor")
            return pieces
        if self.block_size is None or self.device.type != "cpu":  # CUDA: the automatic choice is tuned for CPU only
            return 1
        return min(MAX_PIECES, max(1, self.chunk // PIECE_MIN))

    def reset(self) -> None:
        """Zero both error buffers (e.g. after a change of world size)."""
        self._worker_error.zero_()
        self._server_error.zero_()

    def state_dict(self) -> Dict[str, Any]:
        """This rank's error buffers and the layout they belong to (one shard per rank)."""
        return {
            "numel": self.numel,
            "world_size": self.world_size,
            "rank": self.rank,
            "block_size": self.block_size,
            "worker_error": self._worker_error.clone(),
            "server_error": self._server_error.clone(),
            "calls": self.calls,
            "skipped": self.skipped,
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> bool:
        """Restore error buffers saved by `state_dict`. Returns False, with zeroed errors,
        when they were saved for another world size, rank, size or block size (they cannot
        be mapped onto this layout; see `redistribute_errors` for another world size).

        A shard of another rank of the same world (or of another world size) is what
        frameworks hand every rank when they save the optimizer of rank 0 only: that reset is
        logged at INFO and becomes a WARNING at the next call, unless this rank's own shard
        (or the redistributed state) is loaded before it, as the integrations do right after
        the framework's load."""
        self._ensure_idle()
        layout = (sd.get("numel"), sd.get("world_size"), sd.get("rank"), sd.get("block_size"))
        mine = (self.numel, self.world_size, self.rank, self.block_size)
        self.calls = int(sd.get("calls", 0))
        self.skipped = int(sd.get("skipped", 0))
        self._foreign_shard = None
        if layout != mine:
            self.reset()
            if layout[:2] + layout[3:] == mine[:2] + mine[3:]:
                self._foreign_shard = (
                    f"lbcomm: rank {self.rank} of {self.world_size} was given the compression error buffers that "
                    f"rank {layout[2]} saved; error feedback differs between ranks, so this rank's was reset to zero. "
                    "Cause: frameworks (Hugging Face Trainer, Lightning, accelerate's save_state) save the optimizer "
                    "of rank 0 only and load it on every rank. Fix: keep every rank's own shard with "
                    "lbcomm.integrations.transformers.LbcommCallback / lbcomm.integrations.lightning.LbcommCallback, "
                    "lbcomm.save_sharded / lbcomm.load_sharded, or lbcomm.integrations.dcp.RankLocal with "
                    "torch.distributed.checkpoint")
                _log.info("%s (warned again at the next call unless this rank's own shard is loaded first)",
                          self._foreign_shard)
            elif layout[0] == mine[0] and layout[3] == mine[3]:
                # another world size: deferred like a foreign shard, since an elastic load
                # (the callbacks, load_sharded, ElasticLoadPlanner) may follow the framework's
                self._foreign_shard = (
                    f"lbcomm: compression error buffers were saved for (numel, world_size, rank, block_size)={layout} "
                    f"but this run has {mine}; resetting them to zero and continuing (another world size: "
                    "lbcomm.load_sharded redistributes them exactly)")
                _log.info("%s (warned again at the next call unless a redistributed state is loaded first)",
                          self._foreign_shard)
            else:  # another tensor or block size: nothing can map it
                _log.warning("lbcomm: compression error buffers were saved for (numel, world_size, rank, block_size)="
                             "%s but this run has %s; resetting them to zero and continuing", layout, mine)
            return False
        self._worker_error.copy_(sd["worker_error"].reshape(self._worker_error.shape))
        self._server_error.copy_(sd["server_error"].reshape(self._server_error.shape))
        return True

    def _ensure_idle(self) -> None:
        if self._busy:
            raise RuntimeError("a compressed allreduce on this CompressionState is still in flight; wait for its "
                               "future before starting another call or touching its state")

    def _wire_buffers(self) -> List[_WireBuffers]:
        if self._wire is None:
            p = self.world_size
            u8 = dict(dtype=torch.uint8, device=self.device)
            self._wire = [_WireBuffers(torch.empty(p, r.row_bytes, **u8), torch.empty(p, r.row_bytes, **u8),
                                       torch.empty(r.row_bytes, **u8), torch.empty(p, r.row_bytes, **u8))
                          for r in self._row_layouts]
            _log.info("lbcomm: compressed allreduce of %s elements over %s ranks: chunk %s, block_size %s, "
                      "%s piece(s), %s bytes sent per call", self.numel, p, self.chunk, self.block_size,
                      len(self.piece_spans), self.bytes_per_call())
        return self._wire

    @property
    def _staging_cap(self) -> int:
        """Elements per range of a callable source or sink: whole blocks (ALIGN words
        without block scales), about STAGING_MIN."""
        unit = self.block_size or ALIGN
        return max(unit, STAGING_MIN // unit * unit)

    def _staging_buffer(self, n: int) -> Tensor:
        """A reused fp32 buffer of at least n elements."""
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(n, dtype=torch.float32, device=self.device)
        return self._staging


def redistribute_errors(saved: Sequence[Dict[str, Any]], world_size: int, rank: int) -> Dict[str, Any]:
    """The error feedback of a resume with another world size (elastic resume), as a
    `CompressionState.state_dict` of `rank` in a world of `world_size` ranks.

    `saved` holds the `CompressionState.state_dict` of every rank of the old world, in rank
    order. What the error-feedback invariant (sum of outputs = sum of means - mean worker
    error - server error) carries into the next call is the total error
    mean_r(worker error r) + concat_k(server error k). It is preserved (up to the rounding
    of the mean): every new rank's worker error is the mean of the saved worker errors, and
    the concatenated server errors are cut into the new chunks; pad slots hold zero.

    Raises:
        ValueError: the shards are not one complete world of one tensor size and block size.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"redistribute_errors: invalid world_size {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"redistribute_errors: rank {rank} is not in a world of {world_size}")
    old = len(saved)
    if old == 0:
        raise ValueError("redistribute_errors: no saved shards")
    first = saved[0]
    numel, block = first["numel"], first["block_size"]
    for r, sd in enumerate(saved):
        if (sd["world_size"], sd["rank"]) != (old, r) or (sd["numel"], sd["block_size"]) != (numel, block):
            raise ValueError(f"redistribute_errors: shard {r} was saved for (numel, world_size, rank, block_size)="
                             f"{(sd['numel'], sd['world_size'], sd['rank'], sd['block_size'])}; expected "
                             f"{(numel, old, r, block)} (pass every rank's shard of one checkpoint, in rank order)")
    worker = torch.stack([sd["worker_error"].reshape(-1)[:numel].double() for sd in saved]).mean(0)
    server = torch.cat([sd["server_error"].reshape(-1) for sd in saved])[:numel]
    chunk = chunk_size(numel, world_size)
    new_worker = torch.zeros(world_size * chunk, dtype=torch.float32)
    new_worker[:numel] = worker.float()
    new_server = torch.zeros(world_size * chunk, dtype=torch.float32)
    new_server[:numel] = server.float()
    return {"numel": numel, "world_size": world_size, "rank": rank, "block_size": block,
            "worker_error": new_worker.view(world_size, chunk),
            "server_error": new_server[rank * chunk:(rank + 1) * chunk].clone(),
            "calls": int(first.get("calls", 0)), "skipped": int(first.get("skipped", 0))}


class _Call:
    """One compressed allreduce: validation, the schedule and the phases."""

    def __init__(self, name: str, state: CompressionState, source: Source, sink: Sink, checked: bool,
                 result: Callable[[bool], Any], weights: Optional[Tensor] = None):
        if not isinstance(state, CompressionState):
            raise TypeError(f"{name}: state must be a CompressionState, got {type(state).__name__}")
        self.name, self.state, self.checked, self.result = name, state, bool(checked), result
        if isinstance(source, Tensor):
            self._check_tensor(source, "the tensor")
        elif not callable(source):
            raise TypeError(f"{name}: expected a tensor or a callable source(lo, hi, buf), got {type(source).__name__}")
        elif not checked:
            raise ValueError(f"{name}: a callable source cannot be checked for NaN/Inf before the call; agree on "
                             "finiteness with the other ranks first and pass checked=True, or pass a tensor")
        if isinstance(sink, Tensor):
            self._check_tensor(sink, "the output")
        elif not callable(sink):
            raise TypeError(f"{name}: expected a tensor or a callable sink(lo, hi, values), got {type(sink).__name__}")
        if weights is not None:
            if not isinstance(weights, Tensor) or weights.dtype not in (torch.float32, torch.bfloat16) \
                    or weights.numel() != state.numel \
                    or weights.device != state.device:
                got = (f"{weights.dtype} {tuple(weights.shape)} on {weights.device}" if isinstance(weights, Tensor)
                       else type(weights).__name__)
                raise ValueError(f"{name}: weights must be a float32 or bfloat16 tensor of {state.numel} elements on "
                                 f"{state.device} (one per coordinate), got {got}")
            weights = weights.reshape(-1)
        state._ensure_idle()
        self.source, self.sink, self.weights = source, sink, weights
        self.flat_source: Optional[Tensor] = None  # the tensor source as one flat view (made on first use)

    def _check_tensor(self, t: Tensor, what: str) -> None:
        st = self.state
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{self.name}: expected a float32/float16/bfloat16 tensor, got {t.dtype} ({what})")
        if t.numel() != st.numel:
            raise ValueError(f"{self.name}: {what} has {t.numel()} elements but the state was built for {st.numel}; "
                             "use one CompressionState per tensor size")
        if t.device != st.device:
            raise ValueError(f"{self.name}: {what} is on {t.device} but the state's error buffers are on "
                             f"{st.device}; build the state with device={t.device!s}")

    # ---------------------------------------------------------------- schedule
    def steps(self) -> Generator[torch.futures.Future, None, Any]:
        """The collective order of a call, once: yields each future the call must wait for
        and returns `result(applied)`."""
        st, tr = self.state, self.state.transport
        if st._foreign_shard is not None:  # no rank-own shard followed the foreign one
            _log.warning("%s", st._foreign_shard)
            st._foreign_shard = None
        if st.world_size == 1 or st.numel == 0:  # nothing to communicate: the result is the input
            self._copy_through()
            return self.result(True)
        st._busy = True
        try:
            if not st._verified:
                yield from self._handshake()
            if not self.checked:
                vec = agreement_vector(self._header(0), not self._input_finite()).to(st.device)
                fut = tr.all_reduce(vec, "max", async_op=True)
                yield fut
                fut.value()
                if read_agreement(vec, "the error buffers are unchanged"):
                    return self.result(self._conclude(False, errors_changed=False))
            wire = st._wire_buffers()
            count = len(st.piece_spans)
            # The all-to-alls of all pieces (each as soon as its piece is compressed), then
            # the all-gathers in piece order (each as soon as its all-to-all has arrived).
            sent = [tr.all_to_all(wire[s].recv, self._compress_piece(s), async_op=True) for s in range(count)]
            gathered = []
            for s in range(count):
                yield sent[s]
                sent[s].value()
                gathered.append(tr.all_gather(wire[s].gathered, self._serve_piece(s), async_op=True))
            for fut in gathered:
                yield fut
                fut.value()
            # Every rank holds every server scale now, so all reach the same verdict.
            finite = all(bool(torch.isfinite(self._scales(w.gathered, s)).all()) for s, w in enumerate(wire))
            if not self._conclude(finite, errors_changed=True):
                return self.result(False)
            self._decode()
            return self.result(True)
        finally:
            st._busy = False

    def _handshake(self):
        """Once per state: every rank's layout, compared before any variable-size collective."""
        st = self.state
        mine = torch.tensor([st.numel, st.block_size or 0, st.chunk, st.calls, len(st.piece_spans)],
                            dtype=torch.int64)
        k = mine.numel()
        everyone = torch.empty(st.world_size * k, dtype=torch.int64, device=st.device)
        local = mine.to(st.device)
        fut = st.transport.all_gather(everyone.view(torch.uint8), local.view(torch.uint8), async_op=True)
        yield fut
        fut.value()
        rows = everyone.view(st.world_size, k).cpu()
        if not bool((rows == mine).all()):
            desc = ", ".join(f"rank {r}: numel={int(v[0])} block_size={int(v[1]) or None} calls={int(v[3])} "
                             f"pieces={int(v[4])}" for r, v in enumerate(rows))
            raise ValueError("compressed_allreduce: ranks called with different tensors or state layouts "
                             f"({desc}); every rank must reduce the same sizes in the same order")
        st._verified = True

    def _header(self, piece: int) -> Tensor:
        st = self.state
        return encode_header(st.numel, st.calls, st.block_size, piece, len(st.piece_spans))

    def _input_finite(self) -> bool:
        """Whether this rank's (tensor) input is all finite: one cheap pass (the sum is
        finite only if every element is), the exact check only when the sum is not (an
        overflowing sum of finite values must not skip a call)."""
        if bool(torch.isfinite(self.source.sum(dtype=torch.float32))):
            return True
        return bool(torch.isfinite(self.source).all())

    def _conclude(self, finite: bool, *, errors_changed: bool) -> bool:
        """Count the call; for a non-finite verdict reset the errors if they changed, then
        raise or return False per the state's policy. Every rank reaches the same verdict."""
        st = self.state
        st.calls += 1
        st.last_skipped = not finite
        if finite:
            return True
        st.skipped += 1
        if errors_changed:
            st.reset()
            what = ("a block scale overflowed to Inf/NaN although every rank's input was checked finite: x + error "
                    "or the server's sum went beyond the float32 range (|values| near 3e38), or an input was not "
                    "finite under checked=True. The error feedback was reset to zero on every rank")
        else:
            what = "the input holds NaN or Inf on at least one rank (the error buffers are unchanged)"
        if st.nonfinite == "raise":
            raise NonFiniteError(f"{self.name}: {what}; check for overflow, or pass nonfinite='skip' to the "
                                 "CompressionState")
        _log.debug("%s: skipped: %s", self.name, what)
        return False

    # ---------------------------------------------------------------- phases
    def _input(self, lo: int, hi: int) -> Tensor:
        """Input elements [lo, hi): a view of a tensor source, or a callable source's
        values in the staging buffer."""
        if isinstance(self.source, Tensor):
            if self.flat_source is None:
                self.flat_source = self.source.reshape(-1)
            return self.flat_source[lo:hi]
        buf = self.state._staging_buffer(max(hi - lo, self.state._staging_cap))[:hi - lo]
        if hi > lo:
            self.source(lo, hi, buf)
        return buf

    def _scales(self, rows: Tensor, s: int) -> Tensor:
        layout = self.state._row_layouts[s]
        return rows[..., layout.sign_bytes:layout.scales_end].view(torch.float32)

    def _compress_piece(self, s: int) -> Tensor:
        """Phase 0: worker compress of piece s of every chunk into its send rows, the
        worker error updated in place."""
        st = self.state
        send, layout = st._wire[s].send, st._row_layouts[s]
        lo, hi = st.piece_spans[s]
        q8, block, m, n0 = layout.sign_bytes, st.block_size, st.chunk, st.numel
        if len(st.piece_spans) == 1 and (block is None or isinstance(self.source, Tensor)):
            # one kernel call over every chunk (the only way with one scale for everything)
            packed, scales = ops.worker_compress(self._input(0, n0), st._worker_error, block,
                                                 weights=self.weights)
            send[:, :q8].copy_(packed)
            self._scales(send, s).copy_(scales)
        else:
            cap = hi - lo if isinstance(self.source, Tensor) else st._staging_cap
            for j in range(st.world_size):
                for a, b in block_ranges(lo, hi, block, cap):
                    g0 = j * m + a
                    g1 = max(g0, min(j * m + b, n0))
                    w = None if self.weights is None else self.weights[g0:g1]
                    packed, scales = ops.worker_compress(self._input(g0, g1), st._worker_error[j, a:b], block,
                                                         weights=w)
                    send[j, (a - lo) // 8:(b - lo) // 8].copy_(packed)
                    first = (a - lo) // block
                    self._scales(send[j], s)[first:first + scales.numel()].copy_(scales)
        send[:, layout.scales_end:].copy_(self._header(s).view(torch.uint8))
        return send

    def _serve_piece(self, s: int) -> Tensor:
        """Phase 2: server reduce + compress of piece s of this rank's chunk into its
        all-gather row, the server error updated in place."""
        st = self.state
        wire, layout = st._wire[s], st._row_layouts[s]
        try:  # every rank sees every header: all raise, or none
            check_headers(wire.recv, self._header(s), "the error buffers were reset to zero on every rank")
        except ValueError:
            st.reset()  # phase 0 has already updated the worker error
            raise
        lo, hi = st.piece_spans[s]
        real = min(max(st.numel - st.rank * st.chunk - lo, 0), hi - lo)
        packed, scales = ops.server_compress(wire.recv[:, :layout.sign_bytes], self._scales(wire.recv, s),
                                             st._server_error[lo:hi], st.block_size, real)
        wire.server_send[:layout.sign_bytes].copy_(packed)
        self._scales(wire.server_send, s).copy_(scales)
        wire.server_send[layout.scales_end:].copy_(self._header(s).view(torch.uint8))
        return wire.server_send

    def _decode(self) -> None:
        """Decode every server chunk into the sink: straight into a contiguous float32
        tensor, else range by range (whole blocks) through the staging buffer."""
        st, sink = self.state, self.sink
        block, m, n0 = st.block_size, st.chunk, st.numel
        whole, write, copy_back = self._sink_target()
        if whole is not None and len(st.piece_spans) == 1:
            g = st._wire[0].gathered
            ops.unpack_into(g[:, :st._row_layouts[0].sign_bytes], self._scales(g, 0), block, whole,
                            weights=self.weights)
        else:
            for s, (lo, hi) in enumerate(st.piece_spans):
                g = st._wire[s].gathered
                for k in range(st.world_size):
                    for a, b in block_ranges(lo, hi, block, hi - lo if write is None else st._staging_cap):
                        g0, g1 = k * m + a, min(k * m + b, n0)
                        if g1 <= g0:
                            continue
                        first = (a - lo) // block if block else 0
                        count = -(-(b - a) // block) if block else 1
                        scales = self._scales(g[k:k + 1], s)[:, first:first + count]
                        out = whole[g0:g1] if write is None else st._staging_buffer(st._staging_cap)[:g1 - g0]
                        w = None if self.weights is None else self.weights[g0:g1]
                        ops.unpack_into(g[k:k + 1, (a - lo) // 8:(b - lo) // 8], scales, block, out, weights=w)
                        if write is not None:
                            write(g0, g1, out)
        if copy_back:
            sink.copy_(whole.view(sink.shape))

    def _sink_target(self):
        """(whole, write, copy_back): a flat float32 tensor that takes the result directly
        (the sink itself, or a temporary for a non-contiguous sink, then copy_back), or a
        write(lo, hi, values) callback fed range by range (a callable or half sink)."""
        sink = self.sink
        if not isinstance(sink, Tensor):
            return None, sink, False
        if not sink.is_contiguous():
            return torch.empty(self.state.numel, dtype=torch.float32, device=self.state.device), None, True
        flat = sink.view(-1)
        if sink.dtype == torch.float32:
            return flat, None, False
        return None, lambda lo, hi, values: flat[lo:hi].copy_(values), False

    def _copy_through(self) -> None:
        """One rank (or nothing to reduce): the sink receives the input unchanged."""
        source, sink, st = self.source, self.sink, self.state
        if isinstance(source, Tensor) and isinstance(sink, Tensor):
            if sink is not source:
                sink.copy_(source.reshape(sink.shape))
            return
        whole, write, copy_back = self._sink_target()
        for lo, hi in block_ranges(0, st.numel, None, st._staging_cap):
            values = self._input(lo, hi)
            if write is None:
                whole[lo:hi].copy_(values)
                continue
            buf = st._staging_buffer(st._staging_cap)[:hi - lo]
            if buf.data_ptr() != values.data_ptr():
                buf.copy_(values)
            write(lo, hi, buf)
        if copy_back:
            sink.copy_(whole.view(sink.shape))


def _drive(call: _Call, async_op: bool):
    """Run a call's schedule: blocking (wait on each future), or from future callbacks
    (returns a Future of the result). Errors before the first collective raise here."""
    steps = call.steps()
    if not async_op:
        try:
            fut = next(steps)
            while True:
                fut.wait()
                fut = steps.send(None)
        except StopIteration as done:
            return done.value
        finally:
            steps.close()  # a failed wait: leave the schedule (its finally marks the state idle)
    result = new_future(call.state.device)
    try:
        first = next(steps)
    except StopIteration as done:
        result.set_result(done.value)
        return result

    def advance(_=None) -> None:
        try:
            fut = next(steps)
        except StopIteration as done:
            result.set_result(done.value)
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
            steps.close()
            result.set_exception(exc)
            return
        fut.add_done_callback(advance)

    first.add_done_callback(advance)
    return result


def reduce_(state: CompressionState, source: Source, sink: Sink, *, checked: bool = False, async_op: bool = False,
            weights: Optional[Tensor] = None):
    """The compressed allreduce that every entry point, optimizer and hook goes through:
    the approximate MEAN of `source` over the ranks of the state's group, into `sink`.

    Args:
        state (CompressionState): this rank's error feedback for this size.
        source (Tensor or callable): a float32/float16/bfloat16 tensor of `state.numel`
            elements on `state.device` (read before the sink is written, so it may be the
            sink itself), or ``source(lo, hi, buf)`` that writes input elements [lo, hi)
            (flat indices into the unpadded input) as fp32 into the 1-D fp32 tensor `buf`
            of hi - lo elements. A callable source is called range by range (runs of whole
            blocks, each range once) through a staging buffer of about STAGING_MIN
            elements owned by the state, so the whole input never exists at once. With
            block_size=None (one scale for the whole tensor) the staging buffer must hold
            the whole input: it is allocated at full size in that case only.
        sink (Tensor or callable): a float32/float16/bfloat16 tensor of `state.numel`
            elements that receives the result (decoded without allocating when it is
            contiguous float32), or ``sink(lo, hi, values)`` that receives the fp32 result
            elements [lo, hi) range by range (whole blocks, bounded staging; `values` is
            reused after the callback returns). Untouched (not called) by a skipped call.
        checked (bool, optional): the caller guarantees that every rank has already
            agreed that every rank's input is finite: the call skips its own finiteness
            agreement (one small all_reduce). Every rank must pass the same value.
            Required for a callable source (default: False).
        async_op (bool, optional): return a torch.futures.Future of the result; the
            collectives are chained through callbacks without blocking. Keep one async call
            in flight per process group (on torch.distributed: later collectives are issued
            from callbacks, so two concurrent calls could interleave differently on
            different ranks; the wire headers then make every rank raise) (default: False).
        weights (Tensor, optional): float32 or bfloat16 per-coordinate weights w > 0 of
            `state.numel` elements on `state.device`, the same on every rank (bfloat16
            halves what the call reads; either is used at its exact fp32 value): the call
            compresses source / w (the error feedback lives in those units) and writes
            the decoded mean times w, both fused into the passes the call makes anyway.
            Bitwise the same as dividing the input by w in fp32 before the call and
            multiplying the result by w after it. With one rank the sink receives the
            input unchanged (default: None).

    Returns:
        True when the result was written, False when the call was skipped for non-finite
        values with ``nonfinite="skip"`` (or a Future of that bool). With
        ``nonfinite="raise"`` a NonFiniteError is raised instead (on every rank). With one
        rank nothing is compressed: the sink receives the input unchanged.
    """
    return _drive(_Call("reduce_", state, source, sink, checked, bool, weights), async_op)


def compressed_allreduce_(tensor: Tensor, state: CompressionState, *, async_op: bool = False,
                          weights: Optional[Tensor] = None):
    """In-place approximate MEAN of `tensor` over the ranks of the state's group, in about
    1 bit per element; allocates nothing (the primary entry point, like `dist.all_reduce`).

    Args:
        tensor (Tensor): float32/float16/bfloat16, `state.numel` elements, on
            `state.device`; half precision is upcast into the fp32 error domain and the
            result cast back. Left unchanged by a call skipped for non-finite input.
        state (CompressionState): this rank's error feedback for this tensor size.
        async_op (bool, optional): return a Future (see `reduce_`) (default: False).
        weights (Tensor, optional): per-coordinate weights (see `reduce_`) (default: None).

    Returns:
        `tensor` (or a Future of it), bitwise identical on every rank; `state.last_skipped`
        says whether a ``nonfinite="skip"`` call was skipped.

    Example::

        >>> state = lbcomm.CompressionState(grad.numel())
        >>> lbcomm.compressed_allreduce_(grad, state)          # grad now holds the mean
        >>> fut = lbcomm.compressed_allreduce_(grad, state, async_op=True)
    """
    return _drive(_Call("compressed_allreduce_", state, tensor, tensor, False, lambda applied: tensor, weights),
                  async_op)


def compressed_allreduce(
    tensor: Tensor, state: CompressionState, group=None, async_op: bool = False, out: Optional[Tensor] = None,
    weights: Optional[Tensor] = None,
):
    """Approximate MEAN of `tensor` over the ranks of the state's group, into `out`.

    Args:
        tensor (Tensor): float32/float16/bfloat16, `state.numel` elements, on `state.device`.
            Not modified (unless it is `out`).
        state (CompressionState): this rank's error feedback for this tensor size.
        group (ProcessGroup, optional): must be the state's group if given (default: None).
        async_op (bool, optional): return a Future of the result (see `reduce_`) (default: False).
        out (Tensor): receives the result (may be `tensor` itself); a float32 contiguous
            `out` is decoded without allocating. Left unchanged by a call skipped for
            non-finite input. Leaving it out is deprecated: the call then allocates (and
            page-faults) a new output every time; use `compressed_allreduce_` or pass out=.
        weights (Tensor, optional): per-coordinate weights (see `reduce_`) (default: None).

    Returns:
        `out` (or a Future of it), bitwise identical on every rank. Without `out`: a new
        tensor of `tensor`'s shape and dtype (all NaN when skipped), or with one rank the
        input itself.
    """
    if group is not None and isinstance(state, CompressionState) and group is not state.group:
        raise ValueError("compressed_allreduce: the state was built for another process group; build one "
                         "CompressionState per group")
    fresh = out is None
    if fresh:
        warnings.warn("compressed_allreduce(tensor, state) without out= allocates a new output on every call; use "
                      "lbcomm.compressed_allreduce_(tensor, state) (in place) or pass out=", DeprecationWarning,
                      stacklevel=2)
        one = isinstance(state, CompressionState) and (state.world_size == 1 or state.numel == 0)
        if one or not isinstance(tensor, Tensor) or tensor.dtype not in FLOAT_DTYPES:
            out = tensor  # one rank returns the input itself; bad inputs are refused by the call
        else:
            out = torch.empty_like(tensor, memory_format=torch.contiguous_format)

    def result(applied: bool) -> Tensor:
        if not applied and fresh and out is not tensor:
            out.fill_(float("nan"))
        return out

    return _drive(_Call("compressed_allreduce", state, tensor, out, False, result, weights), async_op)
