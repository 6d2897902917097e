"""What every lbcomm optimizer shares: option validation, the flat fp32
state with per-parameter views, the warmup's gradient averaging, the non-finite policy,
the step skeleton and the checkpoint format.

`BaseOptimizer` per step:

* warmup (every step of `Lamb`; steps 1 .. freeze_step of the 1-bit optimizers): copy the
  local gradients into one flat fp32 buffer, average it over the ranks through the
  transport (`lbcomm.comm`, one ``all_reduce`` per bucket of bucket_cap_mb, a
  per-parameter "has a gradient" flag riding along in the last bucket), skip the step on
  every rank if the average holds NaN/Inf, then let the subclass update moments and
  parameters (`_warmup_update`, math in `functional`). A DDP communication hook that has
  already averaged the gradients sets `grads_averaged` and the optimizer does not
  communicate.
* Never silent (a misconfigured stack raises instead of training quietly at full
  precision, see `lbcomm.errors`), for optimizers with the ``detect_averaged_grads``
  option: until it is decided, a per-rank checksum of the local gradients (their sum and sum of
  squares) rides along the warmup allreduce in slots of its own (2 floats per rank); if
  every rank sent the same checksum, a DDP without lbcomm's hook has averaged the
  gradients already and `AveragedGradientsError` names the fix. The compression stage
  repeats the check once inside its finiteness agreement (`onebit`).
* `_after_step`: what follows a successful step (the 1-bit optimizers freeze here).

The compression stage of the 1-bit optimizers lives in `onebit`.

State: ``optimizer.state[p]`` holds views into the flat buffers (``exp_avg``,
``exp_avg_sq``, ...) and fp32 scalars (``step``, ...), as torch optimizers do, and torch's
`state_dict` carries them. What is not per parameter (the layout, the step counter, the
freeze, masks, this rank's compression errors) is added under the ``"lbcomm"`` key by a
state-dict post hook and read back by a load pre hook; checkpoints of the version-1
format (everything under ``"lbcomm"``) still load.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..comm import BACKENDS, get_transport
from ..common import FLOAT_DTYPES, NONFINITE_POLICIES
from ..compressed import NonFiniteError
from ..errors import AveragedGradientsError
from . import functional as F
from .flat import FlatLayout, Segment, local_tensor, segments

__all__ = ["BaseOptimizer", "STATE_VERSION"]

_log = logging.getLogger(__name__)

STATE_VERSION = 2  # 1: flat buffers under "lbcomm" (still read); 2: torch's per-parameter state


def grad_norm(g: Tensor) -> Tensor:
    """The L2 norm of a gradient as one flat fp32 vector (one read, no temporary); squared,
    the local statistic of rescale_variance, as lbcomm.optim.reference computes it."""
    return torch.linalg.vector_norm(g.reshape(-1).float())


def local_sq_(L: FlatLayout, flat: Optional[Tensor], out: Tensor) -> Tensor:
    """out[i] = `grad_norm` squared of parameter i's gradient (its view of `flat`, or its
    .grad when flat is None; 0 without one)."""
    norms = []
    for i in range(len(L.params)):
        g = L.view(flat, i) if flat is not None else L.grad(i)
        norms.append(out.new_zeros(()) if g is None else grad_norm(g))
    if norms:
        torch.stack(norms, out=out).square_()
    return out


def replica_slots(tensors: Sequence[Tensor], rank: int, world_size: int, device: torch.device) -> Tensor:
    """2 x world_size fp32 zeros with this rank's checksum of `tensors` (their sum and their
    sum of squares, in fp32) in slots 2 rank, 2 rank + 1. Summed (or averaged) over the
    ranks, slot pair r holds rank r's checksum exactly (x + 0 is exact)."""
    slots = torch.zeros(2 * world_size, dtype=torch.float32, device=device)
    for t in tensors:
        slots[2 * rank] += t.sum(dtype=torch.float32)
        slots[2 * rank + 1] += torch.linalg.vector_norm(t, dtype=torch.float32).square()
    return slots


def replicas_identical(slots: Tensor) -> Optional[bool]:
    """From reduced `replica_slots`: True when every rank's checksum is the same, False when
    they differ, None when undecided (a rank's gradients are all zero or not finite)."""
    rows = slots.view(-1, 2)
    if not bool(torch.isfinite(rows).all()) or not bool((rows[:, 1] > 0).all()):
        return None
    return bool((rows == rows[0]).all())


class BaseOptimizer(Optimizer):
    """Base class of `OneBitAdam`, `Lamb` and `OneBitLamb`: option validation, flat fp32
    state with per-parameter views, warmup gradient averaging, the step skeleton and the
    checkpoint hooks.

    Subclasses pass every option in `defaults` (each param group keeps its own copy, so
    options round-trip through `state_dict`), extend `_validate_group`, list the options
    that must agree across groups in `_GLOBAL_OPTIONS`, and implement `_warmup_update`.

    Sharded parameters (FSDP2, see `lbcomm.fsdp.onebit_optimizer`): DTensor parameters are
    updated through their local shards; `shard_group` holds the ranks with the other shards
    of the same parameters, and everything that is per parameter tensor (LAMB's norms, the
    1-bit optimizers' bounds and momentum scales, the step's non-finite verdict) is agreed
    over it with one small allreduce, while `process_group` is the replicate group the
    shards are averaged (or compressed) over.

    Attributes:
        process_group: the group (or mpi4py communicator) gradients are averaged over.
        shard_group: the group of the other shards of the same parameters (None: unsharded).
        last_step_skipped (bool): the last `step` saw NaN/Inf (on any rank) and changed nothing.
        skipped_steps (int): how many steps were skipped so far.
        gradient_stats (lbcomm.stats.GradientNoiseScale or None): set it to have every step
            feed the gradient noise statistics (exact in warmup, from the averaged gradient;
            a coordinate sample in the compression stage; with a DDP hook averaging the
            warmup gradients, `lbcomm.stats.stats_hook` measures them instead); one small
            async allreduce per step (default: None).
    """

    # Options that describe the whole flat buffer, not one group: every group must agree.
    _GLOBAL_OPTIONS: tuple = ("bucket_cap_mb",)
    # Flat state buffers from the first step on, and fp32 scalars per parameter (initial value).
    _flat_buffers: tuple = ("exp_avg", "exp_avg_sq")
    _param_vectors: Dict[str, float] = {"step": 0.0}

    def __init__(self, params, defaults: Dict[str, Any], *, process_group=None, backend: str = "auto",
                 shard_group=None):
        if backend not in BACKENDS:
            raise ValueError(f"Invalid backend: {backend!r} (use one of {BACKENDS})")
        self._validate_group(defaults)
        self.process_group = process_group
        self.shard_group = shard_group
        self._shard_transport = None
        self.backend = backend
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
        if process_group is not None:  # a group without its backend is an error now, not at step 1
            self.transport  # noqa: B018
        super().__init__(params, defaults)
        self.register_state_dict_post_hook(BaseOptimizer._state_dict_post_hook)
        self.register_load_state_dict_pre_hook(BaseOptimizer._load_state_dict_pre_hook)
        self.register_load_state_dict_post_hook(BaseOptimizer._load_state_dict_post_hook)

    # ------------------------------------------------------------------ options
    def _validate_group(self, group: Dict[str, Any]) -> None:
        """Raise ValueError for an invalid option of one param group (subclasses extend)."""
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
        if "nonfinite" in group and group["nonfinite"] not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid nonfinite policy: {group['nonfinite']!r} (use one of {NONFINITE_POLICIES})")
        if not group["bucket_cap_mb"] > 0:
            raise ValueError(f"Invalid bucket_cap_mb: {group['bucket_cap_mb']} (must be > 0)")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group (see torch.optim.Optimizer.add_param_group). Options in
        `_GLOBAL_OPTIONS` must equal those of the first group."""
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
        """A global option: every group holds the same value (checked in add_param_group)."""
        return self.param_groups[0][name] if self.param_groups else self.defaults[name]

    # ------------------------------------------------------------------ public API
    @property
    def grads_averaged(self) -> bool:
        """Whether the gradients reaching `step` in the warmup are already the mean over the
        ranks (set by a DDP communication hook); then the optimizer does not allreduce them.
        In the compression stage gradients are always taken as local. (default: False)"""
        return self._grads_averaged

    @grads_averaged.setter
    def grads_averaged(self, value: bool) -> None:
        self._grads_averaged = bool(value)

    @property
    def frozen(self) -> bool:
        """True once the variance is frozen (never for `Lamb`)."""
        return False

    def note_local_grads(self, params, grads) -> None:
        """Called by `lbcomm.ddp.warmup_average_hook` with a bucket's parameters and local
        gradients before it averages them (OneBitAdam's rescale_variance keeps their
        squared norms; a no-op otherwise)."""
        if self._tracks_grad_sq():
            self.stash_local_grad_sq(params, grads)

    @property
    def global_step(self) -> int:
        """Steps taken so far (skipped steps do not count)."""
        return self._global_step

    @property
    def transport(self):
        """The `lbcomm.comm` transport of `process_group` on `backend` (made on first use)."""
        if self._transport is None:
            self._transport = get_transport(self.process_group, backend=self.backend)
        return self._transport

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """Clip the gradients of this optimizer's parameters by a norm that is the same on
        every rank, with at most one scalar allreduce; call it between backward and `step`
        instead of ``torch.nn.utils.clip_grad_norm_``.

        * Gradients already averaged over the ranks (warmup with lbcomm's DDP hook, or one
          rank): exactly ``torch.nn.utils.clip_grad_norm_`` (the norm of the averaged
          gradient; no communication).
        * Local gradients (the compression stage of the 1-bit optimizers, or a warmup
          that the optimizer averages itself): N = sqrt(mean_r ||g_r||^2), one scalar
          allreduce, and every rank scales by the same min(1, max_norm / (N + 1e-6)). N
          bounds the norm of the averaged gradient from above (it adds the spread of the
          ranks' gradients), so the gradient that the optimizer effectively averages keeps
          its direction and its norm stays at most max_norm. Clipping each rank's local
          gradient by its own norm instead (what frameworks do) also keeps the mean within
          max_norm, but weighs the ranks unequally and reports rank 0's local norm.

        Args:
            max_norm (float): max norm of the gradients.
            norm_type (float, optional): only 2.0 is supported (default: 2.0).
            error_if_nonfinite (bool, optional): raise if the norm is NaN/Inf (on every
                rank alike) (default: False).

        Returns:
            The norm used (a 0-dim fp32 tensor, identical on every rank): log it as the
            gradient norm.
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"{type(self).__name__}.clip_grad_norm_: only norm_type=2.0 is supported, got {norm_type}")
        if self.shard_group is not None:
            raise NotImplementedError(f"{type(self).__name__}.clip_grad_norm_ does not support sharded (FSDP2) "
                                      "parameters yet; clip with torch.nn.utils.clip_grad_norm_ during the warmup "
                                      "or not at all")
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        tr = self.transport
        if params:
            local = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        else:
            local = torch.zeros((), dtype=torch.float32)
        total = local
        if tr.world_size > 1 and (self.frozen or not self._grads_averaged):
            sq = local.float().square().reshape(1)
            tr.all_reduce(sq, op="mean")
            total = sq.sqrt().reshape(())
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"{type(self).__name__}.clip_grad_norm_: the total gradient norm is {float(total)} "
                               "(NaN/Inf on at least one rank); the gradients were not clipped")
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    @property
    def shard_transport(self):
        """The transport of `shard_group` (None when the parameters are not sharded)."""
        if self.shard_group is None:
            return None
        if self._shard_transport is None:
            self._shard_transport = get_transport(self.shard_group, backend=self.backend)
        return self._shard_transport

    def _sharded(self) -> bool:
        tr = self.shard_transport
        return tr is not None and tr.world_size > 1

    def _agree_over_shards(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank of the shard group (one scalar allreduce; `ok`
        itself when unsharded)."""
        if not self._sharded():
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self._device(self._layout))
        self.shard_transport.all_reduce(flag, op="sum")
        return float(flag) == 0.0

    def _per_tensor(self, L: FlatLayout, local: Tensor, op: str = "sum", full: bool = False):
        """Per parameter tensor: `local` ([len(L.params), k], this rank's shard's values)
        reduced over the shard group (sum of the shards' sums, or their max), in layout
        order; `local` itself when unsharded. One allreduce, indexed by the parameters'
        numbering in param_groups (`_params_in_order`), so that ranks whose layouts differ
        (a parameter whose local shard is empty) take part in the same collective. With
        `full`: the reduced values of every parameter in that numbering, and the index of
        each layout parameter in it."""
        index = self._param_indices()
        n = max(index.values(), default=-1) + 1
        fill = 0.0 if op == "sum" else float("-inf")
        out = torch.full((n,) + tuple(local.shape[1:]), fill, dtype=torch.float32, device=local.device)
        where = torch.tensor([index[id(p)] for p in L.params], dtype=torch.int64, device=local.device)
        if where.numel():
            out[where] = local.float()
        if self._sharded():
            self.shard_transport.all_reduce(out, op=op)
        elif not full:
            return local
        return (out, where) if full else out[where]

    def _params_in_order(self) -> List[Tensor]:
        """The parameters in the numbering of `_param_indices` (torch's state_dict numbering)."""
        return [p for g in self.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ layout
    def _select_params(self, order: Optional[Sequence[int]] = None):
        flat = [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]
        if order is not None:
            return [flat[i] for i in order]
        # trainable params, and those that already have state (frozen for a while, not forgotten)
        old = self._layout.index if self._layout is not None else {}
        seen, chosen = set(), []
        for gi, p in flat:
            if (p.requires_grad or id(p) in old) and local_tensor(p).numel() > 0 and id(p) not in seen:
                seen.add(id(p))
                chosen.append((gi, p))
        return chosen

    def _buffer_names(self) -> tuple:
        return self._flat_buffers

    def _build_layout(self, order: Optional[Sequence[int]] = None) -> FlatLayout:
        chosen = self._select_params(order)
        params = [p for _, p in chosen]
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"{type(self).__name__}: all parameters must be on one device (the state is one flat "
                             f"buffer), got {sorted(map(str, devices))}")
        for p in params:
            if p.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{type(self).__name__}: parameters must be float32, float16 or bfloat16, "
                                 f"got {p.dtype}")
        L = FlatLayout(params, [gi for gi, _ in chosen])
        if L.sharded and self.shard_group is None:
            raise ValueError(f"{type(self).__name__}: the parameters are DTensors (a model sharded with FSDP2); create "
                             "the optimizer with lbcomm.fsdp.onebit_optimizer(model, mesh, "
                             f"{type(self).__name__}, ...), which passes the replicate group as process_group and the "
                             "shard group as shard_group")
        f32 = dict(dtype=torch.float32, device=params[0].device if params else torch.device("cpu"))
        old, old_flat, old_vec = self._layout, self._flat, self._vectors
        self._flat = {name: torch.zeros(L.total, **f32) for name in self._buffer_names()}
        self._vectors = {name: torch.full((len(params),), v, **f32) for name, v in self._param_vectors.items()}
        if old is not None:  # keep the state of parameters that were already there
            for i, p in enumerate(params):
                j = old.index.get(id(p))
                if j is None:
                    continue
                for name, buf in self._flat.items():
                    if name in old_flat:
                        L.view(buf, i).copy_(old.view(old_flat[name], j))
                for name, vec in self._vectors.items():
                    vec[i] = old_vec[name][j]
        self._on_layout(old, L)
        self._grad_buf = None
        self._layout = L
        self._layout_stale = False
        self._attach_views()
        return L

    def _on_layout(self, old: Optional[FlatLayout], new: FlatLayout) -> None:
        """The layout changed from `old` (None: first) to `new`; remap per-layout state."""

    def _attach_views(self) -> None:
        """Expose the flat state per parameter, as torch optimizers do (views, no copies)."""
        L = self._layout
        for i, p in enumerate(L.params):
            st = self.state[p]
            for name, buf in self._flat.items():
                st[name] = L.view(buf, i)
            for name, vec in self._vectors.items():
                st[name] = vec[i]

    def _prepare(self) -> FlatLayout:
        self.transport  # noqa: B018 - a wrong group or backend is an error at the first step
        L = self._layout
        if L is None:
            return self._build_layout()
        if not self._layout_stale:
            for g in self.param_groups:
                for p in g["params"]:
                    if p.requires_grad and local_tensor(p).numel() > 0 and id(p) not in L.index:
                        self._layout_stale = True
                        break
        if self._layout_stale:
            self._check_layout_change()
            return self._build_layout()
        return L

    def _check_layout_change(self) -> None:
        """Raise if the layout may not change now (the 1-bit optimizers after the freeze)."""

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
        self._after_step(L)
        return loss

    # ---------------------------------------------------------- gradient statistics (lbcomm.stats)
    def _stats_begin(self, L: FlatLayout):
        """With ``gradient_stats`` set and the local gradients at hand (warmup without a DDP
        hook, or the compression stage), start the small async allreduce of this step's
        measurement: exact in warmup (the averaged gradient gives the global norm), a
        coordinate sample in the compression stage (the exact mean is never formed)."""
        stats = self.gradient_stats
        if stats is None or (self._grads_averaged and not self.frozen):
            return None  # no statistics, or a DDP hook (lbcomm.stats.stats_hook) measures them
        return (not self.frozen), stats.begin([p.grad for p in L.params], self.transport, exact=not self.frozen)

    def _stats_finish(self, L: FlatLayout, pending, skipped: bool) -> None:
        if pending is None or pending[1] is None:
            return
        exact, work = pending
        gsq, self._stats_gsq = self._stats_gsq, None
        self.gradient_stats.finish(work, gsq, fold=not skipped and (gsq is not None or not exact))

    def _take_step(self, L: FlatLayout) -> bool:
        """One step; False when it was skipped (non-finite, nonfinite='skip')."""
        return self._warmup_step(L)

    def _after_step(self, L: FlatLayout) -> None:
        """Runs after every step taken (not after skipped ones)."""

    def _tracks_grad_sq(self) -> bool:
        """Whether every step measures the ranks' mean squared local gradient per parameter
        (`local_grad_sq`; OneBitAdam's rescale_variance)."""
        return False

    def _sq_slots(self, L: FlatLayout) -> int:
        return len(L.params) if self._tracks_grad_sq() else 0

    def _collect_grads(self, L: FlatLayout) -> Tensor:
        """Copy every gradient into the flat fp32 buffer (zeros where a parameter has none)
        and set the has-grad flags after it. Returns buffer and flags (the buffer holds
        `_sq_slots` more slots for the local squared norms and 2 x world_size for
        `replica_slots`)."""
        n, k = len(L.params), self._sq_slots(L)
        size = L.total + n + k + (2 * self.transport.world_size if self._detecting() else 0)
        if self._grad_buf is None or self._grad_buf.numel() != size:  # + has-grad flags + checksum slots
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
        if k and not self._grads_averaged:  # the local gradients' squared norms ride in the allreduce
            local_sq_(L, buf, self._grad_buf[L.total + n:L.total + n + k])
        return buf

    @staticmethod
    def _device(L: FlatLayout) -> torch.device:
        return L.params[0].device if L.params else torch.device("cpu")

    def _warmup_step(self, L: FlatLayout) -> bool:
        buf = self._collect_grads(L)
        tr = self.transport
        k = self._sq_slots(L)
        if tr.world_size > 1 and not self._grads_averaged:
            probe = self._probe_warmup and self._detecting()
            width = buf.numel() + k
            if probe:  # the checksum slots ride along (undecided steps only)
                self._grad_buf[width:].copy_(replica_slots([buf[:L.total]], tr.rank, tr.world_size, buf.device))
                width = self._grad_buf.numel()
            # sum in buckets, all in flight at once, then divide by the world size
            tr.all_reduce(self._grad_buf[:width], op="mean",
                          bucket_bytes=max(1, int(self._option("bucket_cap_mb") * 2**20)))
            if probe:
                self._probe_warmup = not self._check_replicas(self._grad_buf[buf.numel() + k:], "warmup")
        if k:
            self._warmup_grad_sq(L, self._grad_buf[buf.numel():buf.numel() + k])
        if self.gradient_stats is not None and not self._grads_averaged:  # the global norm for lbcomm.stats
            self._stats_gsq = torch.linalg.vector_norm(buf[:L.total]).square()
        # Every rank holds the same average (or, with a DDP hook, the same averaged grads),
        # so every rank reaches the same verdict here (sharded: the shard group agrees too).
        if not self._agree_over_shards(bool(torch.isfinite(buf).all())):
            return self._nonfinite("the averaged gradients")
        active = (buf[L.total:] > 0).tolist()
        self._warmup_update(L, active)
        return True

    def _warmup_grad_sq(self, L: FlatLayout, sq: Tensor) -> None:
        """A warmup step's mean over the ranks of the local squared norms (`_tracks_grad_sq`)."""

    def _detecting(self) -> bool:
        """Whether this optimizer checks for gradients averaged by a DDP without lbcomm's hook
        (the detect_averaged_grads option; groups loaded from older checkpoints lack it)."""
        if "detect_averaged_grads" not in self.defaults or self.transport.world_size == 1:
            return False
        groups = self.param_groups
        return bool(groups[0].get("detect_averaged_grads", True) if groups else self.defaults["detect_averaged_grads"])

    def _check_replicas(self, slots: Tensor, stage: str) -> bool:
        """Raise `AveragedGradientsError` when the reduced `replica_slots` say that every rank
        holds the same gradients; return whether the check was decided."""
        same = replicas_identical(slots)
        if same:
            p, name = self.transport.world_size, type(self).__name__
            if stage == "warmup":
                why = ("the optimizer averages them a second time (twice AdamW's traffic), and after the freeze "
                       "DDP's allreduce would keep running next to the compressed one")
            else:
                why = "DDP's fp32 allreduce runs next to the optimizer's compressed allreduce, so nothing is saved"
            raise AveragedGradientsError(
                f"{name}: at step {self._global_step + 1} ({stage}) the gradients are identical on all {p} ranks: a "
                f"DistributedDataParallel without lbcomm's communication hook has already averaged them at full "
                f"precision; {why}. Register lbcomm's hook: lbcomm.attach(ddp_model, optimizer) (it finds the DDP "
                "inside accelerate, Lightning and torch.compile wrappers) or ddp_model.register_comm_hook(optimizer, "
                "lbcomm.ddp.warmup_average_hook); with the Hugging Face Trainer add callbacks=[lbcomm.integrations."
                "transformers.LbcommCallback()], with Lightning callbacks=[lbcomm.integrations.lightning."
                f"LbcommCallback()]. If every rank really computes the same gradients (the same batch on every "
                f"rank), pass {name}(..., detect_averaged_grads=False).")
        return same is not None

    def _nonfinite(self, what: str) -> bool:
        msg = (f"{type(self).__name__}: {what} hold NaN or Inf at step {self._global_step + 1} (on at least one "
               "rank); the step was not taken and the optimizer state is unchanged")
        policy = self._option("nonfinite") if "nonfinite" in self.defaults else "raise"
        if policy == "raise":
            self.last_step_skipped = True
            self.skipped_steps += 1
            raise NonFiniteError(msg + "; pass nonfinite='skip' to skip such steps (e.g. with fp16 loss scaling)")
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

    # ------------------------------------------------------------------ checkpoints
    def _param_indices(self) -> Dict[int, int]:
        """id(param) -> its index in torch's state_dict numbering."""
        mapping: Dict[int, int] = {}
        start = 0
        for g in self.param_groups:
            for i, p in enumerate(g["params"], start):
                mapping.setdefault(id(p), i)
            start += len(g["params"])
        return mapping

    def _extra_state(self) -> Dict[str, Any]:
        """State that is not per parameter (subclasses extend)."""
        L = self._layout
        index = self._param_indices()
        return {
            "version": STATE_VERSION,
            "layout": None if L is None else [index[id(p)] for p in L.params],
            "numels": None if L is None else list(L.numels),
            "global_step": self._global_step,
            "skipped_steps": self.skipped_steps,
        }

    @staticmethod
    def _state_dict_post_hook(self, sd: Dict[str, Any]) -> Dict[str, Any]:
        sd["lbcomm"] = self._extra_state()
        return sd

    @staticmethod
    def _load_state_dict_pre_hook(self, sd: Dict[str, Any]) -> Dict[str, Any]:
        extra = sd.get("lbcomm")
        if extra is None:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state dict has no 'lbcomm' entry, so it was "
                             "not saved by an lbcomm optimizer; load it into the optimizer class that saved it")
        if extra.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"{type(self).__name__}.load_state_dict: unsupported lbcomm state version "
                             f"{extra.get('version')!r} (this lbcomm reads 1 and {STATE_VERSION})")
        # The flat buffers are restored by the post hook, bit for bit: torch would cast
        # per-parameter state to the parameter's dtype (fp16/bf16 parameters keep fp32 state).
        self._loading = (sd.get("state", {}), extra)
        sd = {k: v for k, v in sd.items() if k != "lbcomm"}
        sd["state"] = {}
        return sd

    @staticmethod
    def _load_state_dict_post_hook(self) -> None:
        state, extra = self._loading
        self._loading = None
        self._load_extra_state(state, extra)

    def _load_extra_state(self, state: Dict[Any, Dict[str, Tensor]], extra: Dict[str, Any]) -> None:
        """Rebuild the flat buffers from a loaded state dict (subclasses extend)."""
        self._global_step = int(extra["global_step"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        self._layout = None
        self._grad_buf = None
        self._flat, self._vectors = {}, {}
        if extra["layout"] is None:
            return
        L = self._build_layout(order=extra["layout"])
        if list(L.numels) != list(extra["numels"]):
            raise ValueError(f"{type(self).__name__}.load_state_dict: the parameters have other sizes than the saved "
                             f"ones ({L.numels} vs {extra['numels']})")
        if extra["version"] == 1:  # flat buffers and per-parameter vectors under "lbcomm"
            buffers, vectors = extra["buffers"], extra["vectors"]
        else:
            order = extra["layout"]
            missing = [k for k in order if k not in state]
            if missing:
                raise ValueError(f"{type(self).__name__}.load_state_dict: no state for parameters {missing} of the "
                                 "saved layout; the state dict is incomplete")
            names = list(state[order[0]])
            buffers = {n: torch.cat([state[k][n].reshape(-1) for k in order]) for n in names
                       if n not in self._vectors}
            vectors = {n: torch.stack([state[k][n].reshape(()) for k in order]) for n in names if n in self._vectors}
        for name, t in buffers.items():
            if name not in self._flat:
                self._flat[name] = torch.empty_like(self._flat["exp_avg"])
            self._flat[name].copy_(t)
        for name, t in vectors.items():
            if name in self._vectors:  # version 1 gave Lamb a variance step too (always its step)
                self._vectors[name].copy_(t)
        self._attach_views()

