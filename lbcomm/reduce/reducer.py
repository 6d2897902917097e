"""The `Reducer` protocol (what every compressed reduction of lbcomm offers), its factory
`make_reducer`, `resolve_topology` and elastic `redistribute`.

A reducer holds the error feedback of compressed allreduces of one flat size on one set of
ranks and reduces with one call, ``reducer.reduce_(source, sink, *, checked, async_op,
weights, cap)``. Its implementations:

* `lbcomm.CompressionState` (`lbcomm.reduce.compression`): the flat 1-bit allreduce over
  one process group;
* `lbcomm.HierarchicalState` (`lbcomm.reduce.hierarchical`): full precision inside each
  node, 1-bit between nodes;

and the FSDP2/HSDP hook compresses each shard with a flat reducer over its replicate group.
Optimizers and hooks build one with `make_reducer(numel, comm, device=...)` and never
branch on its type.

Every reducer owns: the agreement over the ranks that every input is finite (``checked``
says the caller has done it), its `state_dict` / `load_state_dict` (one shard per rank),
`redistribute` (the saved shards of every rank of another world size onto this one,
elastic resume), `compression_stats` and `bytes_per_call`.

Elastic resume goes through one function, `redistribute(saved, world_size, rank)`: every
saved rank's reducer `state_dict` in, this rank's out (or None: start from zero). The
optimizers' checkpoints, the DDP hook's units, `lbcomm.load_sharded` and the framework
integrations all call it.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from ..common import STATS_KEYS, compressor_stats  # noqa: F401 (re-exported)
from ..config import CommConfig, resolve
from .compression import CompressionState
from .hierarchical import HierarchicalState
from .topology import Topology

__all__ = ["Reducer", "make_reducer", "resolve_topology", "redistribute", "compressor_stats", "STATS_KEYS"]

_log = logging.getLogger("lbcomm.reducer")  # the 0.2 logger name, kept for users' logging settings


@runtime_checkable
class Reducer(Protocol):
    """A compressed mean over ranks with error feedback (see the module docs)."""

    numel: int
    world_size: int
    device: torch.device
    calls: int
    skipped: int
    last_skipped: bool

    def reduce_(self, source, sink, *, checked: bool = False, async_op: bool = False,
                weights: Optional[Tensor] = None, cap: Optional[Tensor] = None):
        """The approximate mean of `source` over the ranks into `sink` (tensors, or the
        range-by-range callables of `lbcomm.reduce.compressed.reduce_`), with optional
        per-coordinate bounds `cap` on the decoded values (the capped decode, see there).
        Returns True when the sink was written, False for a skipped non-finite call (or a
        Future of that bool)."""

    def bytes_per_call(self, checked: bool = False) -> int:
        """Bytes this rank sends per call."""

    def zero_errors_at(self, index: Tensor) -> None:
        """Hold the error feedback of the flat coordinates `index` at zero (exact parts)."""

    def reset(self) -> None:
        """Zero the error feedback."""

    def state_dict(self) -> Dict[str, Any]:
        """This rank's error feedback and the layout it belongs to."""

    def load_state_dict(self, sd: Dict[str, Any], *, all_ranks: Optional[Sequence[Dict[str, Any]]] = None) -> bool:
        """Restore a `state_dict`; True when the error feedback carries into this run, False
        (errors reset, warned) when it belongs to another layout. Saved with another world
        size (elastic resume): ``all_ranks``, every saved rank's state_dict in rank order,
        the same keyword every lbcomm compressor takes."""

    def compression_stats(self) -> Dict[str, Any]:
        """`compressor_stats` of this reducer, plus its own figures."""

    @classmethod
    def redistribute(cls, saved: Sequence[Dict[str, Any]], world_size: int, rank: int) -> Optional[Dict[str, Any]]:
        """The `state_dict` of `rank` in a world of `world_size` from every saved rank's one,
        or None when this kind of state cannot be mapped onto another world (start from zero)."""


def resolve_topology(comm: Optional[CommConfig] = None, *, world_size: Optional[int] = None,
                     who: str = "resolve_topology") -> Optional[Topology]:
    """The multi-node `lbcomm.Topology` that `comm.topology` asks for, or None
    (the flat reduction): a Topology itself (checked against `world_size`; a one-node one
    is flat), "flat" None, "auto" `Topology.auto()` (several nodes under torchrun). "auto"
    is flat on a subgroup (`process_group` or `shard_group` set), on MPI, on one rank and
    without an initialized torch.distributed.

    "auto" creates process groups: every rank of the world calls it, in the same order as
    its other collectives, and an owner (optimizer, hook state) calls it once and passes the
    result to every `make_reducer` call.

    Args:
        comm (CommConfig, optional): the settings (default: ``CommConfig()``).
        world_size (int, optional): the ranks the owner reduces over; a Topology of another
            size is refused.
        who (str): the owner's name, for the error messages.
    """
    comm = resolve(comm, who)
    spec = comm.topology
    if isinstance(spec, Topology):
        if world_size is not None and spec.world_size != world_size:
            raise ValueError(f"{who}: the topology spans {spec.world_size} ranks ({spec.nodes} nodes x "
                             f"{spec.local_size}) but the process group has {world_size}; pass a topology of "
                             "the ranks it averages over")
        topo = spec
    elif (spec == "flat" or comm.process_group is not None or comm.shard_group is not None
          or comm.backend == "mpi" or world_size == 1):
        return None
    else:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        topo = Topology.auto()
    return None if topo is None or topo.flat else topo


def make_reducer(numel: int, comm: Optional[CommConfig] = None, *, device=None, topology=None,
                 transport=None) -> Reducer:
    """The reducer of `numel`-element tensors that `comm` describes: the one factory the
    optimizers and hooks use.

    Args:
        numel (int): elements of the flat tensors it reduces.
        comm (CommConfig, optional): process group, backend, block size and non-finite
            policy (default: ``CommConfig()``).
        device (optional): where its buffers live (default: as `CompressionState`).
        topology (Topology, optional): a resolved topology (`resolve_topology(comm)`,
            called once by the owner): a multi-node one gives a `HierarchicalState` over
            it; None (or `comm.topology` set to "flat"/"auto") gives a `CompressionState`
            on ``comm.process_group`` and ``comm.backend`` (default: None). `comm.topology`
            itself is not resolved here, since "auto" creates process groups.
        transport (optional): the transport a flat reducer runs on, when its owner holds
            one already (a private duplicate group, a counting transport); its group then
            replaces ``comm.process_group`` (default: None, one for ``comm``).

    Returns:
        A `Reducer`: a `lbcomm.HierarchicalState` or a `lbcomm.CompressionState`.
    """
    comm = resolve(comm, "make_reducer")
    if topology is not None:
        if not isinstance(topology, Topology):
            raise TypeError(f"make_reducer: topology must be a resolved lbcomm.Topology or None, got "
                            f"{type(topology).__name__} (resolve comm.topology once with resolve_topology)")
        return HierarchicalState(numel, topology, device=device, block_size=comm.block_size,
                                 nonfinite=comm.nonfinite)
    group = comm.process_group if transport is None else getattr(transport, "group", comm.process_group)
    return CompressionState(numel, group=group, device=device, block_size=comm.block_size,
                            nonfinite=comm.nonfinite, backend=comm.backend, transport=transport)


def redistribute(saved: Sequence[Optional[Dict[str, Any]]], world_size: int, rank: int, *,
                 where: str = "the checkpoint") -> Optional[Dict[str, Any]]:
    """Elastic resume: the reducer `state_dict` of `rank` in a world of `world_size` from
    the reducer state_dicts of every saved rank (`saved`, in rank order), the one
    implementation behind every checkpoint path.

    Flat states (`CompressionState.state_dict`) are redistributed by
    `CompressionState.redistribute`, which preserves the total carried error. Returns
    None, and the caller starts the error feedback from zero, when there is nothing to
    carry: nothing saved (every entry None), one rank now (nothing is compressed), or
    hierarchical states (`HierarchicalState.redistribute`: their errors belong to one node
    shape); the last two are logged as warnings naming `where`.

    Raises:
        ValueError: some saved ranks hold a state and others not, or the states are not one
            complete world of one tensor size (the checkpoint is inconsistent).
    """
    if all(sd is None for sd in saved):
        return None
    missing = [r for r, sd in enumerate(saved) if sd is None]
    if missing:
        raise ValueError(f"lbcomm: rank(s) {missing} of {where} hold no compression state, unlike the others; the "
                         "checkpoint is inconsistent (load without elastic redistribution to reset the error "
                         "feedback)")
    if world_size == 1:
        _log.warning("lbcomm: %s was saved by %s ranks; with one rank nothing is compressed, so the saved error "
                     "feedback is dropped", where, len(saved))
        return None
    kind = HierarchicalState if "layout" in saved[0] else CompressionState
    out = kind.redistribute(saved, world_size, rank)
    if out is None:
        _log.warning("lbcomm: %s was saved by %s ranks with a hierarchical reduction; its error feedback is not "
                     "redistributed onto %s ranks and starts from zero", where, len(saved), world_size)
    else:
        _log.info("lbcomm: %s was saved by %s ranks and this run has %s; the compression error feedback of all saved "
                  "ranks was redistributed onto this world (its total is preserved)", where, len(saved), world_size)
    return out
