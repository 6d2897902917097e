"""Small tensors averaged exactly beside a compressed call (``CommConfig.exact_numel``).

1-bit compression saves little on small tensors (biases, norm weights) and costs the most
accuracy there, so the tensors of at most ``exact_numel`` elements are averaged exactly in
fp32 while the rest of the flat input is compressed; their error feedback is held at zero.
Two pieces, used by the DDP and FSDP2 hooks and the 1-bit optimizers:

* `exact_members` / `exact_index`: which tensors, and their flat coordinates in a
  concatenation of tensors;
* `ExactMean`: their exact mean over the ranks, started beside the compressed call, through
  a transport (flat) or a multi-node `Topology` (`hierarchical_mean_`: 1/G of a flat
  allreduce's bytes between nodes), and the bytes it sends.

(`lbcomm.optim.exact.ExactPart` is the optimizers' use of these pieces.)

Example::

    >>> index = exact_index([4096 * 1024, 1024], limit=4096)   # the second tensor only
    >>> mean = ExactMean(transport=lbcomm.comm.get_transport(group, backend="torch"))
    >>> exact = flat.index_select(0, index).float()
    >>> wait = mean.start(exact)                                # in flight beside the compressed call
    >>> ...
    >>> flat.index_copy_(0, index, wait())
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor

from ..common import ring_allreduce_bytes
from .hierarchical import hierarchical_mean_
from .wire import chunk_size

__all__ = ["exact_members", "exact_index", "ExactMean"]


def exact_members(numels: Sequence[int], limit: int, whole: Optional[Sequence[int]] = None) -> List[int]:
    """The positions k of the non-empty tensors averaged exactly: ``0 < whole[k] <= limit``
    (`whole` defaults to `numels`; FSDP2 shards are decided by their whole parameter)."""
    if not limit:
        return []
    return [k for k, n in enumerate(numels) if n and 0 < (n if whole is None else whole[k]) <= limit]


def exact_index(numels: Sequence[int], limit: int, *, offsets: Optional[Sequence[int]] = None,
                whole: Optional[Sequence[int]] = None, device=None) -> Optional[Tensor]:
    """The flat coordinates (int64, ascending) of the tensors of at most `limit` elements
    in a concatenation of tensors of `numels` elements; None when there are none (or
    `limit` is 0).

    Args:
        numels: the elements of each tensor, in order.
        limit (int): exact_numel.
        offsets (optional): each tensor's first coordinate (default: the running sum of
            `numels`; a padded flat layout passes its own).
        whole (optional): per tensor, the numel that decides (the whole parameter a shard
            belongs to, for FSDP2; default: the tensor's own).
        device (optional): where the index lives (default: the CPU).
    """
    if offsets is None:
        offsets = [0]
        for n in numels[:-1]:
            offsets.append(offsets[-1] + n)
    # built where it lives: a copy from host memory would synchronize a CUDA stream
    spans = [torch.arange(offsets[k], offsets[k] + numels[k], device=device)
             for k in exact_members(numels, limit, whole)]
    return torch.cat(spans) if spans else None


class ExactMean:
    """The exact fp32 mean over the ranks of a few coordinates, beside a compressed call.

    Args:
        transport: the `lbcomm.comm` transport of the compressed call's group (a flat
            reduction): one fp32 allreduce, in flight during the compressed call.
        topology (Topology, optional): a multi-node topology (the hierarchical reduction):
            `hierarchical_mean_`, which runs before the compressed call returns.
    """

    __slots__ = ("transport", "topology")

    def __init__(self, transport=None, topology=None):
        if (transport is None) == (topology is None):
            raise ValueError("ExactMean: pass a transport (flat) or a multi-node topology, not both")
        self.transport, self.topology = transport, topology

    def start(self, values: Tensor) -> Callable[[], Tensor]:
        """Start the mean of the 1-D fp32 `values` in place; the returned function waits for
        it and returns `values` (call it also when the compressed call fails, so that no
        collective is left in flight)."""
        if self.topology is not None:
            hierarchical_mean_(values, self.topology)
            return lambda: values
        work = self.transport.all_reduce(values, "mean", async_op=True)

        def wait() -> Tensor:
            work.wait()
            return values

        return wait

    def bytes(self, numel: int) -> int:
        """Bytes a rank sends to average `numel` fp32 elements: a ring allreduce over the
        transport's ranks, or `hierarchical_mean_`'s bytes between nodes."""
        if not numel:
            return 0
        if self.topology is not None:
            t = self.topology
            return int(ring_allreduce_bytes(4 * chunk_size(numel, t.local_size), t.nodes))
        return int(ring_allreduce_bytes(4 * numel, self.transport.world_size))

