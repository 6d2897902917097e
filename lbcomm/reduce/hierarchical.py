"""The hierarchical compressed allreduce, full precision inside a node and 1 bit between
nodes (see docs/topology.md): its state `HierarchicalState` and entry points
`hierarchical_allreduce_` and `hierarchical_mean_`. The groups are a
`lbcomm.reduce.topology.Topology`; the schedule of a call is `lbcomm.reduce.hiercall`.

p = N x G ranks: N nodes of G ranks each. Rank (node a, local index l) belongs to two
groups: its node's *local group* (G ranks on fast links) and its *cross group* (the N
ranks with local index l, one per node, joined by the slow network). A call:

    rs       local all-to-all of fp32 slices    rank l of a node receives slice l of every
                                                node member's input (one flag each: input finite?)
    mean     y_{a,l} = (x_{a,0}[l] + ... + x_{a,G-1}[l]) / G    fp32, in local rank order
    1-bit    the two-stage error-feedback compressed allreduce of y_{a,l} over cross group l
             (the flat call, with this rank's own CompressionState of the slice)
    ag       local all-gather of the G decoded slices (one status each: applied/skipped/empty)

Slice l is elements [l L, (l + 1) L) of the input, L = `wire.chunk_size(numel, G)` (the
last slices may be shorter or empty). Only the 1-bit stage crosses the network: a node's
G ranks send together 2 (N-1)/N (n/8 + 4 n/B) bytes per call, as ONE rank of the flat
call sends, i.e. 1/G of a node's traffic under the flat call; and a call pays 2 (N-1)
(rather than 2 (p-1)) network latencies per piece. The intra-node steps move 4 bytes per
element in full precision (a direct reduce-scatter and all-gather: 2 (G-1)/G x 4 n bytes
per rank); the sum is done here in rank order, so that it is deterministic and a plain
reference reproduces it.

The result is bitwise identical on every rank: slice l is decoded identically on the N
ranks of cross group l (the flat call's guarantee) and the all-gather hands every rank of
every node the same G slices.

Error feedback (the flat call's invariant, sum of outputs = sum of means - mean worker
error - server error, applied per slice). The errors that exist:
each rank (a, l) holds the worker error e_{a,l} of its slice (length L_l padded for the
N-rank cross group) and the server error s_{a,l} of the chunk of slice l it serves in
cross group l; the intra-node stages are exact up to fp32 rounding and keep no error.
With all errors starting at zero, after T calls (none skipped)

    sum_t out_t = sum_t mean_r(x_{r,t})
                  - concat_l [ mean_a(e_{a,l,T}) ]          (slice l: worker errors, mean over nodes)
                  - concat_l [ concat_a(s_{a,l,T}) ]        (slice l: server errors, node a's chunk)

each bracket cut to the slice's real length and laid out at slice l's place; it holds up
to the fp32 rounding of the intra-node mean (tests check it over many calls). It follows
from the flat invariant of cross group l with inputs y_{a,l,t}, since mean_a(y_{a,l,t}) is
slice l of mean_r(x_{r,t}).

Non-finite input (never corrupting errors, as the flat call): every rank sends with its
slices a flag saying whether its input is finite; a rank whose node holds a non-finite
input writes NaN into its reduced slice, so that every cross group's own finiteness
agreement reaches the same verdict and every rank skips with the errors untouched (one
case: finite inputs whose intra-node sum overflows float32 in one slice only; the cross
groups then disagree, every rank sees that in the all-gather's statuses, and the errors of
every rank are reset to zero before the call skips or raises, saying so).

Degenerate topologies: one node (N = 1) or one rank per node (G = 1) is today's flat call
over all ranks, bitwise (the state then holds one flat CompressionState).

The groups are a `Topology` (`lbcomm.reduce.topology`); the schedule of a call is
`lbcomm.reduce.hiercall.steps`, which moves slices with the local transport's row
collectives (shared memory or the group's network, the algorithm reads the same either
way) and runs blocking or asynchronously (async_op).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from ..common import NONFINITE_POLICIES, compressor_stats, drive
from ..config import DEFAULT_BLOCK_SIZE
from . import hiercall
from .compression import CompressionState
from .hiercall import FLAG_BYTES
from .calls import CallBook
from .inputs import check_cap, check_tensor
from .topology import Topology, slice_spans
from .wire import chunk_size

__all__ = ["HierarchicalState", "hierarchical_allreduce_", "hierarchical_mean_"]

_log = logging.getLogger("lbcomm.topology")  # the 0.2 logger name, kept for users' logging settings

_STAGE = 1 << 20  # elements per pass of reduce_'s staging


class HierarchicalState(CallBook):
    """Error feedback of hierarchical compressed allreduces of one tensor size on one
    topology: this rank's CompressionState of its slice over its cross group (or, for a
    flat topology, one CompressionState of the whole tensor over all ranks).

    Args:
        numel (int): elements of the tensors this state will reduce.
        topology (Topology): the groups.
        device (torch.device, optional): where the buffers live (default: the CPU, or the
            current CUDA device on NCCL groups).
        block_size (int or None, optional): as `CompressionState` (default: 2048).
        nonfinite (str, optional): "raise" or "skip", as `CompressionState` (default: "raise").
        pieces (int, optional): pipelining of the 1-bit stage, as `CompressionState`.

    Attributes:
        compression (CompressionState): the 1-bit stage's state (slice over the cross
            group, or the whole tensor over all ranks when flat).
        span ((int, int)): the [lo, hi) input elements this rank's slice covers.
        spans (list of (int, int)): every local rank's slice (multi-node topologies).
        slice_len (int): elements per slice, L (multi-node topologies).
        verified (bool): whether the node's layouts were compared (the first call's
            handshake, `lbcomm.reduce.hiercall`).
    """

    CALL = "hierarchical allreduce"

    def __init__(self, numel: int, topology: Topology, device: Optional[Union[str, torch.device]] = None,
                 block_size: Optional[int] = DEFAULT_BLOCK_SIZE, *, nonfinite: str = "raise",
                 pieces: Optional[int] = None):
        if not isinstance(topology, Topology):
            raise TypeError(f"HierarchicalState: topology must be a lbcomm.Topology, got "
                            f"{type(topology).__name__}")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"Invalid numel: {numel!r} (must be a non-negative int)")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid nonfinite policy: {nonfinite!r} (use one of {NONFINITE_POLICIES})")
        self.topology, self.numel, self.nonfinite = topology, numel, nonfinite
        self.calls = self.skipped = 0
        self.last_skipped = False
        self.verified = False
        self._zeroed: Optional[Tuple[Tensor, Tensor]] = None  # zero_errors_at's slice index
        self._busy = False
        self._buf: Optional[Tensor] = None  # reduce_'s staging of a callable source or another sink
        if topology.flat:
            self.span = (0, numel)
            self.compression = CompressionState(numel, group=topology.flat_group, device=device,
                                                block_size=block_size, nonfinite=nonfinite,
                                                backend=topology.backend, pieces=pieces)
            self.device = self.compression.device
            return
        G = topology.local_size
        self.slice_len = chunk_size(numel, G)
        self.spans = slice_spans(numel, G)
        self.span = self.spans[topology.local_rank]
        # The 1-bit stage always skips (never raises) inside, so that every rank reaches the
        # all-gather; the policy is applied once every rank knows every slice's verdict.
        self.compression = CompressionState(self.span[1] - self.span[0], group=topology.cross_group, device=device,
                                            block_size=block_size, nonfinite="skip", backend=topology.backend,
                                            pieces=pieces)
        self.device = self.compression.device
        topology.local.check_device(self.device)  # the slices' rows live in the local transport

    # ------------------------------------------------------------------ the Reducer protocol
    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def reduce_(self, source, sink, *, checked: bool = False, async_op: bool = False,
                weights: Optional[Tensor] = None, cap: Optional[Tensor] = None):
        """The `lbcomm.reduce.reducer.Reducer` call: `hierarchical_allreduce_` of `source` into
        `sink` (tensors, or the range-by-range callables of `lbcomm.reduce.compressed.reduce_`; a
        callable source is staged whole, since the intra-node reduce-scatter needs every
        slice at once). The call agrees on finiteness itself (`checked` changes nothing).
        `cap` (the capped decode of `lbcomm.reduce.compressed.reduce_`) bounds the 1-bit stage
        between the nodes: each slice with its part of the caps; the intra-node means are
        exact. Returns True when the sink was written (or a Future of that bool)."""
        name = "HierarchicalState.reduce_"
        if weights is not None:
            raise ValueError(f"{name}: per-coordinate weights need the flat compressed call")
        cap = check_cap(name, cap, self.numel, self.device, self.block_size, None)
        for t, what in ((source, "the tensor"), (sink, "the output")):
            if isinstance(t, Tensor):
                check_tensor(name, t, self.numel, self.device, what, "HierarchicalState")
            elif not callable(t):
                raise TypeError(f"{name}: expected a tensor or a callable, got {type(t).__name__} ({what})")
        self.ensure_idle()
        n = self.numel
        if isinstance(source, Tensor) and source is sink:
            buf = source
        else:
            if self._buf is None or self._buf.numel() != n:
                self._buf = torch.empty(n, dtype=torch.float32, device=self.device)
            buf = self._buf
            for lo in range(0, n, _STAGE):
                hi = min(n, lo + _STAGE)
                if isinstance(source, Tensor):
                    buf[lo:hi].copy_(source.reshape(-1)[lo:hi])
                else:
                    source(lo, hi, buf[lo:hi])

        def call():
            applied = yield from hiercall.steps(name, self, buf, cap)
            if applied and buf is not sink:
                for lo in range(0, n, _STAGE):
                    hi = min(n, lo + _STAGE)
                    if isinstance(sink, Tensor):
                        sink.view(-1)[lo:hi].copy_(buf[lo:hi])
                    else:
                        sink(lo, hi, buf[lo:hi])
            return applied

        return drive(call(), self.device, async_op)

    def compression_stats(self) -> Dict[str, Any]:
        """`lbcomm.common.compressor_stats`, and the bytes this rank sends per call between
        and inside nodes."""
        return {**compressor_stats(self), "bytes_per_call": self.bytes_per_call(),
                "intra_node_bytes_per_call": self.intra_node_bytes_per_call()}

    @classmethod
    def redistribute(cls, saved, world_size: int, rank: int) -> None:
        """None: hierarchical error feedback belongs to one node shape (slices per local
        rank, chunks per cross group) and is not mapped onto another world; the resumed
        run starts it from zero (`lbcomm.reduce.reducer.redistribute` logs a warning)."""
        return None

    # ------------------------------------------------------------------ state
    @property
    def block_size(self) -> Optional[int]:
        return self.compression.block_size

    @property
    def worker_error(self) -> Tensor:
        return self.compression.worker_error

    @property
    def last_sent_norm(self) -> float:
        """What the 1-bit stage sent in its last call (`CompressionState.last_sent_norm`)."""
        return self.compression.last_sent_norm

    @property
    def server_error(self) -> Tensor:
        return self.compression.server_error

    def bytes_per_call(self, checked: bool = False) -> int:
        """Bytes this rank sends per call over the network between nodes (the 1-bit stage,
        its finiteness agreement included unless `checked`, see
        CompressionState.bytes_per_call); for a flat topology, what the flat call sends."""
        return self.compression.bytes_per_call(checked)

    def intra_node_bytes_per_call(self) -> int:
        """Bytes this rank sends per call inside its node (full-precision slices and results)."""
        if self.topology.flat:
            return 0
        return 2 * (self.topology.local_size - 1) * (4 * self.slice_len + FLAG_BYTES)

    def reset(self) -> None:
        self.compression.reset()

    def zero_errors_at(self, index: Tensor) -> None:
        """Zero the errors of the input coordinates `index` (int64, ascending; averaged
        exactly beside the call, exact_numel): those in this rank's slice, see
        CompressionState.zero_errors_at (the intra-node stages keep no errors). Pass the
        same tensor every call: the slice's part is derived once."""
        if self.topology.flat:
            self.compression.zero_errors_at(index)
            return
        if self._zeroed is None or self._zeroed[0] is not index:
            lo, hi = self.span
            self._zeroed = (index, index[(index >= lo) & (index < hi)] - lo)
        self.compression.zero_errors_at(self._zeroed[1])

    def _layout(self) -> tuple:
        t = self.topology
        return (self.numel, t.nodes, t.local_size, t.node, t.local_rank, self.block_size)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's error feedback and the layout it belongs to (one shard per rank)."""
        return {"layout": self._layout(), "calls": self.calls, "skipped": self.skipped,
                "compression": self.compression.state_dict()}

    def load_state_dict(self, sd: Dict[str, Any], *, all_ranks=None) -> bool:
        """Restore a `state_dict`; saved for another topology or size, the errors are reset
        with a logged warning and False is returned. ``all_ranks`` is taken for the one
        contract of every reducer, but the errors of another node shape are not
        redistributed (`redistribute`)."""
        self.ensure_idle()
        self.calls, self.skipped = int(sd.get("calls", 0)), int(sd.get("skipped", 0))
        if tuple(sd.get("layout", ())) != self._layout():
            _log.warning("lbcomm: hierarchical error feedback was saved for (numel, nodes, local_size, node, "
                         "local_rank, block_size)=%s but this run has %s; resetting it to zero", sd.get("layout"),
                         self._layout())
            self.reset()
            return False
        return self.compression.load_state_dict(sd["compression"])


def hierarchical_mean_(tensor: Tensor, topology: "Topology") -> Tensor:
    """In place: the exact fp32 MEAN of a 1-D float32 `tensor` over all ranks of a
    multi-node `topology`, in the hierarchical call's shape without compression (for the
    few coordinates averaged exactly beside it, exact_numel): slice l of the node's sum at
    local rank l (summed in local-rank order), its sum across the nodes, divided by the
    world size, all-gathered inside the node. Between nodes each rank sends its slice only:
    1/G of a flat allreduce's inter-node bytes. Bitwise identical on every rank."""
    t = topology
    if t.flat:
        raise ValueError("hierarchical_mean_: the topology is flat (one node or one rank per node); use an allreduce")
    if tensor.dtype != torch.float32 or tensor.dim() != 1:
        raise TypeError(f"hierarchical_mean_: needs a 1-D float32 tensor, got {tensor.dtype} of shape "
                        f"{tuple(tensor.shape)}")
    G, n = t.local_size, tensor.numel()
    L = chunk_size(n, G)
    rows = torch.zeros(G, L, dtype=torch.float32, device=tensor.device)
    rows.view(-1)[:n].copy_(tensor)
    got = torch.empty_like(rows)
    t.local.all_to_all(got, rows)  # got[j]: local rank j's copy of this rank's slice
    acc = got[0].clone()
    for j in range(1, G):
        acc.add_(got[j])
    t.cross.all_reduce(acc, op="sum")
    acc.div_(t.world_size)
    t.local.all_gather(rows, acc)
    return tensor.copy_(rows.view(-1)[:n])


def hierarchical_allreduce_(tensor: Tensor, state: HierarchicalState, *, async_op: bool = False):
    """In place: the approximate MEAN of `tensor` over all ranks of the state's topology,
    full precision inside each node and 1-bit error-feedback compressed between nodes
    (see the module docs). Bitwise identical on every rank.

    Args:
        tensor (Tensor): float32/float16/bfloat16, `state.numel` elements on `state.device`
            (half precision goes through the fp32 error domain and is cast back). Left
            unchanged by a call skipped for non-finite input.
        state (HierarchicalState): this rank's error feedback for this size.
        async_op (bool, optional): return a Future of `tensor`; the collectives are chained
            through callbacks without blocking (keep one async call in flight per
            topology, as for `lbcomm.reduce.compressed.reduce_`) (default: False).

    Returns:
        `tensor` (or a Future of it); ``state.last_skipped`` says whether a
        ``nonfinite="skip"`` call skipped.

    Example::

        >>> mesh = init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("node", "local"))
        >>> state = lbcomm.HierarchicalState(grad.numel(), lbcomm.Topology.from_mesh(mesh))
        >>> lbcomm.reduce.hierarchical_allreduce_(grad, state)
    """
    name = "hierarchical_allreduce_"
    if not isinstance(state, HierarchicalState):
        raise TypeError(f"{name}: state must be a HierarchicalState, got {type(state).__name__}")
    check_tensor(name, tensor, state.numel, state.device, "the tensor", "HierarchicalState")

    def call():
        yield from hiercall.steps(name, state, tensor)
        return tensor

    return drive(call(), state.device, async_op)
