"""Hierarchical compressed allreduce: full precision inside a node, 1 bit between nodes
(see docs/topology.md).

p = N x G ranks: N nodes of G ranks each. Rank (node a, local index l) belongs to two
groups: its node's *local group* (G ranks on fast links) and its *cross group* (the N
ranks with local index l, one per node, joined by the slow network). A call:

    rs       local all-to-all of fp32 slices    rank l of a node receives slice l of every
                                                node member's input (one flag each: input finite?)
    mean     y_{a,l} = (x_{a,0}[l] + ... + x_{a,G-1}[l]) / G    fp32, in local rank order
    1-bit    the two-stage error-feedback compressed allreduce of y_{a,l} over cross group l
             (`lbcomm.compressed.reduce_` with this rank's own CompressionState of the slice)
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

Groups (`Topology`): from a 2-D DeviceMesh with dimensions ("node", "local")
(`Topology.from_mesh`), from torchrun's LOCAL_WORLD_SIZE (`Topology.from_env`, or
`Topology.auto()`, which returns None unless there is more than one node), or given
explicitly: any two groups of torch.distributed (or mpi4py communicators with
backend="mpi") such that the local groups partition the ranks into nodes of equal size and
each cross group holds one rank of every node, the ranks of a cross group in node order.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.profiler import record_function

from .comm import TorchTransport, get_transport
from .comm.shm import ShmTransport
from .common import FLOAT_DTYPES, NONFINITE_POLICIES, completed_future, ring_allreduce_bytes
from .compressed import DEFAULT_BLOCK_SIZE, CompressionState, NonFiniteError, compressed_allreduce_, reduce_
from .wire import chunk_size

__all__ = ["Topology", "HierarchicalState", "hierarchical_allreduce_", "hierarchical_mean_", "exact_mean_bytes",
           "slice_spans", "INTRA_NODE"]

INTRA_NODE = ("auto", "shm", "group")

_log = logging.getLogger(__name__)

# Status of a rank's slice after the 1-bit stage, carried in its all-gather row.
_APPLIED, _SKIPPED, _EMPTY = 1, 2, 3
_FLAG_BYTES = 4
_STAGE = 1 << 20  # elements per pass of reduce_'s staging


def _intra_node_transport(group, backend: str, intra_node: str):
    """The transport that moves slices inside the node (see Topology's intra_node)."""
    tr = get_transport(group, backend=backend)
    if intra_node == "group" or tr.world_size == 1:
        return tr
    if intra_node == "auto" and not (isinstance(tr, TorchTransport) and str(tr.backend).lower() == "gloo"):
        return tr
    if not isinstance(tr, TorchTransport):
        raise ValueError("Topology: intra_node='shm' needs a torch.distributed local group (it synchronizes over it)")
    try:
        return ShmTransport(group)
    except ValueError:
        if intra_node == "shm":
            raise
        _log.info("Topology: the ranks of the local group are on different hosts; slices go through the group")
        return tr


def slice_spans(numel: int, local_size: int) -> List[tuple]:
    """[lo, hi) of every local rank's slice: L = chunk_size(numel, G) elements each, the
    last ones cut to numel (possibly empty)."""
    L = chunk_size(numel, local_size)
    return [(min(l * L, numel), min((l + 1) * L, numel)) for l in range(local_size)]


class Topology:
    """Which ranks share a node: this rank's local group (its node) and cross group (the
    ranks with its local index on every node).

    Args:
        local_group: the group of this rank's node (G ranks; a torch.distributed
            ProcessGroup, or an mpi4py communicator with backend="mpi").
        cross_group: the group of the ranks with this rank's local index, one per node,
            in node order (N ranks).
        backend (str, optional): transport backend of both groups, see
            `lbcomm.comm.get_transport` (default: "auto").
        intra_node (str, optional): how slices move inside a node: "shm" (shared memory,
            `lbcomm.comm.shm.ShmTransport`: CPU tensors, every rank of the node on this
            host), "group" (the local group's own transport: gloo's sockets, NCCL, MPI) or
            "auto": "shm" for a gloo local group whose ranks share a host, else "group".
            Collective over the local group (default: "auto").

    Build it with `from_mesh`, `from_env` or `auto` rather than by hand.
    """

    __slots__ = ("local_group", "cross_group", "backend", "intra_node", "local", "cross", "nodes", "local_size",
                 "node", "local_rank")

    def __init__(self, local_group, cross_group, *, backend: str = "auto", intra_node: str = "auto"):
        if intra_node not in INTRA_NODE:
            raise ValueError(f"Invalid intra_node: {intra_node!r} (use one of {INTRA_NODE})")
        self.local_group, self.cross_group, self.backend = local_group, cross_group, backend
        self.local = _intra_node_transport(local_group, backend, intra_node)
        self.intra_node = "shm" if isinstance(self.local, ShmTransport) else "group"
        self.cross = get_transport(cross_group, backend=backend)
        self.local_size, self.local_rank = self.local.world_size, self.local.rank
        self.nodes, self.node = self.cross.world_size, self.cross.rank

    def __repr__(self) -> str:
        return (f"Topology(nodes={self.nodes}, local_size={self.local_size}, node={self.node}, "
                f"local_rank={self.local_rank}, intra_node={self.intra_node!r})")

    @property
    def world_size(self) -> int:
        return self.nodes * self.local_size

    @property
    def flat(self) -> bool:
        """One node or one rank per node: the hierarchical call is the flat call."""
        return self.nodes == 1 or self.local_size == 1

    @property
    def flat_group(self):
        """The group that holds every rank when the topology is flat."""
        return self.cross_group if self.local_size == 1 else self.local_group

    @classmethod
    def from_mesh(cls, mesh, node_dim: str = "node", local_dim: str = "local", *,
                  intra_node: str = "auto") -> "Topology":
        """From a 2-D DeviceMesh, e.g. ``init_device_mesh("cpu", (N, G), mesh_dim_names=("node", "local"))``:
        the groups along `local_dim` are the nodes, those along `node_dim` the cross groups."""
        names = getattr(mesh, "mesh_dim_names", None) or ()
        if mesh.ndim != 2 or node_dim not in names or local_dim not in names:
            raise ValueError(f"Topology.from_mesh: expected a 2-D DeviceMesh with dimensions ({node_dim!r}, "
                             f"{local_dim!r}), got {mesh.ndim} dimension(s) named {names}; build it with "
                             f"init_device_mesh(device, (nodes, ranks_per_node), mesh_dim_names=({node_dim!r}, "
                             f"{local_dim!r}))")
        return cls(mesh.get_group(local_dim), mesh.get_group(node_dim), backend="torch", intra_node=intra_node)

    @classmethod
    def from_env(cls, group=None) -> "Topology":
        """From torchrun's environment: LOCAL_WORLD_SIZE ranks per node, ranks numbered node
        by node (rank = node x G + LOCAL_RANK, as torchrun does). Creates 2 x ... new process
        groups: every rank of the world must call it, in the same order as its other
        collectives. Only for the default (world) group."""
        import torch.distributed as dist

        if group is not None and group is not dist.group.WORLD:
            raise ValueError("Topology.from_env works on the world group only; pass explicit groups "
                             "(Topology(local_group, cross_group)) or a DeviceMesh (Topology.from_mesh) for a subgroup")
        if not dist.is_initialized():
            raise RuntimeError("Topology.from_env: torch.distributed is not initialized; call init_process_group first")
        world, rank = dist.get_world_size(), dist.get_rank()
        try:
            G = int(os.environ["LOCAL_WORLD_SIZE"])
        except (KeyError, ValueError):
            raise ValueError("Topology.from_env needs LOCAL_WORLD_SIZE (set by torchrun) to be an int; launch with "
                             "torchrun or build the topology from a DeviceMesh") from None
        if G < 1 or world % G:
            raise ValueError(f"Topology.from_env: LOCAL_WORLD_SIZE={G} does not divide the world size {world}; "
                             "every node must run the same number of ranks")
        local_rank = int(os.environ.get("LOCAL_RANK", rank % G))
        if local_rank != rank % G:
            raise ValueError(f"Topology.from_env: rank {rank} has LOCAL_RANK={local_rank}, but ranks are expected "
                             f"node by node (rank % LOCAL_WORLD_SIZE = {rank % G}); pass explicit groups instead")
        return cls.node_by_node(G)

    @classmethod
    def node_by_node(cls, ranks_per_node: int, *, intra_node: str = "auto") -> "Topology":
        """Nodes of `ranks_per_node` consecutive ranks of the world (rank = node x G + local
        index). Creates N + G new process groups: every rank of the world must call it, in
        the same order as its other collectives."""
        import torch.distributed as dist

        world, rank, G = dist.get_world_size(), dist.get_rank(), ranks_per_node
        if isinstance(G, bool) or not isinstance(G, int) or G < 1 or world % G:
            raise ValueError(f"Topology.node_by_node: {G!r} ranks per node does not divide the world size {world}")
        local_rank = rank % G
        N = world // G
        local_group = cross_group = None
        for a in range(N):  # every rank creates every group, in the same order
            g = dist.new_group(list(range(a * G, (a + 1) * G)))
            if a == rank // G:
                local_group = g
        for l in range(G):
            g = dist.new_group(list(range(l, world, G)))
            if l == local_rank:
                cross_group = g
        return cls(local_group, cross_group, backend="torch", intra_node=intra_node)

    def private(self) -> "Topology":
        """A copy on new process groups of the same ranks, so that its collectives never
        interleave with those of other users of these groups (the DDP hook runs its calls
        on a background thread). torch.distributed only; every rank of the default group
        must call it, in the same order as its other collectives."""
        import torch.distributed as dist

        if self.backend == "mpi" or not dist.is_initialized():
            raise ValueError("Topology.private needs torch.distributed process groups")
        world = dist.get_world_size()
        if self.world_size != world:
            raise ValueError(f"Topology.private: the topology spans {self.world_size} ranks but the default group has "
                             f"{world}; hierarchical groups inside a subgroup are not supported here, pass a topology "
                             "of the whole world")
        mine = (dist.get_rank(), self.node, self.local_rank)
        everyone: List[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        nodes = [[r for r, a, _ in sorted(everyone, key=lambda v: v[2]) if a == node] for node in range(self.nodes)]
        cross = [[r for r, _, l in sorted(everyone, key=lambda v: v[1]) if l == local]
                 for local in range(self.local_size)]
        local_group = cross_group = None
        for node, ranks in enumerate(nodes):  # every rank creates every group, in the same order
            g = dist.new_group(ranks)
            if node == self.node:
                local_group = g
        for local, ranks in enumerate(cross):
            g = dist.new_group(ranks)
            if local == self.local_rank:
                cross_group = g
        return Topology(local_group, cross_group, backend="torch", intra_node=self.intra_node)

    @classmethod
    def auto(cls) -> Optional["Topology"]:
        """`from_env()` under torchrun with more than one node (LOCAL_WORLD_SIZE < WORLD_SIZE),
        otherwise None (flat). Every rank must call it (it creates process groups)."""
        try:
            G, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
        except (KeyError, ValueError):
            return None
        if G < 1 or G >= world:
            return None
        return cls.from_env()


class HierarchicalState:
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
    """

    def __init__(self, numel: int, topology: Topology, device: Optional[Union[str, torch.device]] = None,
                 block_size: Optional[int] = DEFAULT_BLOCK_SIZE, *, nonfinite: str = "raise",
                 pieces: Optional[int] = None):
        if not isinstance(topology, Topology):
            raise TypeError(f"HierarchicalState: topology must be a lbcomm.topology.Topology, got "
                            f"{type(topology).__name__}")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"Invalid numel: {numel!r} (must be a non-negative int)")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid nonfinite policy: {nonfinite!r} (use one of {NONFINITE_POLICIES})")
        self.topology, self.numel, self.nonfinite = topology, numel, nonfinite
        self.calls = self.skipped = 0
        self.last_skipped = False
        self._verified = False
        self._zeroed: Optional[Tuple[Tensor, Tensor]] = None  # zero_errors_at's slice index
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
        self._spans = slice_spans(numel, G)
        self.span = self._spans[topology.local_rank]
        # The 1-bit stage always skips (never raises) inside, so that every rank reaches the
        # all-gather; the policy is applied once every rank knows every slice's verdict.
        self.compression = CompressionState(self.span[1] - self.span[0], group=topology.cross_group, device=device,
                                            block_size=block_size, nonfinite="skip", backend=topology.backend,
                                            pieces=pieces)
        self.device = self.compression.device
        topology.local.check_device(self.device)
        if isinstance(topology.local, ShmTransport):
            return  # slices move through the transport's shared buffers
        row = 4 * self.slice_len + _FLAG_BYTES
        u8 = dict(dtype=torch.uint8, device=self.device)
        self._send = torch.zeros(G, row, **u8)  # pad elements past numel stay zero
        self._recv = torch.empty(G, row, **u8)
        self._mine = torch.zeros(row, **u8)
        self._gathered = torch.empty(G, row, **u8)

    # ------------------------------------------------------------------ the Reducer protocol
    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def reduce_(self, source, sink, *, checked: bool = False, async_op: bool = False,
                weights: Optional[Tensor] = None):
        """The `lbcomm.reducer.Reducer` call: `hierarchical_allreduce_` of `source` into
        `sink` (tensors, or the range-by-range callables of `lbcomm.compressed.reduce_`; a
        callable source is staged whole, since the intra-node reduce-scatter needs every
        slice at once). Returns True when the sink was written."""
        if weights is not None:
            raise ValueError("HierarchicalState.reduce_: per-coordinate weights need the flat compressed call")
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
        hierarchical_allreduce_(buf, self)
        applied = not self.last_skipped
        if applied and buf is not sink:
            for lo in range(0, n, _STAGE):
                hi = min(n, lo + _STAGE)
                if isinstance(sink, Tensor):
                    sink.view(-1)[lo:hi].copy_(buf[lo:hi])
                else:
                    sink(lo, hi, buf[lo:hi])
        return completed_future(applied) if async_op else applied

    def compression_stats(self) -> Dict[str, Any]:
        """Calls, skipped calls and the bytes this rank sends per call between and inside nodes."""
        return {"calls": self.calls, "skipped_calls": self.skipped, "bytes_per_call": self.bytes_per_call(),
                "intra_node_bytes_per_call": self.intra_node_bytes_per_call(), "world_size": self.world_size,
                "numel": self.numel}

    @classmethod
    def redistribute(cls, saved, world_size: int, rank: int) -> Dict[str, Any]:
        raise ValueError("HierarchicalState: its error feedback belongs to one topology; resuming on another one "
                         "starts it from zero (load_state_dict warns)")

    # ------------------------------------------------------------------ state
    @property
    def block_size(self) -> Optional[int]:
        return self.compression.block_size

    @property
    def worker_error(self) -> Tensor:
        return self.compression.worker_error

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
        return 2 * (self.topology.local_size - 1) * (4 * self.slice_len + _FLAG_BYTES)

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

    def load_state_dict(self, sd: Dict[str, Any]) -> bool:
        """Restore a `state_dict`; saved for another topology or size, the errors are reset
        with a logged warning and False is returned."""
        self.calls, self.skipped = int(sd.get("calls", 0)), int(sd.get("skipped", 0))
        if tuple(sd.get("layout", ())) != self._layout():
            _log.warning("lbcomm: hierarchical error feedback was saved for (numel, nodes, local_size, node, "
                         "local_rank, block_size)=%s but this run has %s; resetting it to zero", sd.get("layout"),
                         self._layout())
            self.reset()
            return False
        return self.compression.load_state_dict(sd["compression"])


def _handshake(state: HierarchicalState) -> None:
    """Once per state: every local rank's layout, compared before the variable-size
    intra-node collectives (different row lengths would abort gloo)."""
    t = state.topology
    mine = torch.tensor([state.numel, state.block_size or 0, state.calls, t.nodes, t.node], dtype=torch.int64)
    everyone = torch.empty(t.local_size * mine.numel(), dtype=torch.int64, device=state.device)
    t.local.all_gather(everyone.view(torch.uint8), mine.to(state.device).view(torch.uint8))
    rows = everyone.view(t.local_size, -1).cpu()
    same = rows[:, :4] == mine[:4]
    if not bool(same.all()) or not bool((rows[:, 4] == mine[4]).all()):
        desc = ", ".join(f"local rank {r}: numel={int(v[0])} block_size={int(v[1]) or None} calls={int(v[2])} "
                         f"nodes={int(v[3])} node={int(v[4])}" for r, v in enumerate(rows))
        raise ValueError("hierarchical_allreduce_: the ranks of a node called with different tensors, state layouts "
                         f"or topologies ({desc}); every rank must reduce the same sizes in the same order, and the "
                         "local group must hold the ranks of one node")
    state._verified = True


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


def exact_mean_bytes(numel: int, world_size: int, state=None) -> int:
    """Bytes a rank sends to average `numel` fp32 elements exactly beside a compressed call
    whose state is `state`: a ring allreduce over `world_size` ranks, or for a multi-node
    HierarchicalState `hierarchical_mean_`'s bytes between nodes (the convention of its
    bytes_per_call)."""
    if not numel:
        return 0
    if isinstance(state, HierarchicalState) and not state.topology.flat:
        t = state.topology
        return int(ring_allreduce_bytes(4 * chunk_size(numel, t.local_size), t.nodes))
    return int(ring_allreduce_bytes(4 * numel, world_size))


def hierarchical_allreduce_(tensor: Tensor, state: HierarchicalState) -> Tensor:
    """In place: the approximate MEAN of `tensor` over all ranks of the state's topology,
    full precision inside each node and 1-bit error-feedback compressed between nodes
    (see the module docs). Bitwise identical on every rank.

    Args:
        tensor (Tensor): float32/float16/bfloat16, `state.numel` elements on `state.device`
            (half precision goes through the fp32 error domain and is cast back). Left
            unchanged by a call skipped for non-finite input.
        state (HierarchicalState): this rank's error feedback for this size.

    Returns:
        `tensor`; ``state.last_skipped`` says whether a ``nonfinite="skip"`` call skipped.

    Example::

        >>> mesh = init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("node", "local"))
        >>> state = lbcomm.HierarchicalState(grad.numel(), lbcomm.Topology.from_mesh(mesh))
        >>> lbcomm.hierarchical_allreduce_(grad, state)
    """
    if not isinstance(state, HierarchicalState):
        raise TypeError(f"hierarchical_allreduce_: state must be a HierarchicalState, got {type(state).__name__}")
    if state.topology.flat:
        compressed_allreduce_(tensor, state.compression)
        state.calls += 1
        state.last_skipped = state.compression.last_skipped
        state.skipped += int(state.last_skipped)
        return tensor
    if not isinstance(tensor, Tensor) or tensor.dtype not in FLOAT_DTYPES:
        raise TypeError("hierarchical_allreduce_: expected a float32/float16/bfloat16 tensor, got "
                        f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
    if tensor.numel() != state.numel:
        raise ValueError(f"hierarchical_allreduce_: the tensor has {tensor.numel()} elements but the state was built "
                         f"for {state.numel}; use one HierarchicalState per tensor size")
    if tensor.device != state.device:
        raise ValueError(f"hierarchical_allreduce_: the tensor is on {tensor.device} but the state's buffers are on "
                         f"{state.device}; build the state with device={tensor.device!s}")
    t = state.topology
    if not state._verified:
        _handshake(state)
    G, L, n0 = t.local_size, state.slice_len, state.numel
    x = tensor.reshape(-1)
    lo, hi = state.span
    real = hi - lo
    shm = isinstance(t.local, ShmTransport)
    # Reduce-scatter inside the node: slice l of every rank's input (fp32) and its flag
    # (input not finite) reach local rank l.
    with record_function("lbcomm.hier.stage_in"):
        finite = bool(torch.isfinite(x.sum(dtype=torch.float32))) or bool(torch.isfinite(x).all())
        if shm:  # the other ranks' slices of this input in shared memory, read in place by their owners
            buf = t.local.stage(4 * G * L + _FLAG_BYTES)
            staged = buf[:4 * n0].view(torch.float32)
            for j, (a, b) in enumerate(state._spans):
                if j != t.local_rank:  # this rank's own slice is read from the input itself
                    staged[a:b].copy_(x[a:b])
            buf[4 * G * L:].view(torch.int32).fill_(0 if finite else 1)
        else:
            send_f = state._send[:, :4 * L].view(torch.float32)
            for j, (a, b) in enumerate(state._spans):
                send_f[j, :b - a].copy_(x[a:b])
            state._send[:, 4 * L:].view(torch.int32).fill_(0 if finite else 1)
    with record_function("lbcomm.hier.reduce_scatter"):
        if shm:
            views = t.local.publish()
            rows = [x[lo:hi] if j == t.local_rank else v[4 * lo:4 * hi].view(torch.float32)
                    for j, v in enumerate(views)]
            node_bad = any(bool(v[4 * G * L:].view(torch.int32)) for v in views)
            mine = t.local.stage(4 * L + _FLAG_BYTES)  # the all-gather row, filled in place below
        else:
            t.local.all_to_all(state._recv, state._send)
            rows = [r[:real] for r in state._recv[:, :4 * L].view(torch.float32)]
            node_bad = bool(state._recv[:, 4 * L:].view(torch.int32).any())
            mine = state._mine
    acc = mine[:4 * L].view(torch.float32)[:real]
    with record_function("lbcomm.hier.mean"):
        if real:  # fp32, local rank order: the recipe of lbcomm.reference.hierarchical_allreduce
            # (a half-precision row of this rank's own input is widened exactly by the add)
            torch.add(rows[0], rows[1], out=acc)
            for j in range(2, G):
                acc.add_(rows[j])
            acc.div_(G)
    with record_function("lbcomm.hier.onebit"):
        if real == 0:
            status = _EMPTY
        else:
            if node_bad:
                acc[0] = float("nan")  # every cross group then agrees on "skip", errors untouched
            status = _APPLIED if reduce_(state.compression, acc, acc) else _SKIPPED
    mine[4 * L:].view(torch.int32).fill_(status)
    # All-gather inside the node: every slice's result and status.
    with record_function("lbcomm.hier.all_gather"):
        if shm:
            views = t.local.publish()
        else:
            t.local.all_gather(state._gathered.view(-1), state._mine)
            views = list(state._gathered)
    statuses = [int(v[4 * L:].view(torch.int32)) for v in views]
    state.calls += 1
    skipped = _SKIPPED in statuses
    state.last_skipped = skipped
    if skipped:
        state.skipped += 1
        mixed = _APPLIED in statuses
        if mixed:  # some slices committed new errors, others did not: no consistent state left
            state.reset()
            what = ("a slice's intra-node mean or a server sum overflowed float32 although the inputs were finite; "
                    "the error feedback was reset to zero on every rank")
        else:
            what = "the input holds NaN or Inf on at least one rank (the error buffers are unchanged)"
        if state.nonfinite == "raise":
            raise NonFiniteError(f"hierarchical_allreduce_: {what}; check for overflow, or pass nonfinite='skip'")
        _log.debug("hierarchical_allreduce_: skipped: %s", what)
        return tensor
    with record_function("lbcomm.hier.copy_out"):
        flat = tensor.view(-1) if tensor.is_contiguous() else None
        if flat is None:
            flat = torch.empty(n0, dtype=tensor.dtype, device=tensor.device)
        for j, (a, b) in enumerate(state._spans):
            flat[a:b].copy_(views[j][:4 * (b - a)].view(torch.float32))
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
    return tensor
