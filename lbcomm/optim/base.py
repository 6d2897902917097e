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
  ride in the same allreduce (``flat_state.local_stat``; rescale_variance's statistic).
* Never silent: with ``comm.detect_averaged_grads``, until it is decided, a per-rank
  checksum of the local gradients rides along the warmup allreduce (`agree`); identical
  checksums on every rank raise `lbcomm.errors.AveragedGradientsError` naming the fix.
* `_after_step`: what follows a successful step (the 1-bit optimizers freeze here).

The flat state itself (layout, buffers, vectors, gradient buffer, device, shard
agreement) is a `FlatState` (``optimizer.flat_state``, `flatstate`); the pieces take it.
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
from . import agree, state, warmup
from .flat import FlatLayout, Segment
from .flatstate import FlatState
from .stepstats import StepStats

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

    The flat state is ``flat_state`` (a `FlatState`); the pieces of an optimizer take it.

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
    # Flat buffers kept in another dtype than fp32 (a statistic's input, never a step's).
    _buffer_dtypes: Dict[str, torch.dtype] = {}
    # Whether the optimizer runs the averaged-gradients probe (comm.detect_averaged_grads).
    _probes_averaged_grads: bool = True
    # Options a param group may set that are not constructor arguments (rarely tuned details).
    GROUP_OPTIONS: tuple = ()

    def __init__(self, params, defaults: Dict[str, Any], comm: Optional[CommConfig] = None):
        self.comm = resolve(comm, type(self).__name__)
        self._onebit = None  # the OneBitStage of a 1-bit optimizer (set by it after this __init__)
        self._validate_group(defaults)
        self._transport = None
        self._grads_averaged = False
        self.flat_state = FlatState(type(self).__name__, self.comm, self._current_groups, defaults,
                                    self._current_transport, self._param_vectors, self._buffer_names,
                                    self._probes_averaged_grads, self._buffer_dtypes)
        self.flat_state.layout_listeners.append(self._views_on_layout)  # the stage and others add their own
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._loading: Optional[tuple] = None
        self._probe_warmup = True  # the warmup check for averaged gradients is still to be decided
        self._stats = StepStats(self.flat_state)  # gradient_stats, fed by each step
        if self.process_group is not None:  # a group without its backend is an error now, not at step 1
            self.transport  # noqa: B018
        super().__init__(params, defaults)
        # torch calls each hook with the optimizer first: registered unbound, they pickle and deep-copy
        self.register_state_dict_post_hook(BaseOptimizer._save_entry)
        self.register_load_state_dict_pre_hook(BaseOptimizer._check_entry)
        self.register_load_state_dict_post_hook(BaseOptimizer._load_entry)

    def _current_groups(self) -> List[Dict[str, Any]]:
        return self.param_groups

    def _current_transport(self):
        return self.transport

    # the flat state under its old names (tests and bench read them; `flat_state` is the object)
    @property
    def _flat(self) -> Dict[str, Tensor]:
        return self.flat_state.buffers

    @property
    def _vectors(self) -> Dict[str, Tensor]:
        return self.flat_state.vectors

    @property
    def _layout(self) -> Optional[FlatLayout]:
        return self.flat_state.layout

    @property
    def _grad_buf(self) -> Optional[Tensor]:
        return self.flat_state.grad_buf

    @_grad_buf.setter
    def _grad_buf(self, value: Optional[Tensor]) -> None:
        self.flat_state.grad_buf = value

    @property
    def _global_step(self) -> int:
        return self.flat_state.global_step

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
        if self.flat_state.layout is not None:
            self.flat_state.stale = True

    def _option(self, name: str) -> Any:
        """A global hyperparameter: every group holds the same value (checked in add_param_group)."""
        return self.flat_state.option(name)

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
    def gradient_stats(self):
        """The `lbcomm.stats.GradientNoiseScale` every step feeds (`lbcomm.optim.stepstats`), or None."""
        return self._stats.tracker

    @gradient_stats.setter
    def gradient_stats(self, tracker) -> None:
        self._stats.tracker = tracker

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
        if self.flat_state.local_stat is not None:
            self.flat_state.local_stat.note(params, grads)

    @property
    def global_step(self) -> int:
        """Steps taken so far (skipped steps do not count)."""
        return self.flat_state.global_step

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
        return self.flat_state.shard_transport

    # ------------------------------------------------------------------ layout
    def _views_on_layout(self, old: Optional[FlatLayout], new: FlatLayout) -> None:
        """The layout changed from `old` (None: first) to `new`: attach the views."""
        self._attach_views()

    def _attach_views(self) -> None:
        """Expose the flat state per parameter, as torch optimizers do (views, no copies)."""
        state.attach_views(self.flat_state, self.state)

    def _prepare(self) -> FlatLayout:
        """The layout for this step (rebuilt when a parameter started requiring grad)."""
        return state.prepare(self.flat_state, None if self._onebit is None else self._onebit.check_layout_change)

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
        pending, taken = self._stats.begin(L, self._onebit, self._grads_averaged), False
        try:
            taken = self._take_step(L)
        finally:
            self._stats.finish(pending, not taken)
        if not taken:
            self.last_step_skipped = True
            self.skipped_steps += 1
            return loss
        fs = self.flat_state
        fs.global_step += 1
        was_frozen = self.frozen
        self._after_step(L)
        if self._onebit is not None and (fs.global_step == 1 or self.frozen != was_frozen):
            agree.check_params_identical(fs, L)  # the 1-bit optimizers' replicas must stay bitwise identical
        return loss

    def _take_step(self, L: FlatLayout) -> bool:
        """One step; False when it was skipped (non-finite, comm.nonfinite='skip')."""
        return self._warmup_step(L)

    def _after_step(self, L: FlatLayout) -> None:
        """Runs after every step taken (not after skipped ones)."""

    # ---------------------------------------------------------- the warmup
    @staticmethod
    def _device(L: FlatLayout) -> torch.device:
        return FlatState.device_of(L)

    def _warmup_step(self, L: FlatLayout) -> bool:
        """Average the gradients (`warmup.average_grads`), then the update (`_warmup_update`)."""
        fs = self.flat_state
        buf, decided = warmup.average_grads(fs, L, self._grads_averaged, self.frozen,
                                            self._check_replicas if self._probe_warmup else None)
        if decided is not None:
            self._probe_warmup = not decided
        self._stats.note_averaged(buf, L.total, self._grads_averaged)  # the global norm for lbcomm.stats
        # Every rank holds the same average (or, with a DDP hook, the same averaged grads),
        # so every rank reaches the same verdict here (sharded: the shard group agrees too).
        if not fs.over_shards(bool(torch.isfinite(buf).all())):
            return self._nonfinite("the averaged gradients")
        active = (buf[L.total:] > 0).tolist()
        self._warmup_update(L, active)
        return True

    def _detecting(self) -> bool:
        """Whether this optimizer checks for gradients that arrive averaged already."""
        return self.flat_state.detecting()

    def _check_replicas(self, slots: Tensor, stage: str) -> bool:
        """`FlatState.check_replicas` (`Lars` and `DecentLaM` word the error their own way)."""
        return self.flat_state.check_replicas(slots, stage)

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
        return self.flat_state.segments(L, include, vstep)

    # the warmup math of Lamb and OneBitLamb goes through these two (a subclass may override them)
    def _bias_corrections(self, group: Dict[str, Any], seg: Segment):
        return self.flat_state.bias_corrections(group, seg)

    def _moments(self, seg: Segment, decay_steps: int = 1) -> None:
        self.flat_state.moments(seg, decay_steps)

    def _warmup_update(self, L: FlatLayout, active: List[bool]) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoints (see `state`)
    def _save_entry(self, sd: Dict[str, Any]) -> Dict[str, Any]:
        """torch's state-dict post hook: the ``"lbcomm"`` entry."""
        sd["lbcomm"] = self._extra_state()
        return sd

    def _check_entry(self, sd: Dict[str, Any]) -> Dict[str, Any]:
        """torch's load pre hook: check the entry, keep the per-parameter state for the post hook."""
        self._loading, sd = state.check_loadable(type(self).__name__, state.state_class(self),
                                                 self._onebit is not None, sd)
        return sd

    def _load_entry(self) -> None:
        """torch's load post hook: rebuild the flat state bit for bit (`_load_extra_state`)."""
        saved, extra = self._loading
        self._loading = None
        self._load_extra_state(saved, extra)

    def _buffer_names(self) -> tuple:
        """The flat buffers the state holds now (the 1-bit optimizers add some at the freeze)."""
        return self._flat_buffers

    def rank_local_buffers(self) -> Dict[str, Tensor]:
        """The flat state buffers that differ between ranks (OneBitLamb's ``exp_avg_local``),
        besides the compression error feedback (`compression_state`): what a framework
        callback that restores rank 0's optimizer state on every rank must save and restore
        per rank, with `load_rank_local_buffers`. Empty when there are none (yet)."""
        flat = self.flat_state.buffers
        return {n: flat[n] for n in self._rank_local_buffers if n in flat}

    def load_rank_local_buffers(self, saved: Optional[Dict[str, Tensor]], all_ranks=None) -> None:
        """Restore this rank's `rank_local_buffers` from `saved` (what this rank saved).
        `all_ranks`: every saved rank's, in rank order, for a resume with another world
        size: each buffer becomes their mean. None (a checkpoint without them): each starts
        as it does at the freeze (`_reset_rank_local`), with a logged warning."""
        state.load_rank_local(type(self).__name__, self.rank_local_buffers(), saved, all_ranks,
                              self._reset_rank_local)

    def _reset_rank_local(self, names) -> None:
        """Start the named rank-local buffers as at the freeze (subclasses with some)."""
        raise NotImplementedError

    def _extra_state(self) -> Dict[str, Any]:
        """State that is not per parameter (subclasses extend)."""
        extra = state.extra_state(self.flat_state, state.state_class(self), self.skipped_steps,
                                  self.rank_local_buffers())
        if self._onebit is not None:
            extra.update(self._onebit.state_dict())
        return extra

    def _load_extra_state(self, saved: Dict[Any, Dict[str, Tensor]], extra: Dict[str, Any]) -> None:
        """Rebuild the state from a loaded state dict (subclasses extend)."""
        if self._onebit is not None:
            self._onebit.begin_load(extra)
        self.skipped_steps = int(extra["skipped_steps"])
        state.restore(self.flat_state, saved, extra)
        if self.flat_state.layout is not None:
            self._attach_views()
        if self._onebit is not None:
            self._onebit.finish_load(self.flat_state.layout, extra)
