"""HSDP with 1 bit across nodes: FSDP2 shards inside a node, and the gradient shards are
averaged across nodes by the 1-bit error-feedback compressed allreduce (DESIGN.md §4b).

Layout: a 2-D DeviceMesh with a replicate dimension (the nodes, default "node") and a shard
dimension (the ranks of a node, default "local"). The model is sharded with FSDP2 over the
SHARD dimension only (``fully_shard(module, mesh=mesh["local"])``), so FSDP's own
collectives (all-gather of parameters, reduce-scatter of gradients) stay inside the node
in full precision. `onebit_hsdp` then sets an all-reduce hook on every FSDP module
(``FSDPModule.set_all_reduce_hook``): FSDP calls it with the reduce-scatter output of that
module's parameter group (this rank's gradient shard, the same shard on every node) and the
hook replaces it in place by its 1-bit compressed mean over the replicate group, one
`CompressionState` (error feedback) per FSDP parameter group. FSDP applies its own
post-division afterwards; the mean is linear, so the result is the gradient mean over all
ranks up to the compression error, which error feedback carries into the next step.

Why not FSDP's native HSDP (a 2-D mesh given to fully_shard): it all-reduces across the
replicate dimension in full precision before any hook runs, and switching that off
(``set_requires_all_reduce(False)``) makes FSDP accumulate the unreduced shard instead of
producing a gradient. `onebit_hsdp` refuses modules sharded on a 2-D mesh for that reason.

The result is bitwise identical on the ranks of a replicate group (the compressed call's
guarantee) and the shards of a node are reduced by FSDP identically on every node, so
replicas stay identical. Any optimizer works on the sharded parameters.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from .common import NONFINITE_POLICIES
from .compressed import DEFAULT_BLOCK_SIZE, CompressionState, compressed_allreduce_
from .wire import check_block_size

__all__ = ["OneBitHSDPState", "onebit_hsdp"]

_log = logging.getLogger(__name__)


class OneBitHSDPState:
    """Error feedback of `onebit_hsdp`: one CompressionState per FSDP parameter group
    (made at its first hook call), the iteration count and statistics.

    Args:
        replicate_group (ProcessGroup): the ranks that hold the same shard, one per node.
        start_iter (int, optional): hook calls of each parameter group averaged at full
            precision before compression starts (default: 0).
        block_size (int or None, optional): as `CompressionState` (default: 2048).
        nonfinite (str, optional): "skip" (the shard becomes NaN on every rank, as a plain
            allreduce would, so that a GradScaler skips the step; error feedback untouched)
            or "raise" (default: "skip").
    """

    __slots__ = ("replicate_group", "start_iter", "block_size", "nonfinite", "states", "calls", "bytes_sent",
                 "skipped_calls")

    def __init__(self, replicate_group, start_iter: int = 0, block_size: Optional[int] = DEFAULT_BLOCK_SIZE, *,
                 nonfinite: str = "skip"):
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"Invalid start_iter: {start_iter!r} (must be an int >= 0)")
        check_block_size(block_size)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid nonfinite policy: {nonfinite!r} (use one of {NONFINITE_POLICIES})")
        self.replicate_group, self.start_iter, self.block_size = replicate_group, start_iter, block_size
        self.nonfinite = nonfinite
        self.states: Dict[str, CompressionState] = {}
        self.calls: Dict[str, int] = {}
        self.bytes_sent = 0
        self.skipped_calls = 0

    def state_dict(self) -> Dict[str, Any]:
        """This rank's error feedback per parameter group (one shard per rank)."""
        return {"calls": dict(self.calls), "states": {k: st.state_dict() for k, st in self.states.items()},
                "bytes_sent": self.bytes_sent, "skipped_calls": self.skipped_calls}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore a `state_dict` of this rank (before the next backward pass); error
        feedback saved for another replicate-group size is reset with a logged warning."""
        self.calls = dict(sd["calls"])
        self.bytes_sent, self.skipped_calls = int(sd.get("bytes_sent", 0)), int(sd.get("skipped_calls", 0))
        for key, saved in sd["states"].items():
            st = self.states.get(key)
            if st is None:
                st = self.states[key] = CompressionState(int(saved["numel"]), group=self.replicate_group,
                                                         block_size=self.block_size, nonfinite=self.nonfinite,
                                                         backend="torch")
            st.load_state_dict(saved)


def _hook(state: OneBitHSDPState, key: str, reduce_output: Tensor) -> None:
    """FSDP's all-reduce hook for parameter group `key`: in place, the mean of this shard
    over the replicate group (full precision for the first start_iter calls)."""
    import torch.distributed as dist

    calls = state.calls.get(key, 0)
    state.calls[key] = calls + 1
    if calls < state.start_iter:
        dist.all_reduce(reduce_output, group=state.replicate_group)
        reduce_output.div_(dist.get_world_size(state.replicate_group))
        return
    st = state.states.get(key)
    if st is None or st.numel != reduce_output.numel():
        st = state.states[key] = CompressionState(reduce_output.numel(), group=state.replicate_group,
                                                  device=reduce_output.device, block_size=state.block_size,
                                                  nonfinite=state.nonfinite, backend="torch")
    compressed_allreduce_(reduce_output, st)
    state.bytes_sent += st.bytes_per_call()
    if st.last_skipped:
        state.skipped_calls += 1
        reduce_output.fill_(float("nan"))
        _log.warning("onebit_hsdp: a gradient shard of %s held NaN or Inf on some rank; it is NaN on every rank and "
                     "the error feedback is unchanged", key)


def onebit_hsdp(model: torch.nn.Module, mesh, *, replicate_dim: str = "node", shard_dim: str = "local",
                state: Optional[OneBitHSDPState] = None, **kwargs) -> OneBitHSDPState:
    """Set the 1-bit all-reduce hook on every FSDP module of `model` (already sharded with
    ``fully_shard(..., mesh=mesh[shard_dim])``); returns the state (error feedback).

    Args:
        model (nn.Module): the model, its FSDP modules sharded over `shard_dim` only.
        mesh (DeviceMesh): 2-D, dimensions (replicate_dim, shard_dim).
        state (OneBitHSDPState, optional): an existing state; else one is made with
            ``kwargs`` (start_iter, block_size, nonfinite) on ``mesh.get_group(replicate_dim)``.

    Example::

        >>> mesh = init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("node", "local"))
        >>> for block in model.blocks:
        ...     fully_shard(block, mesh=mesh["local"])
        >>> fully_shard(model, mesh=mesh["local"])
        >>> hsdp = lbcomm.fsdp.onebit_hsdp(model, mesh)
    """
    from torch.distributed.fsdp import FSDPModule

    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh.ndim != 2 or replicate_dim not in names or shard_dim not in names:
        raise ValueError(f"onebit_hsdp: expected a 2-D DeviceMesh with dimensions ({replicate_dim!r}, {shard_dim!r}), "
                         f"got {mesh.ndim} dimension(s) named {names}")
    if state is None:
        state = OneBitHSDPState(mesh.get_group(replicate_dim), **kwargs)
    elif kwargs:
        raise ValueError(f"onebit_hsdp: pass either state= or settings, not both (got {sorted(kwargs)})")
    found: List[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        for p in module.parameters():
            pm = getattr(p, "device_mesh", None)
            if pm is not None and pm.ndim != 1:
                raise ValueError(f"onebit_hsdp: module {name or '<root>'} is sharded on a {pm.ndim}-D mesh (FSDP's "
                                 "native HSDP all-reduces across nodes in full precision itself); shard it with "
                                 f"fully_shard(module, mesh=mesh[{shard_dim!r}]) and let onebit_hsdp reduce across "
                                 "nodes")
        module.set_all_reduce_hook(functools.partial(_hook, state, name or "<root>"))
        found.append(name or "<root>")
    if not found:
        raise ValueError("onebit_hsdp: the model has no FSDP module; call fully_shard(module, mesh=mesh[shard_dim]) "
                         "first")
    _log.info("onebit_hsdp: 1-bit all-reduce hook on %s FSDP module(s) across %s ranks per shard", len(found),
              mesh.size(list(names).index(replicate_dim)))
    return state
