"""`FlatState`: the flat state of an lbcomm optimizer as an object of its own.

What the pieces of an optimizer (the 1-bit stage, the mask, the variance rescale, the
exact part, the checkpoint code in `state`, ZeroOneAdam's local steps, the agreement in
`agree`, the warmup updates) need from it, behind public attributes and methods:

* ``layout`` (`FlatLayout`, None before the first step) and ``stale`` (a parameter started
  requiring grad: rebuild before the next step);
* ``buffers``: the flat fp32 buffers by name (``exp_avg``, ``exp_avg_sq``, ...), one slice
  per parameter; ``vectors``: the fp32 per-parameter vectors (``step``, ...);
* ``grad_buf``: the warmup's flat gradient buffer (None when dead);
* ``device``, ``param_groups`` (the optimizer's, read when asked), ``option(name)``,
  ``global_step``, ``name`` (the optimizer's class name, for messages), ``comm``;
* communication: ``transport`` (the optimizer's), ``shard_transport``, ``sharded()``,
  ``over_shards(ok)``, ``per_tensor(...)`` (see `agree`), the averaged-gradients probe
  (``detecting()``, ``check_replicas(...)``);
* ``local_stat``: the component whose per-step values ride in the step's one small
  collective (rescale_variance's `VarianceRescale`, or None), used through
  ``local_slots`` / ``fill_local_slots`` / ``reduced_local_slots``;
* per-segment math every update shares: ``segments``, ``bias_corrections``, ``moments``.

The optimizer owns one (``optimizer.flat_state``) and builds its layout through `state`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from ..comm import get_transport
from ..config import CommConfig
from . import agree
from . import functional as F
from .flat import FlatLayout, Segment, segments

__all__ = ["FlatState", "bias_corrections"]


def bias_corrections(group: Dict[str, Any], seg: Segment):
    """(1 - b1^step, 1 - b2^vstep) of a segment, (1, 1) without bias correction."""
    if not group.get("bias_correction", True):
        return 1.0, 1.0
    b1, b2 = group["betas"]
    return 1 - b1 ** seg.step, 1 - b2 ** seg.vstep


class FlatState:
    """The flat state of one optimizer (see the module docs).

    Args:
        name (str): the optimizer's class name (messages).
        comm (lbcomm.CommConfig): the optimizer's communication settings.
        groups (callable): returns the optimizer's current param groups (torch replaces the
            list on load_state_dict, so it is read when asked).
        defaults (dict): the optimizer's defaults (`option` before any group exists).
        transport (callable): returns the optimizer's transport of ``comm.process_group``.
        vector_defaults (dict): the per-parameter vectors and their initial values.
        buffer_names (callable): the flat buffers the state holds now.
        probes_averaged_grads (bool): whether the averaged-gradients probe runs.
        buffer_dtypes (dict, optional): the buffers kept in another dtype than fp32, by name.
    """

    def __init__(self, name: str, comm: CommConfig, groups: Callable[[], List[Dict[str, Any]]],
                 defaults: Dict[str, Any], transport: Callable[[], Any], vector_defaults: Dict[str, float],
                 buffer_names: Callable[[], tuple], probes_averaged_grads: bool = True,
                 buffer_dtypes: Optional[Dict[str, torch.dtype]] = None):
        self.name = name
        self.buffer_dtypes = dict(buffer_dtypes or {})
        self.comm = comm
        self.defaults = defaults
        self.vector_defaults = vector_defaults
        self.buffer_names = buffer_names
        self.probes_averaged_grads = probes_averaged_grads
        self.layout: Optional[FlatLayout] = None
        self.stale = False
        self.buffers: Dict[str, Tensor] = {}
        self.vectors: Dict[str, Tensor] = {}
        self.grad_buf: Optional[Tensor] = None
        self.global_step = 0
        self.local_stat = None
        # called with (old layout or None, new layout) after every rebuild (`state.build_layout`)
        self.layout_listeners: List[Callable[[Optional[FlatLayout], FlatLayout], None]] = []
        self._groups = groups
        self._transport = transport
        self._shard_transport = None

    def new_buffer(self, name: str, L: FlatLayout) -> Tensor:
        """A zero flat buffer `name` of layout L, in its dtype (fp32 unless `buffer_dtypes` says)."""
        return torch.zeros(L.total, dtype=self.buffer_dtypes.get(name, torch.float32), device=self.device_of(L))

    # ------------------------------------------------------------------ the optimizer's options
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self._groups()

    def option(self, name: str) -> Any:
        """A global hyperparameter: every group holds the same value."""
        groups = self.param_groups
        return groups[0][name] if groups else self.defaults[name]

    @property
    def device(self) -> torch.device:
        """Where the state lives: the device of the layout's parameters (cpu without any)."""
        return self.device_of(self.layout)

    @staticmethod
    def device_of(L: Optional[FlatLayout]) -> torch.device:
        return L.params[0].device if L is not None and L.params else torch.device("cpu")

    # ------------------------------------------------------------------ communication
    @property
    def transport(self):
        return self._transport()

    @property
    def shard_transport(self):
        """The transport of ``comm.shard_group`` (None when the parameters are not sharded)."""
        if self.comm.shard_group is not None and self._shard_transport is None:
            self._shard_transport = get_transport(self.comm.shard_group, backend=self.comm.backend)
        return self._shard_transport

    def sharded(self) -> bool:
        tr = self.shard_transport
        return tr is not None and tr.world_size > 1

    def over_shards(self, ok: bool) -> bool:
        return agree.over_shards(self, ok)

    def per_tensor(self, L: FlatLayout, local: Tensor, op: str = "sum", full: bool = False):
        return agree.per_tensor(self, L, local, op, full)

    def param_indices(self) -> Dict[int, int]:
        """id(param) -> its index in torch's state_dict numbering."""
        mapping: Dict[int, int] = {}
        start = 0
        for g in self.param_groups:
            for i, p in enumerate(g["params"], start):
                mapping.setdefault(id(p), i)
            start += len(g["params"])
        return mapping

    def detecting(self) -> bool:
        """Whether this optimizer checks for gradients that arrive averaged already."""
        return self.probes_averaged_grads and self.comm.detect_averaged_grads and self.transport.world_size > 1

    def check_replicas(self, slots: Tensor, stage: str) -> bool:
        """Raise `AveragedGradientsError` when the reduced replica slots say that every rank
        holds the same gradients; return whether the check was decided."""
        same = agree.replicas_identical(slots)
        if same:
            raise agree.averaged_grads_error(self.name, self.global_step + 1, self.transport.world_size, stage)
        return same is not None

    # ------------------------------------------------------------------ values riding along (local_stat)
    def local_slots(self, L: FlatLayout) -> int:
        """How many per-step values of `local_stat` ride in the step's collective."""
        return 0 if self.local_stat is None else self.local_stat.slots(L)

    def fill_local_slots(self, L: FlatLayout, buf: Optional[Tensor], out: Tensor) -> None:
        """This rank's values into `out` (buf: the local flat gradients, None: each .grad)."""
        if self.local_stat is not None:
            self.local_stat.fill(L, buf, out)

    def reduced_local_slots(self, L: FlatLayout, slots: Tensor, averaged: bool = False) -> None:
        """The values after the collective (`averaged`: the gradients arrived averaged)."""
        if self.local_stat is not None:
            self.local_stat.reduced(L, slots, averaged)

    # ------------------------------------------------------------------ per-segment math
    def segments(self, L: FlatLayout, include: Sequence[bool], vstep: Optional[str] = None) -> List[Segment]:
        """Advance the step count of the included parameters and cut them into runs of one
        group with equal step counts (the bias corrections are then scalars per run); the
        variance's step count is `vstep`'s vector if given (a frozen variance), else the step."""
        idx = [i for i, on in enumerate(include) if on]
        if not idx:
            return []
        steps = self.vectors["step"]
        steps[idx] += 1
        s = steps.tolist()
        return segments(L, include, s, self.vectors[vstep].tolist() if vstep else s)

    bias_corrections = staticmethod(bias_corrections)

    def moments(self, seg: Segment, decay_steps: int = 1) -> None:
        """Warmup moments of a segment on the averaged gradients in `grad_buf`; the variance
        decays by beta2^decay_steps (ZeroOneAdam's variance updates cover several steps)."""
        b1, b2 = self.param_groups[seg.group]["betas"]
        sl = slice(seg.lo, seg.hi)
        F.moments_(self.buffers["exp_avg"][sl], self.buffers["exp_avg_sq"][sl], self.grad_buf[sl], b1,
                   b2 ** decay_steps)
