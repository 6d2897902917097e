"""The flat layout of the optimizers' state: every parameter's state is one
slice of a flat fp32 buffer, the parameters of one param group next to each other, so
that one collective serves the whole model.

`FlatLayout` says where each parameter's slice lies (for a DTensor parameter of a model
sharded with FSDP2, the slice of this rank's local shard: the optimizers work on
``p.to_local()`` and ``p.grad.to_local()``, see `lbcomm.fsdp.onebit_optimizer`); `Segment` is a run of consecutive
parameters of one group whose step counts are equal (their bias corrections are then
scalars, so the update math runs once per run instead of once per parameter).
"""
from __future__ import annotations

import bisect
from typing import Iterator, List, Optional, Sequence, Tuple

from torch import Tensor

__all__ = ["FlatLayout", "Segment", "segments", "local_tensor"]


def local_tensor(t: Optional[Tensor]) -> Optional[Tensor]:
    """This rank's shard of a DTensor (the tensor itself otherwise). Under no_grad, as in an
    optimizer step, ``to_local()`` returns the DTensor's own local tensor: writing into it
    writes the parameter."""
    if t is not None and hasattr(t, "to_local") and hasattr(t, "device_mesh"):
        return t.to_local()
    return t


class FlatLayout:
    """Where each parameter's slice lies in the flat buffers (groups are contiguous).

    Args:
        params (list of Tensor): the parameters, in buffer order.
        group_of (list of int): the param group of each parameter.
    """

    def __init__(self, params: List[Tensor], group_of: List[int]):
        self.params = params
        self.group_of = group_of
        self.sharded = any(hasattr(p, "device_mesh") for p in params)
        self.shapes = [local_tensor(p).shape for p in params]
        self.numels = [local_tensor(p).numel() for p in params]
        self.offsets = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.total = total
        self.index = {id(p): i for i, p in enumerate(params)}
        # (group, first param, end param, first element, end element) per group present
        self.group_ranges = []
        for i, gi in enumerate(group_of):
            if self.group_ranges and self.group_ranges[-1][0] == gi:
                g, a, _, lo, _ = self.group_ranges[-1]
                self.group_ranges[-1] = (g, a, i + 1, lo, self.offsets[i] + self.numels[i])
            else:
                self.group_ranges.append((gi, i, i + 1, self.offsets[i], self.offsets[i] + self.numels[i]))

    def view(self, flat: Tensor, i: int) -> Tensor:
        """Parameter i's slice of `flat`, in the parameter's shape."""
        o = self.offsets[i]
        return flat[o:o + self.numels[i]].view(self.shapes[i])

    def tensor(self, i: int) -> Tensor:
        """Parameter i as the optimizer updates it: its local shard for a DTensor."""
        return local_tensor(self.params[i])

    def grad(self, i: int) -> Optional[Tensor]:
        """Parameter i's gradient (its local shard for a DTensor), or None."""
        return local_tensor(self.params[i].grad)

    def overlapping(self, lo: int, hi: int) -> Iterator[Tuple[int, int, int]]:
        """(parameter, first, end) for every parameter with elements in [lo, hi): the part
        of it inside the range, as offsets into the parameter's own flat elements."""
        i = max(0, bisect.bisect_right(self.offsets, lo) - 1)
        while i < len(self.params) and self.offsets[i] < hi:
            o = self.offsets[i]
            a, b = max(lo, o) - o, min(hi, o + self.numels[i]) - o
            if b > a:
                yield i, a, b
            i += 1


class Segment:
    """A run of consecutive parameters of one group that share their step counts."""

    __slots__ = ("group", "idx", "lo", "hi", "step", "vstep")

    def __init__(self, group: int, i: int, lo: int, hi: int, step: float, vstep: float):
        self.group, self.idx, self.lo, self.hi, self.step, self.vstep = group, [i], lo, hi, step, vstep


def segments(layout: FlatLayout, include: Sequence[bool], steps: Sequence[float],
             vsteps: Sequence[float]) -> List[Segment]:
    """Cut the included parameters into runs of one group with equal (step, variance step)."""
    segs: List[Segment] = []
    for i, on in enumerate(include):
        if not on:
            continue
        lo, hi = layout.offsets[i], layout.offsets[i] + layout.numels[i]
        last = segs[-1] if segs else None
        if (last is not None and last.idx[-1] == i - 1 and last.group == layout.group_of[i]
                and last.step == steps[i] and last.vstep == vsteps[i]):
            last.idx.append(i)
            last.hi = hi
        else:
            segs.append(Segment(layout.group_of[i], i, lo, hi, steps[i], vsteps[i]))
    return segs
