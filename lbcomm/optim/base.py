"""What every lbcomm optimizer shares: the flat fp32 state with per-parameter views, the
warmup's gradient averaging, the non-finite policy, the step skeleton and the checkpoint
format. The update math is in `functional`; the 1-bit machinery is the `OneBitStage`
component (`onebit`) that the 1-bit optimizers hold.

`BaseOptimizer` per step:

* warmup (every step of `Lamb` and `Lars`; steps 1 .. freeze_step of the 1-bit
  optimizers): copy the local gradients into one flat fp32 buffer, average it over the
  ranks through the transport (`lbcomm.comm`, one ``all_reduce`` per bucket of
  ``comm.bucket_cap_mb``, a per-parameter "has a gradient" flag riding along in the last
  bucket), skip (or raise on) the step on every rank if the average holds NaN/Inf, then let
  the optimizer update moments and parameters (`_warmup_update`, math in `functional`). A
  DDP communication hook that has already averaged the gradients sets `grads_averaged` and
  the optimizer does not communicate. An optimizer may let per-parameter values of its own
  ride in the same allreduce (`_local_slots`; rescale_variance's statistic).
* Never silent: with ``comm.detect_averaged_grads``, until it is decided, a per-rank
  checksum of the local gradients rides along the warmup allreduce (`agree`); identical
  checksums on every rank raise `lbcomm.errors.AveragedGradientsError` naming the fix.
* `_after_step`: what follows a successful step (the 1-bit optimizers freeze here).

State: ``optimizer.state[p]`` holds views into the flat buffers (``exp_avg``,
``exp_avg_sq``, ...) and fp32 scalars (``step``, ...), as torch optimizers do, and torch's
`state_dict` carries them; hyperparameters live in the param groups and round-trip as in
torch; what is not per parameter is added under the ``"lbcomm"`` key (`state`).

The checkpoint format and its versioning: `lbcomm.optim.state`.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..comm import get_transport
from ..compressed import NonFiniteError
from ..config import CommConfig, resolve
from . import agree
from . import functional as F
from . import state
from .flat import FlatLayout, Segment, segments

__all__ = ["BaseOptimizer"]

_log = logging.getLogger(__name__)


class BaseOptimizer(Optimizer):
    """Base class of the lbcomm optimizers: flat fp32 state with per-parameter views, warmup
    gradient averaging, the step skeleton and the checkpoint hooks.

    Subclasses pass their hyperparameters in `defaults` (each param group keeps its own
    copy, so they round-trip through `state_dict`), extend `_validate_group`, list the
    hyperparameters that must agree across groups in `_GLOBAL_OPTIONS`, and implement
    `_warmup_update`. Communication settings come from `comm` (a `lbcomm.CommConfig`,
    one per optimizer). A 1-bit optimizer sets `_onebit` to its `OneBitStage`.

    Sharded parameters (FSDP2, `lbcomm.fsdp.onebit_optimizer`): DTensor parameters are
    updated through their local shards; per-tensor values (LAMB's norms, the bounds, the
    verdicts) are agreed over ``comm.shard_group`` (`agree`), and the shards are averaged
    (or compressed) over ``comm.process_group``, the replicate group.

    Attributes:
        comm (lbcomm.CommConfig): the communication settings.
        last_step_skipped (bool): the last `step` saw NaN/Inf (on any rank) and changed nothing.
        skipped_steps (int): how many steps were skipped so far.
        gradient_stats (lbcomm.stats.GradientNoiseScale or None): set it to have every step
            feed the gradient noise statistics (exact in warmup, from the averaged gradient;
            a coordinate sample in the compression stage; with a DDP hook averaging the
            warmup gradients, `lbcomm.stats.stats_hook` measures them instead); one small
            async allreduce per step (default: None).
    """

    # Hyperparameters that describe the whole flat buffer, not one group: every group must agree.
    _GLOBAL_OPTIONS: tuple = ()
    # Flat state buffers from the first step on, and fp32 scalars per parameter (initial value).
    _flat_buffers: tuple = ("exp_avg", "exp_avg_sq")
    _param_vectors: Dict[str, float] = {"step": 0.0}
    # Flat buffers whose values differ between ranks (`rank_local_buffers`).
    _rank_local_buffers: tuple = ()
    # Whether the optimizer runs the averaged-gradients probe (comm.detect_averaged_grads).
    _probes_averaged_grads: bool = True
    # Options a param group may set that are not constructor arguments (rarely tuned details).
    GROUP_OPTIONS: tuple = ()

    def __init__(self, params, defaults: Dict[str, Any], comm: Optional[CommConfig] = None):
        self.comm = resolve(comm, type(self).__name__)
        self._onebit = None  # the OneBitStage of a 1-bit optimizer (set by it after this __init__)
        self._validate_group(defaults)
        self._shard_transport = None
        self._transport = None
        self._grads_averaged = False
        self._layout: Optional[FlatLayout] = None
        self._layout_stale = False
        self._flat: Dict[str, Tensor] = {}
        self._vectors: Dict[str, Tensor] = {}
        self._grad_buf: Optional[Tensor] = None
        self._global_step = 0
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._loading: Optional[tuple] = None
        self._probe_warmup = True  # the warmup check for averaged gradients is still to be decided
        self.gradient_stats = None  # a lbcomm.stats.GradientNoiseScale to feed each step (see `_stats_begin`)
        self._stats_gsq: Optional[Tensor] = None  # this warmup step's |averaged gradient|^2, for gradient_stats
        if self.process_group is not None:  # a group without its backend is an error now, not at step 1
            self.transport  # noqa: B018
        super().__init__(params, defaults)
        self.register_state_dict_post_hook(state.save_hook)
        self.register_load_state_dict_pre_hook(state.load_pre_hook)
        self.register_load_state_dict_post_hook(state.load_post_hook)

    # ------------------------------------------------------------------ options
    @property
    def process_group(self):
        """The group (or mpi4py communicator) gradients are averaged over (``comm.process_group``)."""
        return self.comm.process_group

    @property
    def shard_group(self):
        """The group of the other shards of the same parameters (``comm.shard_group``; None: unsharded)."""
        return self.comm.shard_group

    def _validate_group(self, group: Dict[str, Any]) -> None:
        """Raise ValueError for an invalid hyperparameter of one param group (subclasses extend)."""
        lr, eps, betas, wd = group["lr"], group["eps"], group["betas"], group["weight_decay"]
        if isinstance(lr, Tensor):
            raise ValueError(f"Invalid learning rate: {lr} (a Tensor lr is not supported; use a float)")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= wd:
            raise ValueError(f"Invalid weight_decay value: {wd}")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group (see torch.optim.Optimizer.add_param_group). Hyperparameters in
        `_GLOBAL_OPTIONS` must equal those of the first group; a 1-bit optimizer takes new
        groups during the warmup only (its compressed momentum has a fixed layout)."""
        if self._onebit is not None:
            self._onebit.check_layout_change("add a param group")
        self._validate_group({**self.defaults, **param_group})
        first = self.param_groups[0] if self.param_groups else self.defaults
        for name in self._GLOBAL_OPTIONS:
            if name in param_group and param_group[name] != first[name]:
                raise ValueError(f"{type(self).__name__}: {name} must be the same for all param groups (the whole "
                                 f"model shares one flat buffer); got {param_group[name]!r} != {first[name]!r}")
        super().add_param_group(param_group)
        if self._layout is not None:
            self._layout_stale = True

    def _option(self, name: str) -> Any:
        """A global hyperparameter: every group holds the same value (checked in add_param_group)."""
        return self.param_groups[0][name] if self.param_groups else self.defaults[name]

    # ------------------------------------------------------------------ public API
    @property
    def grads_averaged(self) -> bool:
        """Whether the gradients reaching `step` in the warmup are already the mean over the
        ranks (set by a DDP communication hook that averaged them); then the optimizer does
        not allreduce them. In the compression stage gradients are always taken as local.
        (default: False)"""
        return self._grads_averaged

    @grads_averaged.setter
    def grads_averaged(self, value: bool) -> None:
        self._grads_averaged = bool(value)

    @property
    def frozen(self) -> bool:
        """True once a 1-bit optimizer's variance is frozen: every following step keeps the
        gradients local and compresses the momentum, so a warmup hook must not communicate
        (never for `Lamb` and `Lars`)."""
        return self._onebit is not None and self._onebit.frozen

    def note_local_grads(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        """Called by a warmup hook with local gradients before it averages them; a no-op for
        optimizers that need nothing from them (rescale_variance keeps their squared norms,
        which the averaged gradients no longer hold)."""
        if self._local_stat is not None:
            self._local_stat.note(params, grads)

    @property
    def global_step(self) -> int:
        """Steps taken so far (skipped steps do not count)."""
        return self._global_step

    @property
    def transport(self):
        """The `lbcomm.comm` transport of ``comm.process_group`` on ``comm.backend`` (made on first use)."""
        if self._transport is None:
            self._transport = get_transport(self.process_group, backend=self.comm.backend)
        return self._transport

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """Clip the gradients of this optimizer's parameters by a norm that is the same on
        every rank, with at most one scalar allreduce; call it between backward and `step`
        instead of ``torch.nn.utils.clip_grad_norm_``. Returns the norm used (a 0-dim fp32
        tensor, identical on every rank). Details: `lbcomm.optim.agree.clip_grad_norm_`."""
        return agree.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    # ------------------------------------------------------------------ sharded parameters (see `agree`)
    @property
    def shard_transport(self):
        """The transport of ``comm.shard_group`` (None when the parameters are not sharded)."""
        if self.shard_group is not None and self._shard_transport is None:
            self._shard_transport = get_transport(self.shard_group, backend=self.comm.backend)
        return self._shard_transport

    def _sharded(self) -> bool:
        tr = self.shard_transport
        return tr is not None and tr.world_size > 1

    def _agree_over_shards(self, ok: bool) -> bool:
        return agree.over_shards(self, ok)

    def _per_tensor(self, L: FlatLayout, local: Tensor, op: str = "sum", full: bool = False):
        return agree.per_tensor(self, L, local, op, full)

    # ------------------------------------------------------------------ layout
    def _on_layout(self, old: Optional[FlatLayout], new: FlatLayout) -> None:
        """The layout changed from `old` (None: first) to `new`; remap per-layout state."""
        if self._onebit is not None:
            self._onebit.on_layout(old, new)

    def _attach_views(self) -> None:
        """Expose the flat state per parameter, as torch optimizers do (views, no copies)."""
        state.attach_views(self)

    def _prepare(self) -> FlatLayout:
        """The layout for this step (rebuilt when a parameter started requiring grad)."""
        return state.prepare(self)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """Perform a single optimization step.

        Args:
            closure (Callable, optional): A closure that reevaluates the model
                and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        L = self._prepare()
        self.last_step_skipped = False
        pending, taken = self._stats_begin(L), False
        try:
            taken = self._take_step(L)
        finally:
            self._stats_finish(L, pending, not taken)
        if not taken:
            self.last_step_skipped = True
            self.skipped_steps += 1
            return loss
        self._global_step += 1
        was_frozen = self.frozen
        self._after_step(L)
        if self._onebit is not None and (self._global_step == 1 or self.frozen != was_frozen):
            agree.check_params_identical(self, L)  # the 1-bit optimizers' replicas must stay bitwise identical
        return loss

    def _take_step(self, L: FlatLayout) -> bool:
        """One step; False when it was skipped (non-finite, comm.nonfinite='skip')."""
        return self._warmup_step(L)

    def _after_step(self, L: FlatLayout) -> None:
        """Runs after every step taken (not after skipped ones)."""

    # ---------------------------------------------------------- gradient statistics (lbcomm.stats)
    def _stats_begin(self, L: FlatLayout):
        """With ``gradient_stats`` set and the local gradients at hand (warmup without a DDP
        hook, or the compression stage), start the small async allreduce of this step's
        measurement: exact in warmup (the averaged gradient gives the global norm), a
        coordinate sample in the compression stage (riding in the 1-bit stage's finiteness
        agreement with several ranks)."""
        stats = self.gradient_stats
        if stats is None or (self._grads_averaged and not self.frozen):
            return None  # no statistics, or a DDP hook (lbcomm.stats.stats_hook) measures them
        if self.frozen and self.transport.world_size > 1:
            self._onebit.stats_ride = stats.measure([p.grad for p in L.params], exact=False)
            return "ride"
        return (not self.frozen), stats.begin([p.grad for p in L.params], self.transport, exact=not self.frozen)

    def _stats_finish(self, L: FlatLayout, pending, skipped: bool) -> None:
        if pending == "ride":
            mean, ride = self._onebit.take_stats_mean(), self._onebit.stats_ride_only()
            if skipped:  # agreed on every rank: nothing to fold, no collective
                return
            if mean is None:  # a step without the agreement (ZeroOneAdam's variance steps): an allreduce of its own
                mean = ride
                self.transport.all_reduce(mean, op="mean")
            self.gradient_stats.observe(mean, self.transport.world_size)
            return
        if pending is None or pending[1] is None:
            return
        exact, work = pending
        gsq, self._stats_gsq = self._stats_gsq, None
        self.gradient_stats.finish(work, gsq, fold=not skipped and (gsq is not None or not exact))

    # ---------------------------------------------------------- the warmup
    # the component whose per-step values ride in the step's one small collective (the
    # warmup allreduce, the finiteness agreement): slots(L), fill(L, buf, out), reduced(L,
    # mean) and note(params, grads); rescale_variance's `VarianceRescale`, or None
    _local_stat = None

    def _local_slots(self, L: FlatLayout) -> int:
        """Per-step values of the optimizer's own that ride in the warmup allreduce (and are
        averaged with the gradients): how many (default: none)."""
        return 0 if self._local_stat is None else self._local_stat.slots(L)

    def _fill_local_slots(self, L: FlatLayout, buf: Optional[Tensor], out: Tensor) -> None:
        """Write this rank's `_local_slots` values into `out` (buf: the local flat gradients,
        None: each parameter's .grad)."""
        if self._local_stat is not None:
            self._local_stat.fill(L, buf, out)

    def _reduced_local_slots(self, L: FlatLayout, slots: Tensor) -> None:
        """The `_local_slots` after the allreduce (the ranks' mean; local with `grads_averaged`)."""
        if self._local_stat is not None:
            self._local_stat.reduced(L, slots)

    def _collect_grads(self, L: FlatLayout) -> Tensor:
        """Copy every gradient into the flat fp32 buffer (zeros where a parameter has none)
        and set the has-grad flags after it. Returns buffer and flags (the buffer holds
        `_local_slots` more slots and 2 x world_size for `agree.replica_slots`)."""
        n, k = len(L.params), self._local_slots(L)
        size = L.total + n + k + (2 * self.transport.world_size if self._detecting() else 0)
        if self._grad_buf is None or self._grad_buf.numel() != size:
            self._grad_buf = torch.empty(size, dtype=torch.float32, device=self._device(L))
        buf = self._grad_buf[:L.total + n]
        flags = []
        for i in range(n):
            view = L.view(buf, i)
            g = L.grad(i)
            if g is None:
                view.zero_()
                flags.append(0.0)
            else:
                if g.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                view.copy_(g)
                flags.append(1.0)
        if flags:
            buf[L.total:].copy_(torch.tensor(flags, dtype=torch.float32))
        if k and not self._grads_averaged:
            self._fill_local_slots(L, buf, self._grad_buf[L.total + n:L.total + n + k])
        return buf

    @staticmethod
    def _device(L: FlatLayout) -> torch.device:
        return L.params[0].device if L.params else torch.device("cpu")

    def _warmup_step(self, L: FlatLayout) -> bool:
        buf = self._collect_grads(L)
        tr = self.transport
        k = self._local_slots(L)
        if tr.world_size > 1 and not self._grads_averaged:
            probe = self._probe_warmup and self._detecting()
            width = buf.numel() + k
            if probe:  # the checksum slots ride along (undecided steps only)
                self._grad_buf[width:].copy_(agree.replica_slots([buf[:L.total]], tr.rank, tr.world_size, buf.device))
                width = self._grad_buf.numel()
            # sum in buckets, all in flight at once, then divide by the world size
            tr.all_reduce(self._grad_buf[:width], op="mean",
                          bucket_bytes=max(1, int(self.comm.bucket_cap_mb * 2**20)))
            if probe:
                self._probe_warmup = not self._check_replicas(self._grad_buf[buf.numel() + k:], "warmup")
        if k:
            self._reduced_local_slots(L, self._grad_buf[buf.numel():buf.numel() + k])
        if self.gradient_stats is not None and not self._grads_averaged:  # the global norm for lbcomm.stats
            self._stats_gsq = torch.linalg.vector_norm(buf[:L.total]).square()
        # Every rank holds the same average (or, with a DDP hook, the same averaged grads),
        # so every rank reaches the same verdict here (sharded: the shard group agrees too).
        if not self._agree_over_shards(bool(torch.isfinite(buf).all())):
            return self._nonfinite("the averaged gradients")
        active = (buf[L.total:] > 0).tolist()
        self._warmup_update(L, active)
        return True

    def _detecting(self) -> bool:
        """Whether this optimizer checks for gradients that arrive averaged already."""
        return (self._probes_averaged_grads and self.comm.detect_averaged_grads
                and self.transport.world_size > 1)

    def _check_replicas(self, slots: Tensor, stage: str) -> bool:
        """Raise `AveragedGradientsError` when the reduced replica slots say that every rank
        holds the same gradients; return whether the check was decided."""
        same = agree.replicas_identical(slots)
        if same:
            raise agree.averaged_grads_error(type(self).__name__, self._global_step + 1, self.transport.world_size,
                                             stage)
        return same is not None

    def _nonfinite(self, what: str) -> bool:
        msg = (f"{type(self).__name__}: {what} hold NaN or Inf at step {self._global_step + 1} (on at least one "
               "rank); the step was not taken and the optimizer state is unchanged")
        if self.comm.nonfinite == "raise":
            self.last_step_skipped = True
            self.skipped_steps += 1
            raise NonFiniteError(msg + "; pass comm=lbcomm.CommConfig(nonfinite='skip') to skip such steps")
        (_log.warning if self.skipped_steps == 0 else _log.info)("%s; skipping it (nonfinite='skip')", msg)
        return False

    def _segments(self, L: FlatLayout, include: Sequence[bool], vstep: Optional[str] = None) -> List[Segment]:
        """Advance the step count of the included parameters and cut them into runs of one
        group with equal step counts (the bias corrections are then scalars per run); the
        variance's step count is `vstep`'s vector if given (a frozen variance), else the step."""
        idx = [i for i, on in enumerate(include) if on]
        if not idx:
            return []
        steps = self._vectors["step"]
        steps[idx] += 1
        s = steps.tolist()
        return segments(L, include, s, self._vectors[vstep].tolist() if vstep else s)

    def _bias_corrections(self, group: Dict[str, Any], seg: Segment):
        if not group.get("bias_correction", True):
            return 1.0, 1.0
        b1, b2 = group["betas"]
        return 1 - b1 ** seg.step, 1 - b2 ** seg.vstep

    def _moments(self, seg: Segment, decay_steps: int = 1) -> None:
        """Warmup moments of a segment on the averaged gradients; the variance decays by
        beta2^decay_steps (ZeroOneAdam's variance updates cover several steps)."""
        b1, b2 = self.param_groups[seg.group]["betas"]
        sl = slice(seg.lo, seg.hi)
        F.moments_(self._flat["exp_avg"][sl], self._flat["exp_avg_sq"][sl], self._grad_buf[sl], b1,
                   b2 ** decay_steps)

    def _warmup_update(self, L: FlatLayout, active: List[bool]) -> None:
        raise NotImplementedError
    # ------------------------------------------------------------------ checkpoints (see `state`)
    def _param_indices(self) -> Dict[int, int]:
        return state.param_indices(self)

    def _build_layout(self, order: Optional[Sequence[int]] = None) -> FlatLayout:
        return state.build_layout(self, order)

    def _buffer_names(self) -> tuple:
        """The flat buffers the state holds now (the 1-bit optimizers add some at the freeze)."""
        return self._flat_buffers

    def rank_local_buffers(self) -> Dict[str, Tensor]:
        """The flat state buffers that differ between ranks (OneBitLamb's ``exp_avg_local``),
        besides the compression error feedback (`compression_state`): what a framework
        callback that restores rank 0's optimizer state on every rank must save and restore
        per rank, with `load_rank_local_buffers`. Empty when there are none (yet)."""
        return {n: self._flat[n] for n in self._rank_local_buffers if n in self._flat}

    def load_rank_local_buffers(self, saved: Optional[Dict[str, Tensor]], all_ranks=None) -> None:
        """Restore this rank's `rank_local_buffers` from `saved` (what this rank saved).
        `all_ranks`: every saved rank's, in rank order, for a resume with another world
        size: each buffer becomes their mean. None (a checkpoint without them): each starts
        as it does at the freeze (`_reset_rank_local`), with a logged warning."""
        mine = self.rank_local_buffers()
        if not mine:
            return
        if all_ranks is not None:
            saved = {n: state.rank_mean([r[n] for r in all_ranks])
                     for n in mine if all(r is not None and n in r for r in all_ranks)}
        missing = sorted(n for n in mine if saved is None or n not in saved)
        if missing:
            _log.warning("%s: the checkpoint has no rank-local %s; they start from this rank's restored state "
                         "as at the freeze", type(self).__name__, ", ".join(missing))
            self._reset_rank_local(missing)
        for n, buf in mine.items():
            if n in missing:
                continue
            if saved[n].numel() != buf.numel():
                raise ValueError(f"{type(self).__name__}.load_rank_local_buffers: {n} holds {saved[n].numel()} "
                                 f"elements, this optimizer's {buf.numel()} (another model or layout)")
            buf.copy_(saved[n].reshape(-1))

    def _reset_rank_local(self, names) -> None:
        """Start the named rank-local buffers as at the freeze (subclasses with some)."""
        raise NotImplementedError

    def _extra_state(self) -> Dict[str, Any]:
        """State that is not per parameter (subclasses extend)."""
        extra = state.base_extra_state(self)
        if self._onebit is not None:
            extra.update(self._onebit.state_dict())
        return extra

    def _load_extra_state(self, saved: Dict[Any, Dict[str, Tensor]], extra: Dict[str, Any]) -> None:
        """Rebuild the state from a loaded state dict (subclasses extend)."""
        if self._onebit is not None:
            self._onebit.begin_load(extra)
        state.restore(self, saved, extra)
        if self._onebit is not None:
            self._onebit.finish_load(self._layout, extra)
