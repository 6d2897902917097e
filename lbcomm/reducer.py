"""The `Reducer` protocol: what every compressed reduction of lbcomm offers.

A reducer holds the error feedback of compressed allreduces of one flat size on one set of
ranks and reduces with one call, ``reducer.reduce_(source, sink, *, checked, async_op,
weights)``. Its implementations:

* `lbcomm.CompressionState`: the flat 1-bit allreduce over one process group;
* `lbcomm.topology.HierarchicalState`: full precision inside each node, 1-bit between nodes;

and the FSDP2/HSDP hook compresses each shard with a flat reducer over its replicate group.
Optimizers and hooks build one with `make_reducer(numel, comm, device=...)` and never
branch on its type.

Every reducer owns: the agreement over the ranks that every input is finite (``checked``
says the caller has done it), its `state_dict` / `load_state_dict` (one shard per rank),
`redistribute` (the saved shards of every rank of another world size onto this one,
elastic resume), `compression_stats` and `bytes_per_call`.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

__all__ = ["Reducer"]


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
                weights: Optional[Tensor] = None):
        """The approximate mean of `source` over the ranks into `sink` (tensors, or the
        range-by-range callables of `lbcomm.compressed.reduce_`). Returns True when the
        sink was written, False for a skipped non-finite call (or a Future of that bool)."""

    def bytes_per_call(self, checked: bool = False) -> int:
        """Bytes this rank sends per call."""

    def zero_errors_at(self, index: Tensor) -> None:
        """Hold the error feedback of the flat coordinates `index` at zero (exact parts)."""

    def reset(self) -> None:
        """Zero the error feedback."""

    def state_dict(self) -> Dict[str, Any]:
        """This rank's error feedback and the layout it belongs to."""

    def load_state_dict(self, sd: Dict[str, Any]) -> bool:
        """Restore a `state_dict`; False (errors reset, warned) when it belongs to another layout."""

    def compression_stats(self) -> Dict[str, Any]:
        """Calls, skipped calls and bytes sent so far, as plain numbers."""

    @classmethod
    def redistribute(cls, saved: Sequence[Dict[str, Any]], world_size: int, rank: int) -> Dict[str, Any]:
        """The `state_dict` of `rank` in a world of `world_size` from every saved rank's one."""
