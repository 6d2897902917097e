"""The momentum mask of the 1-bit optimizers: coordinates whose momentum is held at zero
after the freeze (`MomentumMask`, held by `OneBitStage`).

At the freeze (and, for ZeroOneAdam, after every variance update) the coordinates whose
variance is zero, or at most ``mask_threshold`` (`lbcomm.OneBitOptions`) times the mean variance, are masked:
they never saw a gradient, or only rounding noise (e.g. attention key biases, to which
softmax is invariant), and would move by (compression noise) / eps. User masks
(`set_momentum_mask`) override it per parameter. The mask is kept as an index list when few
coordinates are masked (the usual case: unused embedding rows, constant features), a bool
mask otherwise.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from .flat import FlatLayout

__all__ = ["MomentumMask"]


class MomentumMask:
    """The mask over the flat momentum of the flat state `fs` (a `FlatState`); coordinates
    whose variance is at most `threshold` times the mean are masked (`build`)."""

    def __init__(self, fs, threshold: float):
        self.fs = fs
        self.threshold = threshold
        self.mask: Optional[Tensor] = None  # int64 indices (few masked) or bool (many): True/listed = held at zero
        self.counts = (0, 0)  # (variance exactly zero, at most the threshold) at the last build
        self.user: Dict[int, Tensor] = {}  # layout index -> bool mask (True = trained)

    @property
    def count(self) -> int:
        """How many coordinates are held at zero."""
        m = self.mask
        return 0 if m is None else int(m.sum()) if m.dtype == torch.bool else m.numel()

    def on_layout(self, old: Optional[FlatLayout], new: FlatLayout) -> None:
        if old is not None:
            self.user = {new.index[id(old.params[j])]: m for j, m in self.user.items() if id(old.params[j]) in new.index}

    def set_user(self, L: FlatLayout, param: Tensor, mask: Optional[Tensor], rebuild: bool) -> None:
        """A user mask for one parameter of the layout `L` (None: back to the automatic one); `rebuild` now."""
        i = L.index.get(id(param))
        if i is None:
            raise ValueError("set_momentum_mask: the tensor is not a parameter of this optimizer that requires grad")
        if mask is None:
            self.user.pop(i, None)
        else:
            if not isinstance(mask, Tensor) or mask.shape != L.shapes[i]:
                raise ValueError(f"set_momentum_mask: expected a bool tensor of shape {tuple(L.shapes[i])} (for a "
                                 f"sharded parameter: its local shard's), got "
                                 f"{getattr(mask, 'shape', type(mask).__name__)}")
            self.user[i] = mask.detach().to(device=param.device, dtype=torch.bool).clone()
        if rebuild:
            self.build(L)

    def build(self, L: FlatLayout) -> None:
        """The mask from the variance as it is now (see the module docs)."""
        fs = self.fs
        v = fs.buffers["exp_avg_sq"]
        if fs.sharded():  # the mean variance of the whole model, over the shards
            total = torch.stack([v.sum(dtype=torch.float32), torch.tensor(float(v.numel()), device=v.device)])
            fs.shard_transport.all_reduce(total, op="sum")
            thr = self.threshold * float(total[0] / total[1]) if float(total[1]) else 0.0
        else:
            thr = self.threshold * float(v.mean()) if v.numel() else 0.0
        zero = v <= thr
        self.counts = (int((v == 0).sum()), int(zero.sum()))
        for i, mask in self.user.items():
            L.view(zero, i).copy_(~mask)
        self._set(zero)

    def _set(self, zero: Optional[Tensor]) -> None:
        """Keep a bool mask (True = held at zero) compactly: the index list when it is at
        most 1/16 of the coordinates (smaller, and index_fill_ is then faster)."""
        count = 0 if zero is None else int(zero.sum())
        if count == 0:
            self.mask = None
        elif count * 16 < zero.numel():
            self.mask = zero.nonzero().view(-1)
        else:
            self.mask = zero

    def apply(self, values: Tensor, lo: int, hi: int) -> None:
        """Zero the masked coordinates of elements [lo, hi) held in `values`."""
        self._fill(values, lo, hi, 0.0)

    def mark(self, out: Tensor, lo: int, hi: int) -> None:
        """Set `out` (bool, elements [lo, hi)) True at the masked coordinates."""
        self._fill(out, lo, hi, True)

    def _fill(self, values: Tensor, lo: int, hi: int, value) -> None:
        """values[j] = value at the masked coordinates of elements [lo, hi), either form of the mask."""
        mask = self.mask
        if mask is None:
            return
        if mask.dtype == torch.bool:
            values.masked_fill_(mask[lo:hi], value)
            return
        if lo == 0 and hi >= self.fs.layout.total:
            values.index_fill_(0, mask, value)
            return
        a, b = (int(x) for x in torch.searchsorted(mask, torch.tensor([lo, hi], device=mask.device)))
        if b > a:
            values.index_fill_(0, mask[a:b] - lo, value)

    def load(self, L: FlatLayout, mask: Optional[Tensor], user: Dict) -> None:
        """Restore a saved mask and user masks onto the layout's device."""
        self.user = {int(i): m.to(device=L.params[int(i)].device, dtype=torch.bool).clone() for i, m in user.items()}
        if mask is not None:
            self.mask = mask.to(device=self.fs.device_of(L),
                                dtype=torch.bool if mask.dtype == torch.bool else torch.int64).clone()
