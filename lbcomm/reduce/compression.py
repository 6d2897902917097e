"""The error-feedback state of the flat 1-bit compressed allreduce: `CompressionState`,
this rank's worker and server errors for one tensor size on one group, its counters,
checkpoints (`state_dict`, elastic `redistribute`), and the API its call works through
(`buffers`, `in_flight`, `count`, `record_sent`). The entry points are in
`lbcomm.reduce.compressed`, the call itself in `lbcomm.reduce.flatcall`.

Pipelining (`CompressionState`'s `pieces`): only tensors of at least PIECE_MIN elements per
chunk and piece are cut (block_size=None, one scale per tensor, is never cut).

Non-finite input and the error buffers (no spare copies: the state is 4 bytes per element
for the worker error, 4 / p for the server error, about 0.3 for the wire buffers). Before
phase 0 writes anything, every rank checks its own input (`isfinite(x.sum())`, an exact
check only when that sum is not finite) and one small all_reduce(max) tells every rank
whether any rank saw NaN/Inf, and whether every rank makes the same call (size, block
size, call count: ranks out of step raise before any error changes). A non-finite input
then skips (or raises) on every rank with both error buffers exactly as they were.
Otherwise the errors are updated in place. One case is left: every input finite but x + e
or the server's sum overflowing float32 (|values| near 3e38). Every rank holds every server
scale after phase 3, so all see it alike; the errors have already changed, so both error
buffers are reset to zero on every rank and the call skips or raises with a message that
says so.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..comm import get_transport
from ..common import NONFINITE_POLICIES, compressor_stats, drive, ring_allreduce_bytes
from ..config import DEFAULT_BLOCK_SIZE, CommConfig, from_comm
from .buffers import FlatBuffers, WireBuffers
from .calls import CallBook
from .flatcall import FlatCall
from .inputs import Cap, Sink, Source
from .wire import AGREEMENT_BYTES, check_block_size, chunk_size, piece_spans

__all__ = ["CompressionState", "PIECE_MIN", "MAX_PIECES"]

_log = logging.getLogger("lbcomm.compressed")  # the 0.2 logger name, kept for users' logging settings

# Automatic pipelining: pieces of at least PIECE_MIN elements of a chunk (256 KB of sign
# bits per row), at most MAX_PIECES: each collective's fixed cost stays small next to the
# time its piece takes on the wire.
PIECE_MIN = 1 << 21
MAX_PIECES = 4


class CompressionState(CallBook):
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
        comm (CommConfig, optional): the communication settings in one object, as every
            optimizer and hook takes them: `group`, `backend`, `block_size` and
            `nonfinite` come from its ``process_group``, ``backend``, ``block_size`` and
            ``nonfinite`` (then pass none of those four beside it) (default: None).
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
        buffers (FlatBuffers): the wire rows and staging of the calls
            (`lbcomm.reduce.buffers`), the buffer API the call works through.
        verified (bool): whether the ranks' layouts were compared (the first call's
            handshake, `FlatCall`); calls, skipped, last_skipped: the call counters.
    """

    CALL = "compressed allreduce"

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
        comm: Optional[CommConfig] = None,
    ):
        s = from_comm(comm, "CompressionState", process_group=(group, None), backend=(backend, "auto"),
                      block_size=(block_size, DEFAULT_BLOCK_SIZE), nonfinite=(nonfinite, "raise"))
        group, backend, block_size, nonfinite = s["process_group"], s["backend"], s["block_size"], s["nonfinite"]
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
        self.buffers = FlatBuffers(numel, self.world_size, self.rank, self.chunk, block_size, self.piece_spans,
                                   self.device)
        f32 = dict(dtype=torch.float32, device=self.device)
        self._worker_error = torch.zeros(self.world_size, self.chunk, **f32)
        self._server_error = torch.zeros(self.chunk, **f32)
        self._busy = False
        self.verified = False
        self._foreign_shard: Optional[str] = None  # why the errors were reset at a load (warned at the next call)
        self.calls = 0
        self.skipped = 0
        self.last_skipped = False
        self._zeroed: Optional[Tuple[Tensor, Tuple[int, int], Tensor]] = None  # zero_errors_at's server index
        self._sent_sq: Optional[Tensor] = None  # squared norm of the last call's rows, decoded (0-dim float64)

    # ------------------------------------------------------------------ the Reducer protocol
    def reduce_(self, source: "Source", sink: "Sink", *, checked: bool = False, async_op: bool = False,
                weights: Optional[Tensor] = None, cap: Optional[Cap] = None):
        """`lbcomm.reduce.compressed.reduce_` with this state (the `lbcomm.reduce.reducer.Reducer` call)."""
        return drive(FlatCall("reduce_", self, source, sink, checked, bool, weights, cap).steps(), self.device,
                     async_op)

    def compression_stats(self) -> Dict[str, Any]:
        """`lbcomm.common.compressor_stats` (the keys every compressor reports), bytes_per_call."""
        return {**compressor_stats(self), "bytes_per_call": self.bytes_per_call()}

    @classmethod
    def redistribute(cls, saved: Sequence[Dict[str, Any]], world_size: int, rank: int) -> Dict[str, Any]:
        """The error feedback of a resume with another world size (elastic resume), as the
        `state_dict` of `rank` in a world of `world_size` ranks: the one implementation
        every checkpoint path uses (through `lbcomm.reduce.reducer.redistribute`).

        `saved` holds the `state_dict` of every rank of the old world, in rank order. What
        the error-feedback invariant (sum of outputs = sum of means - mean worker error -
        server error) carries into the next call is the total error
        mean_r(worker error r) + concat_k(server error k). It is preserved (up to the
        rounding of the mean): every new rank's worker error is the mean of the saved
        worker errors, and the concatenated server errors are cut into the new chunks; pad
        slots hold zero.

        Raises:
            ValueError: the shards are not one complete world of one tensor size and block size.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"CompressionState.redistribute: invalid world_size {world_size!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"CompressionState.redistribute: rank {rank} is not in a world of {world_size}")
        old = len(saved)
        if old == 0:
            raise ValueError("CompressionState.redistribute: no saved shards")
        first = saved[0]
        numel, block = first["numel"], first["block_size"]
        for r, sd in enumerate(saved):
            if (sd["world_size"], sd["rank"]) != (old, r) or (sd["numel"], sd["block_size"]) != (numel, block):
                raise ValueError(f"CompressionState.redistribute: shard {r} was saved for (numel, world_size, rank, block_size)="
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

    # ------------------------------------------------------------------ state
    @property
    def worker_error(self) -> Tensor:
        return self._worker_error.view(-1)

    @property
    def worker_error_rows(self) -> Tensor:
        """The worker error as [p, chunk]: row j is this rank's error of chunk j."""
        return self._worker_error

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
    def last_sent_norm(self) -> float:
        """L2 norm of what this rank sent in its last compressed call, decoded: its
        compressed x + e (every chunk) and its served chunk, sign times block scale per
        element. Each block scale is the RMS of its block, so this is also the norm of what
        was compressed (with the capped decode an estimate: caps below a block's scale
        decode those coordinates smaller). Read from the block
        scales of the wire rows, not from the data; 0.0 before the first compressed call of
        this process (or after `load_state_dict`). The denominator of ``error_ratio`` in
        `compression_stats`."""
        return 0.0 if self._sent_sq is None else float(self._sent_sq) ** 0.5

    def record_sent(self) -> None:
        """Keep the squared norm of what this rank sent in the call just made, decoded
        (`last_sent_norm`), from the block scales of its wire rows: a pass over the scales
        only, kept as a tensor so that nothing waits for a device here."""
        total = None
        for s, w in enumerate(self.buffers.wire()):
            worker_n, server_n = self.buffers.block_counts(s)
            part = ((self.buffers.scales(w.send, s).double().square() * worker_n).sum()
                    + (self.buffers.scales(w.server_send, s).double().square() * server_n).sum())
            total = part if total is None else total + part
        self._sent_sq = total

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.world_size

    def bytes_per_call(self, checked: bool = False) -> int:
        """Bytes this rank sends per call: the all-to-alls and all-gathers (own chunk
        excluded) and, unless the caller agreed on finiteness itself (`checked`), the ring
        allreduce of the finiteness agreement (AGREEMENT_BYTES)."""
        if self.world_size == 1:
            return 0
        rows = 2 * (self.world_size - 1) * self.buffers.row_bytes
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

    def load_state_dict(self, sd: Dict[str, Any], *, all_ranks: Optional[Sequence[Dict[str, Any]]] = None) -> bool:
        """Restore error buffers saved by `state_dict`. Returns False, with zeroed errors,
        when they were saved for another world size, rank, size or block size (they cannot
        be mapped onto this layout). Saved with another world size (elastic resume), pass
        ``all_ranks``, every saved rank's state_dict in rank order: they are redistributed
        onto this rank (`redistribute`, the total error preserved) and True is returned.

        A shard of another rank of the same world (or of another world size) is what
        frameworks hand every rank when they save the optimizer of rank 0 only: that reset is
        logged at INFO and becomes a WARNING at the next call, unless this rank's own shard
        (or the redistributed state) is loaded before it, as the integrations do right after
        the framework's load."""
        self.ensure_idle()
        if all_ranks is not None and sd.get("world_size") != self.world_size:
            sd = self.redistribute(all_ranks, self.world_size, self.rank)
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
                # (the callbacks, load_sharded, LoadPlanner) may follow the framework's
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
        self._sent_sq = None  # what was last sent belongs to the errors just replaced
        self._worker_error.copy_(sd["worker_error"].reshape(self._worker_error.shape))
        self._server_error.copy_(sd["server_error"].reshape(self._server_error.shape))
        return True

    # ------------------------------------------------------------------ the call's API

    def pop_load_warning(self) -> Optional[str]:
        """The warning a `load_state_dict` deferred to the next call (a foreign shard or
        another world size reset the errors, and no rank-own shard followed), once."""
        msg, self._foreign_shard = self._foreign_shard, None
        return msg

    def wire_buffers(self) -> List[WireBuffers]:
        """The wire rows of every piece (`FlatBuffers.wire`), logged when first allocated."""
        if not self.buffers.allocated:
            _log.info("lbcomm: compressed allreduce of %s elements over %s ranks: chunk %s, block_size %s, "
                      "%s piece(s), %s bytes sent per call", self.numel, self.world_size, self.chunk,
                      self.block_size, len(self.piece_spans), self.bytes_per_call())
        return self.buffers.wire()

    def share_staging(self, buffer: Tensor) -> None:
        """Stage callable sources, sinks and computed caps through `buffer` (1-D contiguous
        fp32 on the state's device) instead of a buffer of the state's own: an owner whose
        scratch buffer is idle during the calls (an optimizer's staging buffer) lends it,
        and the two cost the memory of one. A call that needs more than it holds allocates
        its own as before. The owner must not touch it while a call is in flight."""
        self.ensure_idle()
        self.buffers.share_staging(buffer)

    # 0.2 names, kept for tests and tools that read them
    @property
    def _staging_cap(self) -> int:
        return self.buffers.staging_cap
