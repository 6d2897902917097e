"""The 1-bit machinery, used only by `OneBitAdam` and `OneBitLamb`: the
freeze, the momentum mask, the compressed momentum allreduce and its error state.

* The freeze (end of step freeze_step): the variance's step count is recorded, the mask
  of coordinates held at zero is built, the warmup's flat gradient buffer is freed and the
  `CompressionState` (one for the whole model) is created.
* Compression stage (steps freeze_step + 1 ..): the gradients stay local. The ranks first
  agree that every local gradient is finite (a per-parameter sum, ONE scalar allreduce;
  an exact count only when a sum overflows). At the first compression step of an
  optimizer instance the same allreduce also carries every rank's gradient checksum
  (`replica_slots`): identical gradients on every rank mean that a DDP without lbcomm's
  hook is still averaging them at full precision (`AveragedGradientsError`). The new
  momentum m' = b1 m + (1-b1) g is then
  produced by a source callable straight from m and each ``p.grad`` and reduced with one
  compressed allreduce; the result reaches a sink (m itself, or a callable that sees m' and
  the old m range by range), masked. m is written only after every rank has the result, so
  a non-finite value on any rank leaves every rank's state exactly as it was.
* exact_numel (OneBitAdam / OneBitLamb): the parameters of at most that many elements
  (whole parameters, also when sharded) take their new momentum from the gradients
  averaged exactly (summed in fp32 by the finiteness agreement's allreduce over the ranks
  the momentum is reduced over, so no collective is added; on nodes of several ranks by
  `hierarchical_mean_`, 1/G of the bytes between nodes); the compressed call still carries them,
  but its result there is replaced and their errors are zeroed after every call (flat,
  hierarchical or per shard alike), so they never enter the error feedback.

Topology (docs/topology.md): with nodes of several ranks (``topology``: a `Topology`, or
"auto" under torchrun with more than one node) the compression stage's one reduction is the
hierarchical call (`lbcomm.topology.hierarchical_allreduce_`: fp32 reduce-scatter inside
the node, 1 bit across nodes, all-gather), its error feedback a `HierarchicalState`;
`_reduce_momentum` is the one entry point and picks the call from the state it holds.
The warmup's averaging stays a flat full-precision allreduce.

Sharded parameters (FSDP2, `lbcomm.fsdp.onebit_optimizer`): the optimizer works on the
local shards; `process_group` is the replicate group (the ranks holding the same shard,
one per node), over which the shard's momentum is compressed, and `shard_group` the ranks
of the other shards. Per-parameter-tensor quantities (the max_update bound, the mask's
mean variance, LAMB's norms) are reduced over the shard group, and every verdict (finite
gradients, an applied reduction) is agreed over it too, so that all ranks skip together.

The mask is an index list when few coordinates are masked (the usual case: unused
embedding rows, constant features, softmax-invariant biases), a bool mask otherwise.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import Tensor

from ..common import report_exact_share, ring_allreduce_bytes
from ..compressed import CompressionState, NonFiniteError, reduce_
from ..topology import HierarchicalState, Topology, exact_mean_bytes, hierarchical_allreduce_, hierarchical_mean_
from ..wire import check_block_size
from . import functional as F
from .base import BaseOptimizer, grad_norm, local_sq_, replica_slots
from .flat import FlatLayout
from .functional import STAGE

__all__ = ["OneBitOptimizer"]

_log = logging.getLogger(__name__)

Source = Callable[[int, int, Tensor], None]
Sink = Union[Tensor, Callable[[int, int, Tensor], None]]


class OneBitOptimizer(BaseOptimizer):
    """Base of the 1-bit optimizers: a warmup as the full-precision twin, then a frozen
    variance and one compressed allreduce of the momentum per step.

    Subclasses implement `_compressed_update` with `_reduce_momentum`, and may extend
    `_on_freeze` and `_frozen_buffers` (flat buffers created at the freeze).
    """

    _GLOBAL_OPTIONS = BaseOptimizer._GLOBAL_OPTIONS + ("freeze_step", "block_size", "nonfinite", "mask_threshold",
                                                       "exact_numel")
    # max_update_bound: max_update="warmup"'s U_p, recorded at the freeze; -1 = not recorded
    # (before the freeze, and in checkpoints saved before it existed: unbounded, as they were)
    _param_vectors: Dict[str, float] = {"step": 0.0, "variance_step": 0.0, "max_update_bound": -1.0}
    _frozen_buffers: tuple = ()

    def __init__(self, *args, topology: Union[None, str, Topology] = "auto", **kwargs):
        if not (topology is None or topology in ("auto", "flat") or isinstance(topology, Topology)):
            raise ValueError(f"Invalid topology: {topology!r} (use 'auto', 'flat' (or None) or a "
                             "lbcomm.topology.Topology)")
        self.topology = "flat" if topology is None else topology
        self._topology: Optional[Topology] = None  # resolved at the first freeze (None: flat)
        self._topology_resolved = False
        self._frozen = False
        self._comp: Union[CompressionState, HierarchicalState, None] = None
        self._mask: Optional[Tensor] = None  # int64 indices (few masked) or bool (many): momentum held at zero
        self._mask_counts = (0, 0)
        self._user_masks: Dict[int, Tensor] = {}  # layout index -> bool mask (True = trained)
        self._stage: Optional[Tensor] = None  # bounded staging buffer of the one-rank path
        self._hier_buf: Optional[Tensor] = None  # the hierarchical reduction's whole momentum
        self._probe_compression = True  # the compression stage's check for averaged gradients is undecided
        self._exact: Optional[tuple] = None  # (exact_numel, index, places): _exact_part
        self._exact_weights: Optional[tuple] = None  # (1 - b1 per exact parameter, per coordinate): _exact_mean
        self._exact_sum: Optional[Tensor] = None  # the exact gradients' sum from _grads_finite's allreduce
        self._stats_ride: Optional[Tensor] = None  # gradient_stats' sample, to ride in _grads_finite's allreduce
        self._stats_mean: Optional[Tensor] = None  # ... and its mean over the ranks
        self._grad_sq_now: Optional[Tensor] = None  # this step's local_grad_sq (rescale_variance), folded once taken
        self._hook_sq: Dict[int, Tensor] = {}  # id(param) -> local squared norm, from warmup_average_hook
        self._untracked_warned = False
        super().__init__(*args, **kwargs)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        fs = group["freeze_step"]
        if isinstance(fs, bool) or not isinstance(fs, int) or fs < 1:
            raise ValueError(f"Invalid freeze_step: {fs!r} (must be an int >= 1: the variance is frozen after "
                             "that many warmup steps)")
        check_block_size(group["block_size"])
        if not 0.0 <= group["mask_threshold"] < 1.0:
            raise ValueError(f"Invalid mask_threshold: {group['mask_threshold']} (need 0 <= mask_threshold < 1)")
        F.resolve_max_update(group["max_update"], group["betas"])
        if not isinstance(group.get("rescale_variance", False), bool):
            raise ValueError(f"Invalid rescale_variance: {group['rescale_variance']!r} (must be True or False)")
        ex = group.get("exact_numel", 0)
        if isinstance(ex, bool) or not isinstance(ex, int) or ex < 0:
            raise ValueError(f"Invalid exact_numel: {ex!r} (must be an int >= 0: parameters of at most that many "
                             "elements are averaged exactly in the compression stage; 0 compresses all)")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group (see torch.optim.Optimizer.add_param_group). Allowed during
        warmup; after the freeze the layout of the compressed momentum is fixed."""
        if self._frozen:
            raise RuntimeError(f"{type(self).__name__}: cannot add a param group after the freeze (step "
                               f"{self._global_step}): the compressed momentum buffer has a fixed layout. Create the "
                               "optimizer with every group from the start (params without gradients cost nothing).")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ public API
    @property
    def frozen(self) -> bool:
        """True once the variance is frozen: every following step keeps the gradients local
        and compresses the momentum (a DDP hook must then not communicate)."""
        return self._frozen

    @property
    def compression_state(self) -> Union[CompressionState, HierarchicalState, None]:
        """The error-feedback state of the momentum allreduce: a CompressionState (flat), a
        HierarchicalState (nodes of several ranks, see `topology`), or None before the
        freeze and with one rank."""
        return self._comp

    def bytes_per_step(self) -> Optional[Dict[str, int]]:
        """What this rank sends per compression-stage step: {"compressed", "exact" (the
        exact_numel parameters' fp32 allreduce), "agreement" (the finiteness check),
        "total"}; with a hierarchical reduction the first two count the bytes between nodes
        (HierarchicalState.bytes_per_call); None before the freeze and with one rank."""
        if self._comp is None or self._layout is None:
            return None
        p, st = self.transport.world_size, self._comp
        part = self._exact_part(self._layout)
        k = 0 if part is None else part[0].numel()
        out = {"compressed": int(st.bytes_per_call(checked=True)), "exact": exact_mean_bytes(k, p, st),
               # one fp32 scalar, + one per parameter with rescale_variance
               "agreement": int(ring_allreduce_bytes(4 * (1 + self._sq_slots(self._layout)), p))}
        out["total"] = sum(out.values())
        return out

    @property
    def masked_coordinates(self) -> int:
        """How many momentum coordinates are held at zero (0 before the freeze)."""
        m = self._mask
        return 0 if m is None else int(m.sum()) if m.dtype == torch.bool else m.numel()

    def set_momentum_mask(self, param: Tensor, mask: Optional[Tensor]) -> None:
        """Override the automatic zero-variance mask for one parameter.

        Args:
            param (Tensor): a parameter of this optimizer.
            mask (Tensor or None): bool tensor of param's shape, True where the parameter is
                trained after the freeze and False where its momentum is held at zero; None
                returns to the automatic mask (coordinates whose variance is exactly zero at
                the freeze are held at zero).
        """
        L = self._prepare()
        i = L.index.get(id(param))
        if i is None:
            raise ValueError("set_momentum_mask: the tensor is not a parameter of this optimizer that requires grad")
        if mask is None:
            self._user_masks.pop(i, None)
        else:
            if not isinstance(mask, Tensor) or mask.shape != L.shapes[i]:
                raise ValueError(f"set_momentum_mask: expected a bool tensor of shape {tuple(L.shapes[i])} (for a "
                                 f"sharded parameter: its local shard's), got "
                                 f"{getattr(mask, 'shape', type(mask).__name__)}")
            self._user_masks[i] = mask.detach().to(device=param.device, dtype=torch.bool).clone()
        if self._frozen:
            self._build_mask(L)

    # ------------------------------------------------------------------ layout and step skeleton
    def _buffer_names(self) -> tuple:
        return self._flat_buffers + (self._frozen_buffers if self._frozen else ())

    def _on_layout(self, old: Optional[FlatLayout], new: FlatLayout) -> None:
        if old is not None:
            self._user_masks = {new.index[id(old.params[j])]: m for j, m in self._user_masks.items()
                                if id(old.params[j]) in new.index}
        self._stage = None
        self._exact = None

    def _check_layout_change(self) -> None:
        if self._frozen:
            raise RuntimeError(f"{type(self).__name__}: a parameter started requiring grad after the freeze "
                               f"(step {self._global_step}); the compressed momentum buffer has a fixed layout. "
                               "Unfreeze parameters during the warmup, or leave them trainable from the start.")

    def _take_step(self, L: FlatLayout) -> bool:
        if not self._frozen:
            taken = self._warmup_step(L)
            if taken and self._grad_sq_now is not None:
                self._fold_warmup_grad_sq(L)
            self._grad_sq_now = None
            return taken
        # The gradients are read where autograd left them; all ranks first agree they are finite.
        if not self._grads_finite(L):
            return self._nonfinite("the local gradients")
        if not self._compressed_update(L):
            return self._nonfinite("the new momenta")
        return True

    def _after_step(self, L: FlatLayout) -> None:
        if not self._frozen and self._global_step >= self._option("freeze_step"):
            self._freeze(L)

    def _participating(self, L: FlatLayout) -> List[bool]:
        """Parameters updated after the freeze: trainable ones that saw a gradient in warmup."""
        steps = self._vectors["step"].tolist()
        return [p.requires_grad and steps[i] > 0 for i, p in enumerate(L.params)]

    def _compressed_update(self, L: FlatLayout) -> bool:
        """Reduce the momentum and update the parameters; False when the reduction saw
        NaN/Inf (state unchanged)."""
        raise NotImplementedError

    def _on_freeze(self, L: FlatLayout) -> None:
        """Extra work at the freeze (after the mask, before the views are attached)."""

    def _record_update_bounds(self, L: FlatLayout) -> None:
        """At the freeze, for max_update="warmup": U_p = max_i |m^_i / (sqrt(v^_i) + eps)| of
        each parameter after its last warmup step (its largest full-precision step, in units
        of lr), kept in fp32 per parameter so that a resumed run uses the same bound; 0 for
        parameters that never had a gradient (they are not updated)."""
        m, v, stage = self._flat["exp_avg"], self._flat["exp_avg_sq"], self._stage_buffer(L)
        bound, steps = self._vectors["max_update_bound"], self._vectors["step"].tolist()
        for i, gi in enumerate(L.group_of):
            group = self.param_groups[gi]
            if steps[i] == 0:
                bound[i] = 0.0
                continue
            b1, b2 = group["betas"]
            bc1, bc2 = (1 - b1 ** steps[i], 1 - b2 ** steps[i]) if group["bias_correction"] else (1.0, 1.0)
            bound[i:i + 1] = F.max_abs_update(L.view(m, i), L.view(v, i), bc1, bc2, group["eps"], stage)
        if self._sharded():  # the bound of the whole parameter tensor: the max over its shards
            bound.copy_(self._per_tensor(L, bound.reshape(-1, 1), op="max").reshape(-1))

    def _update_bounds(self, L: FlatLayout) -> List[Optional[float]]:
        """Per parameter, this step's bound U on |m^ / (sqrt(v^) + eps)| (max_update of its
        group; None: unbounded, the published update)."""
        per_group = [F.resolve_max_update(g["max_update"], g["betas"]) for g in self.param_groups]
        recorded, out = None, []
        for i, gi in enumerate(L.group_of):
            u = per_group[gi]
            if u == "warmup":
                if recorded is None:
                    recorded = self._vectors["max_update_bound"].tolist()
                u = recorded[i] if recorded[i] >= 0 else None
            out.append(u)
        return out

    # ------------------------------------------------------------------ rescale_variance (OneBitAdam)
    def _tracks_grad_sq(self) -> bool:
        return "grad_sq" in self._param_vectors and any(g.get("rescale_variance", False) for g in self.param_groups)

    def stash_local_grad_sq(self, params, grads) -> None:
        """Called by `note_local_grads` (`lbcomm.ddp.warmup_average_hook`) with a bucket's parameters and local
        gradients before it averages them: their squared norms, which the warmup's
        `rescale_variance` needs and the averaged gradients no longer hold."""
        for p, g in zip(params, grads):
            self._hook_sq[id(p)] = grad_norm(g.detach()).square()

    def _warmup_grad_sq(self, L: FlatLayout, sq: Tensor) -> None:
        if self._grads_averaged:  # a DDP hook averaged them: the squared norms it stashed, one small allreduce
            stash, self._hook_sq = self._hook_sq, {}
            if not stash:
                self._untrack("the gradients were averaged before the optimizer saw them, not by "
                              "lbcomm.ddp.warmup_average_hook, so their local squared norms are unknown")
                return
            for i, p in enumerate(L.params):
                # -1: a parameter with a gradient that the hook did not see (its tracking stops)
                sq[i] = stash[id(p)] if id(p) in stash else (0.0 if L.grad(i) is None else -1.0)
            if self.transport.world_size > 1:
                self.transport.all_reduce(sq, op="mean")
        self._keep_grad_sq(L, sq)

    def _keep_grad_sq(self, L: FlatLayout, sq: Tensor) -> None:
        """This step's ranks' mean local squared norms, per parameter tensor (under FSDP2 the
        shards' sums), kept until the step is taken."""
        if self._sharded():
            sq = self._per_tensor(L, sq.reshape(-1, 1)).reshape(-1)
        self._grad_sq_now = sq.clone()

    def _untrack(self, why: str) -> None:
        """Stop rescale_variance for every parameter (the frozen variance then stays as it is), with a warning."""
        self._vectors["grad_sq"].fill_(-1.0)
        if not self._untracked_warned:
            self._untracked_warned = True
            _log.warning("%s: rescale_variance is off for this run: %s. The variance stays frozen as published. "
                         "Use lbcomm.ddp.warmup_average_hook (or let the optimizer average the gradients) to keep it",
                         type(self).__name__, why)

    def _grad_sq_ema(self, L: FlatLayout):
        """This step's statistic (consumed) and the EMA before and after it, per parameter:
        (sq, old, new), new = max(old, 0) b2 + (1 - b2) sq in float64 rounded to fp32 (the
        vectors' dtype), as the reference computes it; -1 in old: untracked."""
        sq, self._grad_sq_now = self._grad_sq_now.tolist(), None
        old = self._vectors["grad_sq"].tolist()
        b2 = [self.param_groups[gi]["betas"][1] for gi in L.group_of]
        new = [max(o, 0.0) * b + (1 - b) * x for o, x, b in zip(old, sq, b2)]
        return sq, old, torch.tensor(new, dtype=torch.float32).tolist()

    def _fold_warmup_grad_sq(self, L: FlatLayout) -> None:
        """A taken warmup step: the EMA (beta2, as the variance) of local_grad_sq for the
        parameters whose variance moved (a gradient on some rank), started at their first step."""
        sq, old, new = self._grad_sq_ema(L)
        active = (self._grad_buf[L.total:L.total + len(L.params)] > 0).tolist()
        steps = self._vectors["step"].tolist()
        out = list(old)
        for i in range(len(L.params)):
            # tracked: started at the parameter's first step (steps[i] is 1 by now); -1 from an
            # older checkpoint or a hook that did not see it stays untracked; a norm that
            # overflowed fp32 (finite gradients over 1e19) leaves the EMA as it was
            if active[i] and 0 <= sq[i] < math.inf and (old[i] >= 0 or steps[i] == 1):
                out[i] = new[i]
            elif active[i] and sq[i] < 0:
                out[i] = -1.0
        self._vectors["grad_sq"].copy_(torch.tensor(out, dtype=torch.float32))

    def _grad_sq_bc(self, L: FlatLayout, i: int, step: int) -> float:
        """The bias correction of parameter i's statistic after `step` steps (beta2's, as v's)."""
        group = self.param_groups[L.group_of[i]]
        return 1 - group["betas"][1] ** step if group["bias_correction"] else 1.0

    def _record_grad_sq(self, L: FlatLayout) -> None:
        """At the freeze: grad_sq_frozen = the bias-corrected EMA, the reference of the
        compression stage's rescale (-1: untracked, no rescale)."""
        if "grad_sq" not in self._vectors:
            return
        q, steps = self._vectors["grad_sq"].tolist(), self._vectors["step"].tolist()
        out = [q[i] / self._grad_sq_bc(L, i, steps[i]) if q[i] >= 0 and steps[i] > 0 else -1.0
               for i in range(len(L.params))]
        self._vectors["grad_sq_frozen"].copy_(torch.tensor(out, dtype=torch.float32))

    def _variance_factors(self, L: FlatLayout, include: List[bool]):
        """Compression stage, rescale_variance: per parameter, the factor f by which its frozen
        variance is scaled this step (None: unscaled), f = EMA_t / EMA_freeze of local_grad_sq,
        both bias-corrected (steps already advanced); and the new EMA vector to keep once the
        step is taken. (None, None) when nothing is tracked."""
        if self._grad_sq_now is None:
            return None, None
        sq, old, new = self._grad_sq_ema(L)
        frz, steps = self._vectors["grad_sq_frozen"].tolist(), self._vectors["step"].tolist()
        factors: List[Optional[float]] = [None] * len(L.params)
        keep = list(old)
        for i, gi in enumerate(L.group_of):
            if not (include[i] and old[i] >= 0 and frz[i] > 0 and 0 <= sq[i] < math.inf):
                continue
            keep[i] = new[i]
            if not self.param_groups[gi].get("rescale_variance", False):
                continue
            f = new[i] / self._grad_sq_bc(L, i, steps[i]) / frz[i]
            factors[i] = f if 0.0 < f < math.inf else None
        return factors, torch.tensor(keep, dtype=torch.float32)

    # ------------------------------------------------------------------ gradient statistics
    def _stats_begin(self, L: FlatLayout):
        """Compression stage: gradient_stats' coordinate sample rides in the finiteness
        agreement's allreduce (`_grads_finite`), one collective less per step."""
        stats = self.gradient_stats
        if not (self._frozen and stats is not None and self.transport.world_size > 1):
            return super()._stats_begin(L)
        self._stats_ride, self._stats_mean = stats.measure([p.grad for p in L.params], exact=False), None
        return "ride"

    def _stats_finish(self, L: FlatLayout, pending, skipped: bool) -> None:
        if not isinstance(pending, str):
            super()._stats_finish(L, pending, skipped)
            return
        ride, mean = self._stats_ride, self._stats_mean
        self._stats_ride = self._stats_mean = None
        if skipped:  # agreed on every rank: nothing to fold, no collective
            return
        if mean is None:  # a step without the agreement (ZeroOneAdam's variance steps): an allreduce of its own
            mean = ride
            self.transport.all_reduce(mean, op="mean")
        self.gradient_stats.observe(mean, self.transport.world_size)

    # ------------------------------------------------------------------ the compressed momentum
    def _grads_finite(self, L: FlatLayout) -> bool:
        """Whether every rank's local gradients are finite, agreed with ONE scalar allreduce
        of the per-parameter sums (a NaN or Inf anywhere makes the sum non-finite); only when
        a sum overflows, a second allreduce counts the non-finite elements exactly. With a
        flat reduction the exact_numel parameters' gradients ride in the same allreduce (one
        collective less per step; `_exact_mean` takes their sum), and so does gradient_stats'
        sample (`_stats_begin`)."""
        grads = []
        for i in range(len(L.params)):
            g = L.grad(i)
            if g is not None:
                if g.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                grads.append(g)
        dev = self._device(L)
        tr = self.transport
        probe = self._probe_compression and self._detecting()
        head = 1 + (2 * tr.world_size if probe else 0)
        # the exact parameters' gradients ride along when they are averaged over this group
        part = self._exact_part(L) if isinstance(self._comp, CompressionState) else None
        k = 0 if part is None else part[0].numel()
        ride = self._stats_ride
        n_ride = 0 if ride is None else ride.numel()
        n_sq = self._sq_slots(L)
        total = torch.zeros(head + k + n_ride + n_sq, dtype=torch.float32, device=dev)
        if n_sq:  # rescale_variance: the local squared norms ride along, and their sum is the finiteness check
            total[:1] += local_sq_(L, None, total[head + k + n_ride:]).sum()
        elif grads:
            total[:1] += torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum()
        if probe:  # the first compression step: every rank's checksum rides along
            total[1:head] = replica_slots(grads, tr.rank, tr.world_size, dev)
        if part is not None:
            self._exact_grads(L, part[1], out=total[head:head + k])
        if ride is not None:
            total[head + k:head + k + n_ride].copy_(ride)
        tr.all_reduce(total, op="sum")
        self._exact_sum = None if part is None else total[head:head + k]
        if ride is not None:
            self._stats_ride, self._stats_mean = None, total[head + k:head + k + n_ride].div_(tr.world_size)
        if n_sq:
            sq = total[head + k + n_ride:].div_(tr.world_size)
            self._keep_grad_sq(L, sq)
        if self._sharded():  # the shards' sums too: a NaN in one shard skips the step on every rank
            self.shard_transport.all_reduce(total[:1], op="sum")
        if bool(torch.isfinite(total[:1]).all()):
            if probe:
                self._probe_compression = not self._check_replicas(total[1:head], "compression")
            return True
        bad = torch.zeros(1, dtype=torch.float64, device=dev)
        for g in grads:
            bad += (~torch.isfinite(g)).sum()
        tr.all_reduce(bad, op="sum")
        if self._sharded():
            self.shard_transport.all_reduce(bad, op="sum")
        return int(bad.item()) == 0

    def _momentum_source(self, L: FlatLayout, scale: Optional[Tensor] = None) -> Source:
        """source(lo, hi, buf): buf = (b1 m + (1-b1) g_local)[lo:hi], times scale[p] per
        parameter if given, straight from m and each parameter's .grad (None counts as zero)."""
        m = self._flat["exp_avg"]
        weights = [1 - self.param_groups[gi]["betas"][0] for gi in L.group_of]

        def source(lo: int, hi: int, buf: Tensor) -> None:
            for i, a, b in L.overlapping(lo, hi):
                o = L.offsets[i]
                out, m_i = buf[o + a - lo:o + b - lo], m[o + a:o + b]
                g = L.grad(i)
                if g is not None and g.dtype == torch.float32:
                    torch.lerp(m_i, g.reshape(-1)[a:b], weights[i], out=out)
                else:
                    out.zero_() if g is None else out.copy_(g.reshape(-1)[a:b])
                    torch.lerp(m_i, out, weights[i], out=out)
                if scale is not None:
                    out.mul_(scale[i])

        source.momentum = (m, weights, scale)  # for the exact parameters (_exact_mean)
        return source

    def _reduce_momentum(self, L: FlatLayout, source: Source, sink: Sink) -> bool:
        """The compressed allreduce of the new momentum, the one place that meets it: the
        input comes from `source`, the masked result goes to `sink` (a tensor decoded into,
        or a callable sink(lo, hi, values) called range by range in order). Returns False,
        with `sink` untouched, when the result is non-finite (on every rank alike).

        Nothing model-sized is allocated: the input streams from `source` and the result
        to `sink` through bounded staging buffers (with one rank nothing is reduced). The
        caller has agreed with every rank that the inputs are finite (`_grads_finite`), so
        the call skips its own agreement; a result that still overflows is refused on every
        rank (the compression errors are then reset, see lbcomm.compressed)."""
        n = L.total
        if self._comp is None:
            stage = self._stage_buffer(L)
            for lo in range(0, n, STAGE):
                hi = min(n, lo + STAGE)
                buf = stage[:hi - lo]
                source(lo, hi, buf)
                self._deliver(sink, lo, hi, buf)
            return True
        exact = self._exact_mean(L, source)
        if exact is False:  # the exact mean is not finite: nothing changes on any rank
            applied = False
        elif isinstance(self._comp, HierarchicalState):
            applied = self._reduce_hierarchical(L, source, sink, exact)
        else:
            applied = self._reduce_flat(L, source, sink, exact)
        if isinstance(exact, tuple):  # their errors stay zero: the exact mean replaced what compression made of them
            self._comp.zero_errors_at(exact[0])
        if self._sharded():
            self._check_shards_agree(applied)
        return applied

    def _reduce_flat(self, L: FlatLayout, source: Source, sink: Sink, exact) -> bool:
        """`_reduce_momentum`'s flat compressed call, streamed through `reduce_`."""
        direct = isinstance(sink, Tensor)

        def deliver(lo: int, hi: int, values: Tensor) -> None:  # a callable sink sees the exact values already
            self._deliver(sink, lo, hi, values if exact is None else self._put_exact(L, values, lo, hi, exact))

        try:  # every rank sees every server scale, so all ranks agree on the verdict
            applied = reduce_(self._comp, source, sink if direct else deliver, checked=True)
        except NonFiniteError:
            applied = False
        if applied and direct:
            if exact is not None:
                sink.index_copy_(0, exact[0], exact[2])
            self._mask_range(sink, 0, L.total)
        return applied

    def _exact_limit(self) -> int:
        """exact_numel (OneBitAdam / OneBitLamb; 0 for optimizers without the option)."""
        return int(self.param_groups[0].get("exact_numel", 0)) if self.param_groups else 0

    def _exact_part(self, L: FlatLayout):
        """(index, places) of the parameters of at most exact_numel elements: their flat
        coordinates (int64, ascending) and (parameter, its first element in index) pairs;
        None without such parameters."""
        limit = self._exact_limit()
        if self._exact is None or self._exact[0] != limit:
            places, spans, at = [], [], 0
            for i, q in enumerate(L.params):
                if limit and 0 < q.numel() <= limit:
                    places.append((i, at))
                    spans.append(torch.arange(L.offsets[i], L.offsets[i] + L.numels[i]))
                    at += L.numels[i]
            index = torch.cat(spans).to(self._device(L)) if spans else None
            self._exact = (limit, index, places)
        return None if self._exact[1] is None else self._exact[1:]

    def _exact_mean(self, L: FlatLayout, source: Source):
        """The new momentum of the exact parameters from their gradients averaged exactly
        (their sum from `_grads_finite`'s allreduce, or `hierarchical_mean_` on nodes; m is the
        same on every rank, so this is the exact mean of the ranks' new momenta): (index, places, values) (`_exact_part`),
        values scaled like the source's; None without exact parameters; False (on every
        rank alike) when the mean gradient is not finite."""
        part = self._exact_part(L)
        fused, self._exact_sum = self._exact_sum, None
        if part is None:
            return None
        index, places = part
        m, weights, scale = source.momentum
        dev, n = index.device, index.numel()
        st = self._comp
        if fused is not None:  # summed by _grads_finite's allreduce
            g = fused.div_(self.transport.world_size)
        elif isinstance(st, HierarchicalState) and not st.topology.flat:
            g = hierarchical_mean_(self._exact_grads(L, places), st.topology)  # 1/G of the bytes between nodes
        else:
            g = self._exact_grads(L, places)
            self.transport.all_reduce(g, op="mean")
        if not bool(torch.isfinite(g).all()):
            return False
        # in place, one op each for all exact parameters: the mean gradient becomes the new momentum
        ids = [i for i, _ in places]
        key = tuple((i, weights[i]) for i in ids)
        if self._exact_weights is None or self._exact_weights[0] != key:
            w = torch.tensor([weights[i] for i in ids], dtype=torch.float32)
            self._exact_weights = (key, w.repeat_interleave(torch.tensor([L.numels[i] for i in ids])).to(dev))
        torch.lerp(m.index_select(0, index), g, self._exact_weights[1], out=g)
        if scale is not None:
            counts = torch.tensor([L.numels[i] for i in ids], device=scale.device)
            g.mul_(scale[torch.tensor(ids, device=scale.device)].repeat_interleave(counts, output_size=n))
        return index, places, g

    def _exact_grads(self, L: FlatLayout, places, out: Optional[Tensor] = None) -> Tensor:
        """The local gradients of the exact parameters, concatenated in fp32 (into `out`)."""
        dev = self._device(L)
        parts = [torch.zeros(L.numels[i], dtype=torch.float32, device=dev) if L.grad(i) is None
                 else L.grad(i).reshape(-1) for i, _ in places]
        if out is None:
            return torch.cat(parts).to(torch.float32)
        if all(t.dtype == torch.float32 for t in parts):
            return torch.cat(parts, out=out)
        return out.copy_(torch.cat(parts))

    @staticmethod
    def _put_exact(L: FlatLayout, values: Tensor, lo: int, hi: int, exact) -> Tensor:
        """values (the decoded [lo, hi)) with the exact parameters' coordinates from
        `_exact_mean`'s result."""
        _, places, mean = exact
        for i, o in places:
            a, b = L.offsets[i], L.offsets[i] + L.numels[i]
            x, y = max(a, lo), min(b, hi)
            if x < y:
                values[x - lo:y - lo].copy_(mean[o + x - a:o + y - a])
        return values

    def _check_shards_agree(self, applied: bool) -> None:
        """Sharded: the replicate groups of the other shards reached the same verdict. The
        inputs were agreed finite everywhere, so they differ only when a sum of finite
        momenta overflowed float32 in some shards: then some shards have already committed
        their new momentum and no consistent state is left."""
        flag = torch.tensor([1.0 if applied else 0.0], device=self._device(self._layout))
        self.shard_transport.all_reduce(flag, op="sum")
        if 0 < float(flag) < self.shard_transport.world_size:
            raise NonFiniteError(f"{type(self).__name__}: at step {self._global_step + 1} the compressed momentum "
                                 "overflowed float32 in some shards only (finite momenta whose mean is not); the "
                                 "shards' states now disagree: resume from the last checkpoint with a smaller lr")

    def _reduce_hierarchical(self, L: FlatLayout, source: Source, sink: Sink, exact) -> bool:
        """`_reduce_momentum` on nodes of several ranks: the whole new momentum is staged in
        one fp32 buffer (the intra-node reduce-scatter needs it at once), reduced in place
        by `hierarchical_allreduce_` and delivered range by range, masked."""
        n, st = L.total, self._comp
        buf = self._hier_buf
        if buf is None or buf.numel() != n:
            buf = self._hier_buf = torch.empty(n, dtype=torch.float32, device=self._device(L))
        for lo in range(0, n, STAGE):
            source(lo, min(n, lo + STAGE), buf[lo:min(n, lo + STAGE)])
        hierarchical_allreduce_(buf, st)
        if st.last_skipped:  # on every rank alike; errors untouched (or reset, logged, when mixed)
            return False
        if exact is not None:
            buf.index_copy_(0, exact[0], exact[2])
        for lo in range(0, n, STAGE):
            self._deliver(sink, lo, min(n, lo + STAGE), buf[lo:min(n, lo + STAGE)])
        return True

    def _stage_buffer(self, L: FlatLayout) -> Tensor:
        """A bounded fp32 buffer of min(numel, STAGE) elements for staged passes."""
        if self._stage is None:
            self._stage = torch.empty(min(L.total, STAGE), dtype=torch.float32, device=self._device(L))
        return self._stage

    def _deliver(self, sink: Sink, lo: int, hi: int, values: Tensor) -> None:
        if isinstance(sink, Tensor):
            self._mask_range(values, lo, hi)
            if values.data_ptr() != sink[lo:hi].data_ptr():
                sink[lo:hi].copy_(values)
        else:
            sink(lo, hi, values)

    def _mask_range(self, values: Tensor, lo: int, hi: int) -> None:
        """Zero the masked coordinates of elements [lo, hi) held in `values`."""
        mask = self._mask
        if mask is None:
            return
        if mask.dtype == torch.bool:
            values.masked_fill_(mask[lo:hi], 0.0)
            return
        if lo == 0 and hi >= self._layout.total:
            values.index_fill_(0, mask, 0.0)
            return
        a, b = (int(x) for x in torch.searchsorted(mask, torch.tensor([lo, hi], device=mask.device)))
        if b > a:
            values.index_fill_(0, mask[a:b] - lo, 0.0)

    # ------------------------------------------------------------------ freeze
    def _build_mask(self, L: FlatLayout) -> None:
        """Hold at zero the momentum of coordinates whose frozen variance is zero, or at most
        mask_threshold times the mean variance: they never saw a gradient, or only rounding
        noise (e.g. attention key biases, to which softmax is invariant), and would move by
        (compression noise) / eps after the freeze. User masks override per parameter."""
        v = self._flat["exp_avg_sq"]
        if self._sharded():  # the mean variance of the whole model, over the shards
            total = torch.stack([v.sum(dtype=torch.float32), torch.tensor(float(v.numel()), device=v.device)])
            self.shard_transport.all_reduce(total, op="sum")
            thr = self._option("mask_threshold") * float(total[0] / total[1]) if float(total[1]) else 0.0
        else:
            thr = self._option("mask_threshold") * float(v.mean()) if v.numel() else 0.0
        zero = v <= thr
        self._mask_counts = (int((v == 0).sum()), int(zero.sum()))
        for i, mask in self._user_masks.items():
            L.view(zero, i).copy_(~mask)
        self._set_mask(zero)

    def _set_mask(self, zero: Optional[Tensor]) -> None:
        """Keep a bool mask (True = held at zero) compactly: the index list when it is at
        most 1/16 of the coordinates (smaller, and index_fill_ is then faster)."""
        count = 0 if zero is None else int(zero.sum())
        if count == 0:
            self._mask = None
        elif count * 16 < zero.numel():
            self._mask = zero.nonzero().view(-1)
        else:
            self._mask = zero

    def _resolved_topology(self) -> Optional[Topology]:
        """The nodes the momentum is reduced over: a multi-node Topology, or None (flat).
        "auto" makes one under torchrun with more than one node (collective: every rank
        resolves it at the same step, the freeze or a load)."""
        if self._topology_resolved:
            return self._topology
        spec, tr = self.topology, self.transport
        topo = None
        if isinstance(spec, Topology):
            if spec.world_size != tr.world_size:
                raise ValueError(f"{type(self).__name__}: the topology spans {spec.world_size} ranks "
                                 f"({spec.nodes} nodes x {spec.local_size}) but the optimizer's process group has "
                                 f"{tr.world_size}; pass a topology of the ranks the optimizer averages over")
            topo = spec
        elif spec == "auto" and self.process_group is None and self.shard_group is None and tr.world_size > 1:
            import torch.distributed as dist

            if self.backend != "mpi" and dist.is_available() and dist.is_initialized():
                topo = Topology.auto()
        if topo is not None and topo.flat:
            topo = None
        self._topology, self._topology_resolved = topo, True
        if topo is not None:
            _log.info("%s: hierarchical momentum reduction on %s", type(self).__name__, topo)
        return topo

    def _make_compression_state(self, L: FlatLayout) -> None:
        self._comp = None
        self._hier_buf = None
        if self.transport.world_size > 1:
            topo = self._resolved_topology()
            if topo is not None:
                self._comp = HierarchicalState(L.total, topo, device=self._device(L),
                                               block_size=self._option("block_size"), nonfinite="skip")
                return
            self._comp = CompressionState(L.total, group=self.process_group, device=self._device(L),
                                          block_size=self._option("block_size"), nonfinite="raise",
                                          transport=self.transport)

    def _topology_key(self) -> Optional[tuple]:
        """(nodes, ranks per node) of the momentum reduction, None when flat."""
        st = self._comp
        return (st.topology.nodes, st.topology.local_size) if isinstance(st, HierarchicalState) else None

    def _freeze(self, L: FlatLayout) -> None:
        self._frozen = True
        self._grad_buf = None  # the compression stage reads the gradients where autograd left them
        self._vectors["variance_step"].copy_(self._vectors["step"])
        self._build_mask(L)
        self._record_update_bounds(L)
        self._record_grad_sq(L)
        for name in self._frozen_buffers:
            self._flat[name] = torch.zeros_like(self._flat["exp_avg"])
        self._make_compression_state(L)
        self._on_freeze(L)
        self._attach_views()
        exact, below = self._mask_counts
        if self._comp is not None:
            p = self.transport.world_size
            sent = self.bytes_per_step()
            part = self._exact_part(L)
            fp32 = ring_allreduce_bytes(4 * L.total, p)
            _log.info("%s: the compression stage sends %s bytes per step and rank (compressed allreduce %s + "
                      "exact parameters %s + finiteness agreement %s) against %d for an fp32 ring allreduce of the "
                      "gradients: %.1fx less", type(self).__name__, sent["total"], sent["compressed"], sent["exact"],
                      sent["agreement"], fp32, fp32 / sent["total"])
            if part is not None:
                report_exact_share(_log, type(self).__name__, "momentum", part[0].numel(), L.total, self._exact_limit())
        _log.info("%s: variance frozen after step %s; from now on one compressed allreduce of %s momentum elements "
                  "per step over %s ranks (block_size %s); %s coordinates held at zero (variance exactly zero: %s, "
                  "at most mask_threshold x mean: %s, user masks: %s params)", type(self).__name__,
                  self._global_step, L.total, self.transport.world_size, self._option("block_size"),
                  self.masked_coordinates, exact, below, len(self._user_masks))

    # ------------------------------------------------------------------ checkpoints
    def _extra_state(self) -> Dict[str, Any]:
        extra = super()._extra_state()
        extra.update(
            frozen=self._frozen,
            world_size=self.transport.world_size,
            mask=self._mask,
            user_masks=dict(self._user_masks),
            compression=None if self._comp is None else self._comp.state_dict(),
            topology=self._topology_key(),
        )
        return extra

    def _load_extra_state(self, state: Dict[Any, Dict[str, Tensor]], extra: Dict[str, Any]) -> None:
        old = [g for g in self.param_groups if "max_update" not in g]
        for g in old:  # saved before max_update existed: go on with the update it was trained with
            g["max_update"] = None
        if old:
            _log.warning("%s: the checkpoint predates max_update; its %s param group(s) continue with the published, "
                         "unbounded update (max_update=None) as they were trained; set param_group['max_update'] to "
                         "bound the compression stage", type(self).__name__, len(old))
        if "rescale_variance" in self.defaults:
            old = [g for g in self.param_groups if "rescale_variance" not in g]
            for g in old:  # saved before rescale_variance existed: the frozen variance it was trained with
                g["rescale_variance"] = False
            if old:
                _log.warning("%s: the checkpoint predates rescale_variance; its %s param group(s) continue with the "
                             "published frozen variance (rescale_variance=False)", type(self).__name__, len(old))
        self._frozen = bool(extra["frozen"])
        self._comp = None
        self._mask = None
        self._user_masks = {}
        super()._load_extra_state(state, extra)
        L = self._layout
        if L is None:
            return
        self._user_masks = {int(i): m.to(device=L.params[int(i)].device, dtype=torch.bool).clone()
                            for i, m in extra["user_masks"].items()}
        device = self._device(L)
        if extra["version"] == 1:  # a bool mask over all coordinates
            zero = extra["zero_mask"]
            self._set_mask(None if zero is None else zero.to(device=device, dtype=torch.bool))
        elif extra["mask"] is not None:
            mask = extra["mask"]
            self._mask = mask.to(device=device, dtype=torch.bool if mask.dtype == torch.bool else torch.int64).clone()
        if self._frozen:
            self._grad_buf = None
            self._make_compression_state(L)
            saved = extra.get("compression")
            saved_topo = tuple(extra["topology"]) if extra.get("topology") is not None else None
            if self._comp is not None and saved is not None and saved_topo != self._topology_key():
                _log.warning("%s: the checkpoint's compression errors belong to the topology (nodes, ranks per node)="
                             "%s, this run reduces over %s; the compression error buffers start from zero and "
                             "training continues", type(self).__name__, saved_topo or "flat",
                             self._topology_key() or "flat")
            elif self._comp is not None and saved is not None:
                self._comp.load_state_dict(saved)  # logs a warning and resets on a layout change
            elif self._comp is not None or saved is not None:
                _log.warning("%s: the checkpoint was saved with world size %s, this run has %s; the compression error "
                             "buffers start from zero and training continues", type(self).__name__,
                             extra.get("world_size"), self.transport.world_size)
