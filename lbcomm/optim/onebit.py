"""`OneBitStage`: the 1-bit machinery as one component, held and called by `OneBitAdam`,
`OneBitLamb` and `ZeroOneAdam` (their update math is in `functional`).

* The freeze (`freeze`, end of step freeze_step): the variance's step count, the momentum
  mask (`mask`) and max_update's per-tensor bounds are recorded, and the reducer (one for
  the whole model, `make_reducer`) is created.
* Compression stage: the gradients stay local. The ranks first agree that every local
  gradient is finite (`grads_finite`: a per-parameter sum, ONE scalar allreduce; an exact
  count only when a sum overflows). At the first compression step of an optimizer
  instance the same allreduce also carries every rank's gradient checksum
  (`agree.replica_slots`): identical gradients on every rank mean that something averaged
  them before the optimizer (`AveragedGradientsError`). The new momentum
  m' = b1 m + (1-b1) g is produced by a source callable straight from m and each
  ``p.grad`` and reduced with one ``reducer.reduce_`` call (`reduce_momentum`); the result
  reaches a sink (m itself, or a callable that sees m' and the old m range by range),
  masked. m is written only after every rank has the result, so a non-finite value on any
  rank leaves every rank's state exactly as it was.
* exact_numel: the parameters of at most that many elements take their new momentum from
  the gradients averaged exactly, and their errors stay zero (`exact`).

Topology (docs/topology.md): with nodes of several ranks (``comm.topology``: a `Topology`,
or "auto" under torchrun with more than one node) the reducer is a `HierarchicalState`
(fp32 reduce-scatter inside the node, 1 bit across nodes, all-gather), else a flat
`CompressionState`. Both are used through the `lbcomm.reducer.Reducer` protocol only;
what depends on the topology besides the reducer (the exact parameters' mean on nodes) is
in `exact.ExactPart.mean`. The warmup's averaging stays a flat full-precision allreduce.

Sharded parameters (FSDP2): the shard's momentum is compressed over ``comm.process_group``
(the replicate group); per-tensor values and every verdict are agreed over ``comm.shard_group``.
"""
from __future__ import annotations

import atexit
import logging
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import Tensor

from ..common import compressor_stats, report_exact_share, ring_allreduce_bytes
from ..compressed import NonFiniteError
from ..errors import NotCompressedWarning
from ..reducer import make_reducer, resolve_topology
from ..topology import Topology
from . import agree
from . import functional as F
from .exact import ExactPart
from .flat import FlatLayout
from .freeze import AUTO, MAX_STEP, AutoFreeze
from .functional import STAGE
from .mask import MomentumMask

__all__ = ["OneBitStage"]

_log = logging.getLogger(__name__)

# watch_lr's threshold: an lr this many times the lr at the freeze is warned about
LR_RISE = 1.5

Source = Callable[[int, int, Tensor], None]

_LIVE: "weakref.WeakSet[OneBitStage]" = weakref.WeakSet()


@atexit.register
def _warn_never_compressed() -> None:
    """At exit: a run of several ranks that never compressed says so (once per optimizer)."""
    for stage in list(_LIVE):
        try:
            stage.warn_uncompressed("the run ended")
        except Exception:  # noqa: BLE001 - the process group may be gone at exit
            pass
Sink = Union[Tensor, Callable[[int, int, Tensor], None]]


class OneBitStage:
    """The freeze, the momentum mask, max_update's bound and the compressed momentum
    reduction of a 1-bit optimizer `opt` (a `BaseOptimizer` whose flat state holds
    ``exp_avg`` and ``exp_avg_sq`` and whose vectors hold ``step``, ``variance_step`` and
    ``max_update_bound``, see `VECTORS`).

    Args:
        opt: the optimizer that holds the stage.
        exact_numel (int): parameters of at most this many elements are averaged exactly.
        flat_only (bool): the optimizer runs on the flat reduction only (ZeroOneAdam):
            ``comm.topology`` "auto" resolves to flat, a Topology of several nodes is refused.
        freeze_option (str): the name of the optimizer's freeze option (an int or "auto").
    """

    # per-parameter fp32 vectors the stage keeps in the optimizer's state (initial values);
    # max_update_bound: max_update="warmup"'s U_p, recorded at the freeze (-1: not recorded)
    VECTORS: Dict[str, float] = {"step": 0.0, "variance_step": 0.0, "max_update_bound": -1.0}

    def __init__(self, opt, *, exact_numel: int, flat_only: bool = False, freeze_option: str = "freeze_step"):
        self.opt = opt
        self.freeze_option = freeze_option
        self.comm = opt.comm
        spec = self.comm.topology
        if flat_only and isinstance(spec, Topology) and not spec.flat:
            raise ValueError(f"{type(opt).__name__} runs on the flat compressed reduction only (its local steps and "
                             f"syncs are not built on the hierarchical one); got {spec}. Leave comm.topology at "
                             "'auto' or 'flat'")
        self.flat_only = flat_only
        self.frozen = False
        self.topology: Optional[Topology] = None  # resolved at the first freeze (None: flat)
        self._topology_resolved = False
        self.reducer = None  # the Reducer of the momentum (None before the freeze and with one rank)
        self.masks = MomentumMask(opt)
        self._stage: Optional[Tensor] = None  # bounded staging buffer (lent to a flat reducer, `_make_reducer`)
        self._warned_no_blocks = False
        self._freeze_lrs: Optional[List[float]] = None  # each group's lr at the freeze (see watch_lr)
        self._warned_lr_rise = False
        self._probe = True  # the compression stage's check for averaged gradients is undecided
        self.exact = ExactPart(self, exact_numel)
        self.stats_ride: Optional[Tensor] = None  # gradient_stats' sample, to ride in grads_finite's allreduce
        self._stats_mean: Optional[Tensor] = None  # ... and its mean over the ranks
        self.auto = AutoFreeze(type(opt).__name__, freeze_option)  # freeze_step="auto"'s decision
        self._warned_uncompressed = False
        self._warned_none = False
        _LIVE.add(self)  # warned at exit if it never compressed

    # ------------------------------------------------------------------ layout
    def check_layout_change(self, what: str) -> None:
        """Raise once frozen: the compressed momentum buffer has a fixed layout."""
        if self.frozen:
            raise RuntimeError(f"{type(self.opt).__name__}: cannot {what} after the freeze (step "
                               f"{self.opt.global_step}): the compressed momentum buffer has a fixed layout. Create "
                               "the optimizer with every group from the start (params without gradients cost "
                               "nothing) and unfreeze parameters during the warmup.")

    def on_layout(self, old: Optional[FlatLayout], new: FlatLayout) -> None:
        self.masks.on_layout(old, new)
        self._stage = None
        self.exact.reset()

    def participating(self, L: FlatLayout) -> List[bool]:
        """Parameters updated after the freeze: trainable ones that saw a gradient in warmup."""
        steps = self.opt._vectors["step"].tolist()
        return [p.requires_grad and steps[i] > 0 for i, p in enumerate(L.params)]

    def stage_buffer(self, L: FlatLayout) -> Tensor:
        """A bounded fp32 buffer of min(numel, STAGE) elements for staged passes; idle
        during the momentum's reduction, which stages its ranges through it."""
        if self._stage is None:
            self._stage = torch.empty(min(L.total, STAGE), dtype=torch.float32, device=self.opt._device(L))
        return self._stage

    # ------------------------------------------------------------------ max_update
    def record_update_bounds(self, L: FlatLayout) -> None:
        """At the freeze, for max_update="warmup": U_p = max_i |m^_i / (sqrt(v^_i) + eps)| of
        each parameter after its last warmup step (its largest full-precision step, in units
        of lr), kept in fp32 per parameter so that a resumed run uses the same bound; 0 for
        parameters that never had a gradient (they are not updated)."""
        opt = self.opt
        m, v, stage = opt._flat["exp_avg"], opt._flat["exp_avg_sq"], self.stage_buffer(L)
        bound, steps = opt._vectors["max_update_bound"], opt._vectors["step"].tolist()
        for i, gi in enumerate(L.group_of):
            group = opt.param_groups[gi]
            if steps[i] == 0:
                bound[i] = 0.0
                continue
            b1, b2 = group["betas"]
            bc1, bc2 = (1 - b1 ** steps[i], 1 - b2 ** steps[i]) if group["bias_correction"] else (1.0, 1.0)
            bound[i:i + 1] = F.max_abs_update(L.view(m, i), L.view(v, i), bc1, bc2, group["eps"], stage)
        if opt._sharded():  # the bound of the whole parameter tensor: the max over its shards
            bound.copy_(opt._per_tensor(L, bound.reshape(-1, 1), op="max").reshape(-1))

    def update_bounds(self, L: FlatLayout) -> List[Optional[float]]:
        """Per parameter, this step's bound U on |m^ / (sqrt(v^) + eps)| (comm.max_update at
        its group's betas; None: unbounded, the published update)."""
        opt = self.opt
        per_group = [F.resolve_max_update(self.comm.max_update, g["betas"]) for g in opt.param_groups]
        recorded, out = None, []
        for i, gi in enumerate(L.group_of):
            u = per_group[gi]
            if u == "warmup":
                if recorded is None:
                    recorded = opt._vectors["max_update_bound"].tolist()
                u = recorded[i] if recorded[i] >= 0 else None
            out.append(u)
        return out

    def decode_caps(self, L: FlatLayout, segs, factors, bounds: List[Optional[float]],
                    scale: Optional[Tensor] = None) -> Optional[Callable[[int, int, Tensor], None]]:
        """max_update's bound moved into the compressed allreduce (comm.capped_decode): per
        coordinate, the momentum whose Adam step is exactly the bound,
        c = U bc1 (sqrt(v^) + eps) with this step's bias corrections (`segs`, steps advanced)
        and rescale factors, times the parameter's `scale` when the reduced momentum is
        scaled (OneBitLamb), +inf where no bound applies; the reducer decodes every value
        to at most c and its error feedback keeps the rest (`lbcomm.compressed.reduce_`).
        Returned as a callable cap(lo, hi, buf) that computes the caps of flat elements
        [lo, hi) from the variance when the reducer asks for them (range by range, into
        its bounded staging), so no model-sized buffer holds them; each element goes
        through the same operations as in `lbcomm.optim.reference.decode_caps`. None when
        nothing is capped: one rank, capped_decode False, no bound, or no blocks (one
        scale per tensor; warned once)."""
        if self.reducer is None or self.comm.capped_decode is False or all(b is None for b in bounds):
            return None
        if self.comm.block_size is None:  # asked for explicitly: a warning; by default: info
            if not self._warned_no_blocks:
                self._warned_no_blocks = True
                _log.log(logging.WARNING if self.comm.capped_decode else logging.INFO,
                         "%s: the capped decode needs blocks (block_size is None); max_update bounds the step only",
                         type(self.opt).__name__)
            return None
        opt, v = self.opt, self.opt._flat["exp_avg_sq"]
        # per parameter: (a, b) with c = a sqrt(v) + b (U bc1 (sqrt(v) / sqrt(bc2') + eps)), None: uncapped
        coeffs: List[Optional[tuple]] = [None] * len(L.params)
        for seg in segs:
            group = opt.param_groups[seg.group]
            bc1, bc2 = opt._bias_corrections(group, seg)
            for i in seg.idx:
                if bounds[i] is not None:
                    coeffs[i] = F.cap_coefficients(bounds[i], bc1, F.rescaled_bc2(bc2, factors, i), group["eps"])

        def cap(lo: int, hi: int, buf: Tensor) -> None:
            for i, a, b in L.overlapping(lo, hi):
                o = L.offsets[i]
                out = buf[o + a - lo:o + b - lo]
                if coeffs[i] is None:  # no bound here: nothing capped
                    out.fill_(float("inf"))
                    continue
                # the sqrt, its multiply and its add in three passes (the simulation's order)
                torch.sqrt(v[o + a:o + b], out=out).mul_(coeffs[i][0]).add_(coeffs[i][1])
                if scale is not None:
                    out.mul_(scale[i])

        return cap

    # ------------------------------------------------------------------ the mask (see `mask`)
    def set_momentum_mask(self, param: Tensor, mask: Optional[Tensor]) -> None:
        """`OneBitAdam.set_momentum_mask` (see there)."""
        self.masks.set_user(param, mask, rebuild=self.frozen)

    @property
    def masked_coordinates(self) -> int:
        return self.masks.count

    def build_mask(self, L: FlatLayout) -> None:
        self.masks.build(L)

    def mask_range(self, values: Tensor, lo: int, hi: int) -> None:
        """Zero the masked coordinates of elements [lo, hi) held in `values`."""
        self.masks.apply(values, lo, hi)

    # ------------------------------------------------------------------ freeze
    def _resolve_topology(self) -> Optional[Topology]:
        """The nodes the momentum is reduced over (`lbcomm.reducer.resolve_topology`,
        once: a collective at the freeze or a load); always flat with `flat_only`."""
        if not self._topology_resolved:
            opt = self.opt
            topo = None if self.flat_only else resolve_topology(self.comm, world_size=opt.transport.world_size,
                                                                who=type(opt).__name__)
            self.topology, self._topology_resolved = topo, True
            if topo is not None:
                _log.info("%s: hierarchical momentum reduction on %s", type(opt).__name__, topo)
        return self.topology

    def _make_reducer(self, L: FlatLayout) -> None:
        opt = self.opt
        self.reducer = None
        if opt.transport.world_size > 1:
            # non-finite calls are skipped inside: the optimizer applies comm.nonfinite itself
            self.reducer = make_reducer(L.total, self.comm.replace(nonfinite="skip"), device=opt._device(L),
                                        topology=self._resolve_topology(), transport=opt.transport)
            # a flat reducer stages its ranges (the momentum's source and sink, the caps)
            # through the stage buffer, idle during the call: one buffer for both
            share = getattr(self.reducer, "share_staging", None)
            if share is not None:
                share(self.stage_buffer(L))

    def freeze(self, L: FlatLayout) -> None:
        """The end of the warmup: variance step, mask, bounds and reducer (the optimizer adds
        its own buffers after this, then attaches the views and calls `log_freeze`)."""
        opt = self.opt
        self.frozen = True
        opt._grad_buf = None  # the compression stage reads the gradients where autograd left them
        opt._vectors["variance_step"].copy_(opt._vectors["step"])
        self.build_mask(L)
        self.record_update_bounds(L)
        self._make_reducer(L)

    def freeze_due(self, L: FlatLayout, vstep: str = "step", check: bool = True) -> bool:
        """Whether the variance is to be frozen after the step just taken: at the step the
        optimizer's freeze option names, or with "auto" when `AutoFreeze` decides (a check only
        where `check`: ZeroOneAdam checks on its variance steps). `vstep`: the vector
        counting the variance's steps (its bias correction)."""
        opt = self.opt
        value, t = opt._option(self.freeze_option), opt.global_step
        if value != AUTO:
            return t >= value
        auto = self.auto
        if auto.decided_at is not None:
            return t >= auto.decided_at
        if not (check and auto.due(t)):
            return False
        auto.sample(L.total, opt._device(L))
        return auto.check(t, self._preconditioner(L, vstep), [g["lr"] for g in opt.param_groups], self._all_agree)

    def frozen_after(self, done: bool) -> Optional[int]:
        """The step after which the variance was frozen (`done`: it is), else None."""
        if not done:
            return None
        value = self.opt._option(self.freeze_option)
        return self.auto.decided_at if value == AUTO else value

    def _preconditioner(self, L: FlatLayout, vstep: str):
        """index -> sqrt(v^) at those flat coordinates (each with its parameter's bias correction)."""
        opt = self.opt
        steps = opt._vectors[vstep].tolist()
        bc = []
        for i, gi in enumerate(L.group_of):
            group = opt.param_groups[gi]
            b2 = group["betas"][1]
            bc.append(1 - b2 ** steps[i] if group.get("bias_correction", True) and steps[i] > 0 else 1.0)
        v = opt._flat["exp_avg_sq"]

        def precond(index: Tensor) -> Tensor:
            starts = torch.tensor(L.offsets, dtype=torch.long, device=index.device)
            owner = (torch.searchsorted(starts, index, right=True) - 1).clamp_(min=0)
            scale = torch.tensor(bc, dtype=torch.float64, device=index.device)[owner]
            return (v[index].double() / scale).sqrt_()

        return precond

    def _all_agree(self, vote: bool) -> bool:
        """The AND of every rank's vote (one 4-byte allreduce; the shard group's too)."""
        opt = self.opt
        tr, shards = opt.transport, opt._sharded()
        if tr.world_size == 1 and not shards:
            return vote
        flag = torch.tensor([1.0 if vote else 0.0], device=opt._device(opt._layout))
        want = 1
        if tr.world_size > 1:
            tr.all_reduce(flag, op="sum")
            want *= tr.world_size
        if shards:
            opt.shard_transport.all_reduce(flag, op="sum")
            want *= opt.shard_transport.world_size
        return int(flag.item()) == want

    def not_compressing(self) -> Optional[str]:
        """Why nothing is compressed now, or None once the compression stage runs."""
        opt = self.opt
        if opt.transport.world_size == 1 and not opt._sharded():
            return ("one rank: nothing to communicate (is torch.distributed initialized with the job's world size, "
                    "or comm.process_group the group you meant?)")
        if self.frozen:
            return None
        option = self.freeze_option
        value = opt._option(option)
        if opt.global_step == 0:
            return "no step taken yet"
        if value == AUTO:
            last = self.auto.last_change
            return (f"warmup: step {opt.global_step}, {option}='auto' has not frozen the variance yet (its last "
                    f"relative change {'not measured yet' if last is None else format(last, '.3g')}; freezes at "
                    f"most after step {MAX_STEP})")
        return f"warmup: step {opt.global_step} of {option}={value}; full-precision averaging until then"

    def warn_uncompressed(self, when: str) -> None:
        """Warn once that `when` (a checkpoint, the end of the run) comes before any compression."""
        if self._warned_uncompressed or self.frozen or self.opt.global_step == 0:
            return
        why, option = self.not_compressing(), self.freeze_option
        if why is None or why.startswith("one rank"):
            return
        self._warned_uncompressed = True
        fix = ("" if self.opt._option(option) == AUTO else
               f". If the run is shorter than {option}, set it below the run's length, or to 'auto'")
        warnings.warn(f"{type(self.opt).__name__}: {when} after {self.opt.global_step} steps without ever "
                      f"compressing ({why}); every step so far averaged the gradients in full precision{fix}",
                      NotCompressedWarning, stacklevel=3)

    def watch_lr(self, option: str = "freeze_step") -> None:
        """Log a warning, once, when a group's lr in the compression stage rises above
        LR_RISE times its lr at the first step this is called at (the one after the freeze,
        `option`, the optimizer's freeze option; after a resume, the first in this process):
        the variance frozen while the lr was still warming up under-preconditions the larger
        steps, which costs the top lrs (docs/optimizers.md, "Same hyperparameters as the
        twin"); the fix is freeze_step at the end of the lr warmup."""
        if self._warned_lr_rise:
            return
        lrs = [g["lr"] for g in self.opt.param_groups]
        if self._freeze_lrs is None or len(self._freeze_lrs) != len(lrs):
            self._freeze_lrs = lrs
            return
        rose = [i for i, (now, then) in enumerate(zip(lrs, self._freeze_lrs)) if then > 0 and now > LR_RISE * then]
        if rose:
            i = rose[0]
            _log.warning("%s: the lr of param group %s rose from %.3g at the freeze (step %s) to %.3g: the variance "
                         "was frozen while the lr was still warming up, which costs convergence at the larger lrs; "
                         "set %s to the end of the lr warmup", type(self.opt).__name__, i,
                         self._freeze_lrs[i], self.opt._option(option), lrs[i], option)
            self._warned_lr_rise = True

    def log_freeze(self, L: FlatLayout) -> None:
        opt, name = self.opt, type(self.opt).__name__
        exact, below = self.masks.counts
        p = opt.transport.world_size
        if self.reducer is not None:
            sent = self.bytes_per_step()
            part = self.exact.part(L)
            fp32 = ring_allreduce_bytes(4 * L.total, p)
            _log.info("%s: the compression stage sends %s bytes per step and rank (compressed allreduce %s + "
                      "exact parameters %s + finiteness agreement %s) against %d for an fp32 ring allreduce of the "
                      "gradients: %.1fx less", name, sent["total"], sent["compressed"], sent["exact"],
                      sent["agreement"], fp32, fp32 / sent["total"])
            if part is not None:
                report_exact_share(_log, name, "momentum", part[0].numel(), L.total, self.exact.limit)
        _log.info("%s: variance frozen after step %s; from now on one compressed allreduce of %s momentum elements "
                  "per step over %s ranks (block_size %s); %s coordinates held at zero (variance exactly zero: %s, "
                  "at most mask_threshold x mean: %s, user masks: %s params)", name, opt.global_step, L.total, p,
                  self.comm.block_size, self.masked_coordinates, exact, below, len(self.masks.user))

    def stats(self) -> Dict[str, Any]:
        """The reducer's `lbcomm.common.compressor_stats` and ``status``: "compressing", or
        why nothing is compressed (`not_compressing`)."""
        return {**compressor_stats(self.reducer), "status": self.not_compressing() or "compressing"}

    def bytes_per_step(self) -> Optional[Dict[str, int]]:
        """What this rank sends per compression-stage step (see `OneBitAdam.bytes_per_step`);
        None before the freeze and with one rank, with a warning, once, that says why."""
        L, st = self.opt._layout, self.reducer
        if st is None or L is None:
            why = self.not_compressing() or "no step taken yet"
            if not self._warned_none:
                self._warned_none = True
                warnings.warn(f"{type(self.opt).__name__}.bytes_per_step() is None: nothing is compressed yet ({why})",
                              NotCompressedWarning, stacklevel=3)
            return None
        p = self.opt.transport.world_size
        part = self.exact.part(L)
        k = 0 if part is None else part[0].numel()
        out = {"compressed": int(st.bytes_per_call(checked=True)), "exact": self.exact.exact_mean().bytes(k),
               # one fp32 scalar, + the optimizer's own slots (rescale_variance: one per parameter)
               "agreement": int(ring_allreduce_bytes(4 * (1 + self.opt._local_slots(L)), p))}
        out["total"] = sum(out.values())
        return out

    # ------------------------------------------------------------------ the compressed momentum
    def grads_finite(self, L: FlatLayout) -> bool:
        """Whether every rank's local gradients are finite, agreed with ONE scalar allreduce
        of the per-parameter sums (a NaN or Inf anywhere makes the sum non-finite); only when
        a sum overflows, a second allreduce counts the non-finite elements exactly. Riding in
        the same allreduce: the exact parameters' gradients (flat reduction), gradient_stats'
        sample, and the optimizer's `_local_slots` (handed back by `_reduced_local_slots`)."""
        opt = self.opt
        grads = []
        for i in range(len(L.params)):
            g = L.grad(i)
            if g is not None:
                if g.is_sparse:
                    raise RuntimeError(f"{type(opt).__name__} does not support sparse gradients")
                grads.append(g)
        dev, tr = opt._device(L), opt.transport
        probe = self._probe and opt._detecting()
        head = 1 + (2 * tr.world_size if probe else 0)
        part = self.exact.part(L) if self.topology is None else None  # summed here when averaged over this group
        k = 0 if part is None else part[0].numel()
        ride = self.stats_ride
        n_ride = 0 if ride is None else ride.numel()
        n_own = opt._local_slots(L)
        total = torch.zeros(head + k + n_ride + n_own, dtype=torch.float32, device=dev)
        if n_own:  # the optimizer's values ride along, and their sum is the finiteness check
            own = total[head + k + n_ride:]
            opt._fill_local_slots(L, None, own)
            total[:1] += own.sum()
        elif grads:
            total[:1] += torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum()
        if probe:  # the first compression step: every rank's checksum rides along
            total[1:head] = agree.replica_slots(grads, tr.rank, tr.world_size, dev)
        if part is not None:
            self.exact.grads(L, part[1], out=total[head:head + k])
        if ride is not None:
            total[head + k:head + k + n_ride].copy_(ride)
        tr.all_reduce(total, op="sum")
        self.exact.fused_sum = None if part is None else total[head:head + k]
        if ride is not None:
            self.stats_ride, self._stats_mean = None, total[head + k:head + k + n_ride].div_(tr.world_size)
        if n_own:
            opt._reduced_local_slots(L, total[head + k + n_ride:].div_(tr.world_size))
        if opt._sharded():  # the shards' sums too: a NaN in one shard skips the step on every rank
            opt.shard_transport.all_reduce(total[:1], op="sum")
        if bool(torch.isfinite(total[:1]).all()):
            if probe:
                self._probe = not opt._check_replicas(total[1:head], "compression")
            return True
        bad = torch.zeros(1, dtype=torch.float64, device=dev)
        for g in grads:
            bad += (~torch.isfinite(g)).sum()
        tr.all_reduce(bad, op="sum")
        if opt._sharded():
            opt.shard_transport.all_reduce(bad, op="sum")
        return int(bad.item()) == 0

    def take_stats_mean(self) -> Optional[Tensor]:
        """gradient_stats' sample averaged by `grads_finite` (None when it did not run)."""
        mean, self._stats_mean = self._stats_mean, None
        return mean

    def stats_ride_only(self) -> Optional[Tensor]:
        """The sample that did not ride (a step without the agreement; None when it rode)."""
        ride, self.stats_ride = self.stats_ride, None
        return ride

    def momentum_source(self, L: FlatLayout, scale: Optional[Tensor] = None) -> Source:
        """source(lo, hi, buf): buf = (b1 m + (1-b1) g_local)[lo:hi], times scale[p] per
        parameter if given, straight from m and each parameter's .grad (None counts as zero)."""
        opt = self.opt
        m = opt._flat["exp_avg"]
        weights = [1 - opt.param_groups[gi]["betas"][0] for gi in L.group_of]

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

        source.momentum = (m, weights, scale)  # for the exact parameters (ExactPart.mean)
        return source

    def step_and_reduce(self, L: FlatLayout, include: List[bool], source: Source, sink: Sink,
                        factors_of: Optional[Callable[[List[bool]], Optional[list]]] = None,
                        scale: Optional[Tensor] = None):
        """A compressed step's start, in the order the caps need: max_update's bounds, the
        `include`d parameters' step counts advanced (`segs`), rescale's factors
        (`factors_of`, once the counts have advanced), then `reduce_momentum` under
        `decode_caps`. A skipped reduction puts the step counts back, so the state is as it
        was. Returns (applied, bounds, segs, factors)."""
        opt = self.opt
        bounds = self.update_bounds(L)
        steps = opt._vectors["step"].clone()
        segs = opt._segments(L, include, vstep="variance_step")
        factors = None if factors_of is None else factors_of(include)
        applied = self.reduce_momentum(L, source, sink, self.decode_caps(L, segs, factors, bounds, scale))
        if not applied:
            opt._vectors["step"].copy_(steps)
        return applied, bounds, segs, factors

    def reduce_momentum(self, L: FlatLayout, source: Source, sink: Sink, cap: Optional[Source] = None) -> bool:
        """The compressed allreduce of the new momentum, the one place that meets it: the
        input comes from `source`, the masked result goes to `sink` (a tensor decoded into,
        or a callable sink(lo, hi, values) called range by range in order). Returns False,
        with `sink` untouched, when the result is non-finite (on every rank alike).

        The caller has agreed with every rank that the inputs are finite (`grads_finite`),
        so the call skips its own agreement; a result that still overflows is refused on
        every rank (the compression errors are then reset, see lbcomm.compressed). `cap`
        (`decode_caps`) bounds the decoded values per coordinate."""
        n = L.total
        if self.reducer is None:  # one rank: nothing to reduce
            stage = self.stage_buffer(L)
            for lo in range(0, n, STAGE):
                hi = min(n, lo + STAGE)
                buf = stage[:hi - lo]
                source(lo, hi, buf)
                self._deliver(sink, lo, hi, buf)
            return True
        exact = self.exact.mean(L, source)
        if exact is False:  # the exact mean is not finite: nothing changes on any rank
            applied = False
        elif isinstance(sink, Tensor):  # decoded straight into the sink, then exact values and mask
            applied = self._reduce(source, sink, cap)
            if applied:
                if exact is not None:
                    sink.index_copy_(0, exact[0], exact[2])
                self.mask_range(sink, 0, n)
        else:  # a callable sink sees the exact values already
            applied = self._reduce(source, lambda lo, hi, values: sink(
                lo, hi, values if exact is None else self.exact.put(L, values, lo, hi, exact)), cap)
        if isinstance(exact, tuple):  # their errors stay zero: the exact mean replaced what compression made of them
            self.reducer.zero_errors_at(exact[0])
        if self.opt._sharded():
            self._check_shards_agree(applied)
        return applied

    def _reduce(self, source: Source, sink: Sink, cap: Optional[Source] = None) -> bool:
        try:  # every rank sees every server scale, so all ranks agree on the verdict
            return bool(self.reducer.reduce_(source, sink, checked=True, cap=cap))
        except NonFiniteError:
            return False

    def _deliver(self, sink: Sink, lo: int, hi: int, values: Tensor) -> None:
        if isinstance(sink, Tensor):
            self.mask_range(values, lo, hi)
            if values.data_ptr() != sink[lo:hi].data_ptr():
                sink[lo:hi].copy_(values)
        else:
            sink(lo, hi, values)

    def _check_shards_agree(self, applied: bool) -> None:
        """Sharded: the replicate groups of the other shards reached the same verdict. The
        inputs were agreed finite everywhere, so they differ only when a sum of finite
        momenta overflowed float32 in some shards: then some shards have already committed
        their new momentum and no consistent state is left."""
        opt = self.opt
        flag = torch.tensor([1.0 if applied else 0.0], device=opt._device(opt._layout))
        opt.shard_transport.all_reduce(flag, op="sum")
        if 0 < float(flag) < opt.shard_transport.world_size:
            raise NonFiniteError(f"{type(opt).__name__}: at step {opt.global_step + 1} the compressed momentum "
                                 "overflowed float32 in some shards only (finite momenta whose mean is not); the "
                                 "shards' states now disagree: resume from the last checkpoint with a smaller lr")

    # ------------------------------------------------------------------ checkpoints
    def _topology_key(self) -> Optional[tuple]:
        """(nodes, ranks per node) of the momentum reduction, None when flat."""
        t = self.topology if self.reducer is not None else None
        return None if t is None else (t.nodes, t.local_size)

    def state_dict(self) -> Dict[str, Any]:
        self.warn_uncompressed("a checkpoint was saved")
        return {"frozen": self.frozen, "world_size": self.opt.transport.world_size, "mask": self.masks.mask,
                "user_masks": dict(self.masks.user), "topology": self._topology_key(),
                "compression": None if self.reducer is None else self.reducer.state_dict(),
                "auto_freeze": self.auto.state_dict()}

    def begin_load(self, saved: Dict[str, Any]) -> None:
        """Before the optimizer rebuilds its layout: the freeze (it decides the buffers)."""
        self.frozen = bool(saved["frozen"])
        self.reducer = None
        self.masks.mask, self.masks.user = None, {}
        self.auto.load_state_dict(saved.get("auto_freeze"))

    def finish_load(self, L: Optional[FlatLayout], saved: Dict[str, Any]) -> None:
        """After the layout: masks, and the reducer with this rank's saved errors."""
        if L is None:
            return
        opt, name = self.opt, type(self.opt).__name__
        self.masks.load(L, saved["mask"], saved["user_masks"])
        if not self.frozen:
            return
        opt._grad_buf = None
        self._make_reducer(L)
        errors = saved["compression"]
        topo = tuple(saved["topology"]) if saved["topology"] is not None else None
        if self.reducer is not None and errors is not None and topo != self._topology_key():
            _log.warning("%s: the checkpoint's compression errors belong to the topology (nodes, ranks per node)=%s, "
                         "this run reduces over %s; the compression error buffers start from zero and training "
                         "continues", name, topo or "flat", self._topology_key() or "flat")
        elif self.reducer is not None and errors is not None:
            self.reducer.load_state_dict(errors)  # logs a warning and resets on a layout change
        elif self.reducer is not None or errors is not None:
            _log.warning("%s: the checkpoint was saved with world size %s, this run has %s; the compression error "
                         "buffers start from zero and training continues", name, saved["world_size"],
                         opt.transport.world_size)
