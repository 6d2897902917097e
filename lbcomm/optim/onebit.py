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
  the gradients averaged exactly, and their errors stay zero (`exact`). max_update's
  bounds are `bounds`; logs, warnings and bytes per step `onebit_report`.

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

import logging
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor

from ..compressed import NonFiniteError
from ..config import OneBitOptions
from ..reduce.inputs import Sink, Source
from ..reducer import make_reducer, resolve_topology
from ..topology import Topology
from . import agree, bounds
from .bounds import left_caps
from .exact import ExactPart
from .flat import FlatLayout
from .freeze import AUTO, AutoFreeze, all_agree, preconditioner
from .functional import STAGE
from .mask import MomentumMask
from .onebit_report import StageReport

__all__ = ["OneBitStage"]

_log = logging.getLogger(__name__)



class OneBitStage:
    """The freeze, the momentum mask, max_update's bound and the compressed momentum
    reduction of a 1-bit optimizer, over its flat state `fs` (a `FlatState` whose buffers
    hold ``exp_avg`` and ``exp_avg_sq`` and whose vectors hold ``step``, ``variance_step``
    and ``max_update_bound``, see `VECTORS`). What it reports (logs, warnings, bytes) is
    its `StageReport`, ``report``.

    Args:
        fs (FlatState): the flat state of the optimizer that holds the stage.
        options (lbcomm.OneBitOptions): max_update, capped_decode and mask_threshold.
        exact_numel (int): parameters of at most this many elements are averaged exactly.
        flat_only (bool): the optimizer runs on the flat reduction only (ZeroOneAdam):
            ``comm.topology`` "auto" resolves to flat, a Topology of several nodes is refused.
        freeze_option (str): the name of the optimizer's freeze option (an int or "auto").
    """

    # per-parameter fp32 vectors the stage keeps in the optimizer's state (initial values);
    # max_update_bound: max_update="warmup"'s U_p, recorded at the freeze (-1: not recorded)
    VECTORS: Dict[str, float] = {"step": 0.0, "variance_step": 0.0, "max_update_bound": -1.0}

    def __init__(self, fs, options: OneBitOptions, *, exact_numel: int, flat_only: bool = False,
                 freeze_option: str = "freeze_step"):
        self.fs = fs
        self.options = options
        self.freeze_option = freeze_option
        self.comm = fs.comm
        spec = self.comm.topology
        if flat_only and isinstance(spec, Topology) and not spec.flat:
            raise ValueError(f"{fs.name} runs on the flat compressed reduction only (its local steps and "
                             f"syncs are not built on the hierarchical one); got {spec}. Leave comm.topology at "
                             "'auto' or 'flat'")
        self.flat_only = flat_only
        self.frozen = False
        self.topology: Optional[Topology] = None  # resolved at the first freeze (None: flat)
        self._topology_resolved = False
        self.reducer = None  # the Reducer of the momentum (None before the freeze and with one rank)
        self.masks = MomentumMask(fs, options.mask_threshold)
        self._stage: Optional[Tensor] = None  # bounded staging buffer (lent to a flat reducer, `_make_reducer`)
        self._warned_no_blocks = False
        self._probe = True  # the compression stage's check for averaged gradients is undecided
        self.exact = ExactPart(self, exact_numel)
        self.stats_ride: Optional[Tensor] = None  # gradient_stats' sample, to ride in grads_finite's allreduce
        self._stats_mean: Optional[Tensor] = None  # ... and its mean over the ranks
        self.auto = AutoFreeze(fs.name, freeze_option)  # freeze_step="auto"'s decision
        self.report = StageReport(self)  # logs, warnings, bytes per step; warned at exit if it never compressed
        fs.layout_listeners.append(self.on_layout)

    # ------------------------------------------------------------------ layout
    def check_layout_change(self, what: str) -> None:
        """Raise once frozen: the compressed momentum buffer has a fixed layout."""
        if self.frozen:
            raise RuntimeError(f"{self.fs.name}: cannot {what} after the freeze (step "
                               f"{self.fs.global_step}): the compressed momentum buffer has a fixed layout. Create "
                               "the optimizer with every group from the start (params without gradients cost "
                               "nothing) and unfreeze parameters during the warmup.")

    def on_layout(self, old: Optional[FlatLayout], new: FlatLayout) -> None:
        """The flat state's layout changed (a `FlatState` layout listener): remap the user
        masks, drop the staging buffer and the exact part."""
        self.masks.on_layout(old, new)
        self._stage = None
        self.exact.reset()

    def participating(self, L: FlatLayout) -> List[bool]:
        """Parameters updated after the freeze: trainable ones that saw a gradient in warmup."""
        steps = self.fs.vectors["step"].tolist()
        return [p.requires_grad and steps[i] > 0 for i, p in enumerate(L.params)]

    def stage_buffer(self, L: FlatLayout) -> Tensor:
        """A bounded fp32 buffer of min(numel, STAGE) elements for staged passes; idle
        during the momentum's reduction, which stages its ranges through it."""
        if self._stage is None:
            self._stage = torch.empty(min(L.total, STAGE), dtype=torch.float32, device=self.fs.device_of(L))
        return self._stage

    # ------------------------------------------------------------------ max_update (see `bounds`)
    def record_update_bounds(self, L: FlatLayout) -> None:
        bounds.record_update_bounds(self.fs, L, self.stage_buffer(L))

    def update_bounds(self, L: FlatLayout) -> List[Optional[float]]:
        return bounds.update_bounds(self.fs, L, self.options.max_update)

    def decode_caps(self, L: FlatLayout, segs, factors, bounds_: List[Optional[float]],
                    scale: Optional[Tensor] = None, on_result: bool = True) -> Optional[Callable[[int, int, Tensor], None]]:
        """`bounds.decode_caps`, None when nothing is capped: one rank, capped_decode False, no
        bound, or no blocks (one scale per tensor; warned once)."""
        if self.reducer is None or self.options.capped_decode is False or all(b is None for b in bounds_):
            return None
        if self.comm.block_size is None:  # asked for explicitly: a warning; by default: info
            if not self._warned_no_blocks:
                self._warned_no_blocks = True
                _log.log(logging.WARNING if self.options.capped_decode else logging.INFO,
                         "%s: the capped decode needs blocks (block_size is None); max_update bounds the step only",
                         self.fs.name)
            return None
        return bounds.decode_caps(self.fs, L, segs, factors, bounds_, scale, on_result)

    # ------------------------------------------------------------------ the mask (see `mask`)
    def set_momentum_mask(self, L: FlatLayout, param: Tensor, mask: Optional[Tensor]) -> None:
        """`OneBitAdam.set_momentum_mask` (see there), `L` the layout of this step."""
        self.masks.set_user(L, param, mask, rebuild=self.frozen)

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
            fs = self.fs
            topo = None if self.flat_only else resolve_topology(self.comm, world_size=fs.transport.world_size,
                                                                who=fs.name)
            self.topology, self._topology_resolved = topo, True
            if topo is not None:
                _log.info("%s: hierarchical momentum reduction on %s", fs.name, topo)
        return self.topology

    def _make_reducer(self, L: FlatLayout) -> None:
        fs = self.fs
        self.reducer = None
        if fs.transport.world_size > 1:
            # non-finite calls are skipped inside: the optimizer applies comm.nonfinite itself
            self.reducer = make_reducer(L.total, self.comm.replace(nonfinite="skip"), device=fs.device_of(L),
                                        topology=self._resolve_topology(), transport=fs.transport)
            # a flat reducer stages its ranges (the momentum's source and sink, the caps)
            # through the stage buffer, idle during the call: one buffer for both
            share = getattr(self.reducer, "share_staging", None)
            if share is not None:
                share(self.stage_buffer(L))

    def freeze(self, L: FlatLayout) -> None:
        """The end of the warmup: variance step, mask, bounds and reducer (the optimizer adds
        its own buffers after this, then attaches the views and calls `log_freeze`)."""
        fs = self.fs
        self.frozen = True
        fs.grad_buf = None  # the compression stage reads the gradients where autograd left them
        fs.vectors["variance_step"].copy_(fs.vectors["step"])
        self.build_mask(L)
        self.record_update_bounds(L)
        self._make_reducer(L)

    def freeze_due(self, L: FlatLayout, vstep: str = "step", check: bool = True) -> bool:
        """Whether the variance is to be frozen after the step just taken: at the step the
        optimizer's freeze option names, or with "auto" when `AutoFreeze` decides (a check only
        where `check`: ZeroOneAdam checks on its variance steps). `vstep`: the vector
        counting the variance's steps (its bias correction)."""
        fs = self.fs
        value, t = fs.option(self.freeze_option), fs.global_step
        if value != AUTO:
            return t >= value
        auto = self.auto
        if auto.decided_at is not None:
            return t >= auto.decided_at
        if not (check and auto.due(t)):
            return False
        auto.sample(L.total, fs.device_of(L))
        return auto.check(t, preconditioner(fs, L, vstep), [g["lr"] for g in fs.param_groups],
                          lambda vote: all_agree(fs, vote))

    def frozen_after(self, done: bool) -> Optional[int]:
        """The step after which the variance was frozen (`done`: it is), else None."""
        if not done:
            return None
        value = self.fs.option(self.freeze_option)
        return self.auto.decided_at if value == AUTO else value

    # ------------------------------------------------------------------ the compressed momentum
    def grads_finite(self, L: FlatLayout) -> bool:
        """Whether every rank's local gradients are finite, agreed with ONE scalar allreduce
        of the per-parameter sums (a NaN or Inf anywhere makes the sum non-finite); only when
        a sum overflows, a second allreduce counts the non-finite elements exactly. Riding in
        the same allreduce: the exact parameters' gradients (flat reduction), gradient_stats'
        sample, and the flat state's ``local_stat`` values (`FlatState.local_slots`)."""
        fs = self.fs
        grads = []
        for i in range(len(L.params)):
            g = L.grad(i)
            if g is not None:
                if g.is_sparse:
                    raise RuntimeError(f"{fs.name} does not support sparse gradients")
                grads.append(g)
        dev, tr = fs.device_of(L), fs.transport
        probe = self._probe and fs.detecting()
        head = 1 + (2 * tr.world_size if probe else 0)
        part = self.exact.part(L) if self.topology is None else None  # summed here when averaged over this group
        k = 0 if part is None else part[0].numel()
        ride = self.stats_ride
        n_ride = 0 if ride is None else ride.numel()
        n_own = fs.local_slots(L)
        total = torch.zeros(head + k + n_ride + n_own, dtype=torch.float32, device=dev)
        if n_own:  # the optimizer's values ride along, and their sum is the finiteness check
            own = total[head + k + n_ride:]
            fs.fill_local_slots(L, None, own)
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
            fs.reduced_local_slots(L, total[head + k + n_ride:].div_(tr.world_size))
        if fs.sharded():  # the shards' sums too: a NaN in one shard skips the step on every rank
            fs.shard_transport.all_reduce(total[:1], op="sum")
        if bool(torch.isfinite(total[:1]).all()):
            if probe:
                self._probe = not fs.check_replicas(total[1:head], "compression")
            return True
        bad = torch.zeros(1, dtype=torch.float64, device=dev)
        for g in grads:
            bad += (~torch.isfinite(g)).sum()
        tr.all_reduce(bad, op="sum")
        if fs.sharded():
            fs.shard_transport.all_reduce(bad, op="sum")
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
        fs = self.fs
        m = fs.buffers["exp_avg"]
        weights = [1 - fs.param_groups[gi]["betas"][0] for gi in L.group_of]

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
                        scale: Optional[Tensor] = None, caps_in_update: bool = False):
        """A compressed step's start, in the order the caps need: max_update's bounds, the
        `include`d parameters' step counts advanced (`segs`), rescale's factors
        (`factors_of`, once the counts have advanced), then `reduce_momentum` under
        `decode_caps`. A skipped reduction puts the step counts back, so the state is as it
        was. Returns (applied, bounds, segs, factors, left): `left` (`bounds.left_caps`, with
        `caps_in_update` and no `scale`) the caps left off `sink` for the caller's update."""
        fs = self.fs
        bounds = self.update_bounds(L)
        steps = fs.vectors["step"].clone()
        segs = fs.segments(L, include, vstep="variance_step")
        factors = None if factors_of is None else factors_of(include)
        caps = self.decode_caps(L, segs, factors, bounds, scale, not caps_in_update or scale is not None)
        applied = self.reduce_momentum(L, source, sink, caps)
        if not applied:
            fs.vectors["step"].copy_(steps)
        return applied, bounds, segs, factors, left_caps(caps, self.exact.part(L))


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
        if self.fs.sharded():
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
        fs = self.fs
        flag = torch.tensor([1.0 if applied else 0.0], device=fs.device)
        fs.shard_transport.all_reduce(flag, op="sum")
        if 0 < float(flag) < fs.shard_transport.world_size:
            raise NonFiniteError(f"{fs.name}: at step {fs.global_step + 1} the compressed momentum "
                                 "overflowed float32 in some shards only (finite momenta whose mean is not); the "
                                 "shards' states now disagree: resume from the last checkpoint with a smaller lr")

    # ------------------------------------------------------------------ checkpoints
    def _topology_key(self) -> Optional[tuple]:
        """(nodes, ranks per node) of the momentum reduction, None when flat."""
        t = self.topology if self.reducer is not None else None
        return None if t is None else (t.nodes, t.local_size)

    def state_dict(self) -> Dict[str, Any]:
        self.report.warn_uncompressed("a checkpoint was saved")
        return {"frozen": self.frozen, "world_size": self.fs.transport.world_size, "mask": self.masks.mask,
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
        fs, name = self.fs, self.fs.name
        self.masks.load(L, saved["mask"], saved["user_masks"])
        if not self.frozen:
            return
        fs.grad_buf = None
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
                         fs.transport.world_size)
