"""exact_numel for the 1-bit optimizers' momentum: the parameters of at most that many
elements (whole parameters, also when sharded) take their new momentum from the gradients
averaged exactly, instead of from the compressed call.

The gradients are summed in fp32 by the finiteness agreement's allreduce over the ranks the
momentum is reduced over (flat reduction: no collective is added), or on nodes of several
ranks by `hierarchical_mean_` (1/G of the bytes between nodes) — the one topology-specific
piece of the 1-bit stage (`ExactPart.mean`). The compressed call still carries these
coordinates; its result there is replaced and their errors are zeroed after every call
(`OneBitStage.reduce_momentum`), so they never enter the error feedback.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..exact import ExactMean, exact_index, exact_members
from .flat import FlatLayout

__all__ = ["ExactPart"]


class ExactPart:
    """The exactly averaged parameters of a `OneBitStage` (limit: exact_numel; 0: none)."""

    def __init__(self, stage, limit: int):
        self.stage = stage
        self.limit = int(limit)
        self.fused_sum: Optional[Tensor] = None  # the exact gradients' sum from grads_finite's allreduce
        self._part: Optional[tuple] = None  # (index, places): `part`
        self._weights: Optional[tuple] = None  # (key, 1 - b1 per coordinate): `mean`

    def reset(self) -> None:
        """The layout changed."""
        self._part = None

    def part(self, L: FlatLayout):
        """(index, places) of the parameters of at most `limit` elements: their flat
        coordinates (int64, ascending) and (parameter, its first element in index) pairs;
        None without such parameters."""
        if self._part is None:  # decided by the whole parameter, also when sharded
            whole = [q.numel() for q in L.params]
            members = exact_members(L.numels, self.limit, whole)
            starts = [0]
            for i in members:
                starts.append(starts[-1] + L.numels[i])
            index = exact_index(L.numels, self.limit, offsets=L.offsets, whole=whole,
                                device=self.stage.fs.device_of(L))
            self._part = (index, list(zip(members, starts)))
        return None if self._part[0] is None else self._part

    def grads(self, L: FlatLayout, places, out: Optional[Tensor] = None) -> Tensor:
        """The local gradients of the exact parameters, concatenated in fp32 (into `out`)."""
        dev = self.stage.fs.device_of(L)
        parts = [torch.zeros(L.numels[i], dtype=torch.float32, device=dev) if L.grad(i) is None
                 else L.grad(i).reshape(-1) for i, _ in places]
        if out is None:
            return torch.cat(parts).to(torch.float32)
        if all(t.dtype == torch.float32 for t in parts):
            return torch.cat(parts, out=out)
        return out.copy_(torch.cat(parts))

    def mean(self, L: FlatLayout, source):
        """The new momentum of the exact parameters from their gradients averaged exactly
        (m is the same on every rank, so this is the exact mean of the ranks' new momenta):
        (index, places, values), values scaled like the source's; None without exact
        parameters; False (on every rank alike) when the mean gradient is not finite."""
        part = self.part(L)
        fused, self.fused_sum = self.fused_sum, None
        if part is None:
            return None
        index, places = part
        if getattr(source, "momentum", None) is None:
            return self._mean_of_source(L, source, index, places)
        m, weights, scale = source.momentum
        dev, n = index.device, index.numel()
        if fused is not None:  # summed by grads_finite's allreduce
            g = fused.div_(self.stage.fs.transport.world_size)
        else:  # on nodes of several ranks hierarchical_mean_: 1/G of the bytes between nodes
            g = self.exact_mean().start(self.grads(L, places))()
        if not bool(torch.isfinite(g).all()):
            return False
        # in place, one op each for all exact parameters: the mean gradient becomes the new momentum
        ids = [i for i, _ in places]
        key = tuple((i, weights[i]) for i in ids)
        if self._weights is None or self._weights[0] != key:
            w = torch.tensor([weights[i] for i in ids], dtype=torch.float32)
            self._weights = (key, w.repeat_interleave(torch.tensor([L.numels[i] for i in ids])).to(dev))
        torch.lerp(m.index_select(0, index), g, self._weights[1], out=g)
        if scale is not None:
            counts = torch.tensor([L.numels[i] for i in ids], device=scale.device)
            g.mul_(scale[torch.tensor(ids, device=scale.device)].repeat_interleave(counts, output_size=n))
        return index, places, g

    def _mean_of_source(self, L: FlatLayout, source, index: Tensor, places):
        """`mean` for a source that is not b1 m + (1-b1) g of a momentum equal on every rank
        (ZeroOneAdam's synchronization, whose input follows each rank's own local steps):
        its values at the exact coordinates, averaged with one allreduce of their own."""
        values = torch.empty(index.numel(), dtype=torch.float32, device=index.device)
        for i, o in places:
            source(L.offsets[i], L.offsets[i] + L.numels[i], values[o:o + L.numels[i]])
        g = self.exact_mean().start(values)()
        if not bool(torch.isfinite(g).all()):
            return False
        return index, places, g

    def exact_mean(self) -> ExactMean:
        """How the exact gradients are averaged when the agreement did not sum them."""
        topology = self.stage.topology
        return ExactMean(topology=topology) if topology is not None else ExactMean(transport=self.stage.fs.transport)

    @staticmethod
    def put(L: FlatLayout, values: Tensor, lo: int, hi: int, exact) -> Tensor:
        """values (the decoded [lo, hi)) with the exact parameters' coordinates from `mean`'s result."""
        _, places, mean = exact
        for i, o in places:
            a, b = L.offsets[i], L.offsets[i] + L.numels[i]
            x, y = max(a, lo), min(b, hi)
            if x < y:
                values[x - lo:y - lo].copy_(mean[o + x - a:o + y - a])
        return values
