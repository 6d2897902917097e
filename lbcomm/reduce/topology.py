"""Which ranks share a node: `Topology`, the groups of the hierarchical compressed
allreduce (`lbcomm.reduce.hierarchical`, docs/topology.md), and `slice_spans`, the
slice of the input each local rank reduces between the nodes.

p = N x G ranks: N nodes of G ranks each. Rank (node a, local index l) belongs to two
groups: its node's *local group* (G ranks on fast links) and its *cross group* (the N
ranks with local index l, one per node, joined by the slow network).

Groups: from a 2-D DeviceMesh with dimensions ("node", "local") (`Topology.from_mesh`), from
torchrun's LOCAL_WORLD_SIZE (`Topology.from_env`, or `Topology.auto()`, which returns None
unless there is more than one node), or given explicitly: any two groups of
torch.distributed (or mpi4py communicators with backend="mpi") such that the local groups
partition the ranks into nodes of equal size and each cross group holds one rank of every
node, the ranks of a cross group in node order.
"""
from __future__ import annotations

import logging
import os
from typing import List, Optional

from ..comm import TorchTransport, all_gather_objects, get_transport
from ..comm.shm import ShmTransport
from .wire import chunk_size

__all__ = ["Topology", "slice_spans", "INTRA_NODE"]

INTRA_NODE = ("auto", "shm", "group")

_log = logging.getLogger("lbcomm.topology")  # the 0.2 logger name, kept for users' logging settings


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
        self.intra_node = "shm" if self.local.backend == "shm" else "group"
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
        everyone = all_gather_objects(mine)
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
