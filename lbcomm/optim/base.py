"""The machinery every lbcomm optimizer shares (DESIGN.md §3), written once.

`FlatOptimizer` keeps the optimizer state of all parameters in flat fp32 buffers (one
slice per parameter, parameters of one group next to each other) and does, per step:

* warmup (steps 1 .. freeze_step): copy the local gradients into one flat fp32 buffer,
  average it over the ranks with one ``all_reduce`` per bucket (about 25 MB each, a
  per-parameter "has a gradient" flag riding along in the last bucket), skip the step on
  every rank if the average holds NaN/Inf, then let the subclass update its moments and
  the parameters. A DDP communication hook that has already averaged the gradients sets
  `grads_averaged` and the optimizer does not communicate.
* the freeze (end of step freeze_step): record the zero-variance mask, the step count the
  frozen variance belongs to, build the `CompressionState` (one for the whole model).
* compression (steps freeze_step + 1 ..): gradients stay local; the new momentum
  m = b1 m + (1 - b1) g is formed in the gradient buffer, reduced with ONE
  `compressed_allreduce`, masked, and only then committed, so a non-finite value on any
  rank leaves every rank's state exactly as it was.

Per-parameter state (``optimizer.state[p]``) holds views into the flat buffers
(``exp_avg``, ``exp_avg_sq``, ``step``, ...); `state_dict` stores the flat buffers once,
with this rank's compression error buffers, under the ``"lbcomm"`` key, and
`load_state_dict` copies them back, so a resume is bitwise exact.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from ..comm import world_info
from ..compressed import CompressionState, NonFiniteError, _check_block_size, compressed_allreduce

__all__ = ["FlatOptimizer"]

_log = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NONFINITE = ("raise", "skip")
# Options that describe the whole flat buffer, not one group: every group must agree.
_GLOBAL_OPTIONS = ("freeze_step", "block_size", "nonfinite", "bucket_cap_mb", "mask_threshold")
_STATE_VERSION = 1


class _Layout:
    """Where each parameter's slice lies in the flat buffers (groups are contiguous)."""

    def __init__(self, params: List[Tensor], group_of: List[int]):
        self.params = params
        self.group_of = group_of
        self.numels = [p.numel() for p in params]
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
        o = self.offsets[i]
        return flat[o:o + self.numels[i]].view(self.params[i].shape)


class _Segment:
    """A run of consecutive parameters of one group that share their step counts."""

    __slots__ = ("group", "idx", "lo", "hi", "step", "vstep")

    def __init__(self, group: int, i: int, lo: int, hi: int, step: float, vstep: float):
        self.group, self.idx, self.lo, self.hi, self.step, self.vstep = group, [i], lo, hi, step, vstep


class FlatOptimizer(Optimizer):
    """Base class of `OneBitAdam`, `Lamb` and `OneBitLamb`: flat fp32 state, warmup
    gradient averaging, the freeze switch and the compressed momentum allreduce.

    Subclasses implement `_warmup_update`, `_compressed_update` and, when they keep extra
    state, `_on_freeze`; they list their flat buffers in `_flat_buffers` (created with the
    layout) and `_frozen_buffers` (created at the freeze), their per-parameter fp32
    scalars in `_param_vectors` (name -> initial value).

    Attributes:
        process_group (ProcessGroup or None): the group gradients and momenta are reduced over.
        last_step_skipped (bool): the last `step` saw NaN/Inf (on any rank) and changed nothing.
        skipped_steps (int): how many steps were skipped so far.
    """

    _compresses = True
    _flat_buffers = ("exp_avg", "exp_avg_sq")
    _frozen_buffers: tuple = ()
    _param_vectors: Dict[str, float] = {}
    _BASE_VECTORS = {"step": 0.0, "variance_step": 0.0}

    def __init__(self, params, defaults: Dict[str, Any], *, process_group=None):
        self.process_group = process_group
        self._grads_averaged = False
        self._layout: Optional[_Layout] = None
        self._layout_stale = False
        self._flat: Dict[str, Tensor] = {}
        self._vectors: Dict[str, Tensor] = {}
        self._grad_buf: Optional[Tensor] = None
        self._zero_mask: Optional[Tensor] = None  # True where the momentum is held at zero
        self._mask_index: Optional[tuple] = None  # (mask, its indices or None), see _mask_momentum
        self._denom: Optional[tuple] = None  # (flat sqrt(v^)+eps after the freeze, param -> (bc2, eps))
        self._user_masks: Dict[int, Tensor] = {}  # layout index -> bool mask (True = trained)
        self._mask_counts = (0, 0)
        self._comp: Optional[CompressionState] = None
        self._global_step = 0
        self._frozen = False
        self._world: Optional[int] = None
        self._rank = 0
        self.last_step_skipped = False
        self.skipped_steps = 0
        world_info(process_group)  # a group without torch.distributed is an error now, not at step 1
        super().__init__(params, defaults)

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
        if "freeze_step" in group:
            fs = group["freeze_step"]
            if isinstance(fs, bool) or not isinstance(fs, int) or fs < 1:
                raise ValueError(f"Invalid freeze_step: {fs!r} (must be an int >= 1: the variance is frozen after "
                                 "that many warmup steps)")
        if "block_size" in group:
            _check_block_size(group["block_size"])
        if "nonfinite" in group and group["nonfinite"] not in _NONFINITE:
            raise ValueError(f"Invalid nonfinite policy: {group['nonfinite']!r} (use one of {_NONFINITE})")
        if "mask_threshold" in group and not 0.0 <= group["mask_threshold"] < 1.0:
            raise ValueError(f"Invalid mask_threshold: {group['mask_threshold']} (need 0 <= mask_threshold < 1)")
        if "bucket_cap_mb" in group and not group["bucket_cap_mb"] > 0:
            raise ValueError(f"Invalid bucket_cap_mb: {group['bucket_cap_mb']} (must be > 0)")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group (see torch.optim.Optimizer.add_param_group). Allowed during
        warmup; after the freeze the layout of the compressed momentum is fixed."""
        if self._frozen:
            raise RuntimeError(f"{type(self).__name__}: cannot add a param group after the freeze (step "
                               f"{self._global_step}): the compressed momentum buffer has a fixed layout. Create the "
                               "optimizer with every group from the start (params without gradients cost nothing).")
        self._validate_group({**self.defaults, **param_group})
        for name in _GLOBAL_OPTIONS:
            if name in param_group and name in self.defaults and param_group[name] != self.defaults[name]:
                raise ValueError(f"{type(self).__name__}: {name} must be the same for all param groups (the whole "
                                 f"model shares one flat buffer); got {param_group[name]!r} != {self.defaults[name]!r}")
        super().add_param_group(param_group)
        if self._layout is not None:
            self._layout_stale = True

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
        """True once the variance is frozen: every following step keeps the gradients local
        and compresses the momentum (a DDP hook must then not communicate)."""
        return self._frozen

    @property
    def global_step(self) -> int:
        """Steps taken so far (skipped steps do not count)."""
        return self._global_step

    @property
    def compression_state(self) -> Optional[CompressionState]:
        """The error-feedback state of the momentum allreduce (None before the freeze or
        with one rank)."""
        return self._comp

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
            if not isinstance(mask, Tensor) or mask.shape != param.shape:
                raise ValueError(f"set_momentum_mask: expected a bool tensor of shape {tuple(param.shape)}, got "
                                 f"{getattr(mask, 'shape', type(mask).__name__)}")
            self._user_masks[i] = mask.detach().to(device=param.device, dtype=torch.bool).clone()
        if self._frozen:
            self._build_zero_mask(L)

    # ------------------------------------------------------------------ layout
    def _select_params(self, order: Optional[Sequence[int]] = None):
        flat = [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]
        if order is not None:
            chosen = [flat[i] for i in order]
        else:  # trainable params, and those that already have state (frozen for a while, not forgotten)
            old = self._layout.index if self._layout is not None else {}
            seen, chosen = set(), []
            for gi, p in flat:
                if (p.requires_grad or id(p) in old) and p.numel() > 0 and id(p) not in seen:
                    seen.add(id(p))
                    chosen.append((gi, p))
        return chosen

    def _build_layout(self, order: Optional[Sequence[int]] = None) -> _Layout:
        chosen = self._select_params(order)
        params = [p for _, p in chosen]
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"{type(self).__name__}: all parameters must be on one device (the state is one flat "
                             f"buffer), got {sorted(map(str, devices))}")
        for p in params:
            if p.dtype not in _FLOAT_DTYPES:
                raise ValueError(f"{type(self).__name__}: parameters must be float32, float16 or bfloat16, "
                                 f"got {p.dtype}")
        L = _Layout(params, [gi for gi, _ in chosen])
        device = params[0].device if params else torch.device("cpu")
        f32 = dict(dtype=torch.float32, device=device)
        old, old_flat, old_vec = self._layout, self._flat, self._vectors
        names = self._flat_buffers + (self._frozen_buffers if self._frozen else ())
        self._flat = {name: torch.zeros(L.total, **f32) for name in names}
        vec_init = {**self._BASE_VECTORS, **self._param_vectors}
        self._vectors = {name: torch.full((len(params),), v, **f32) for name, v in vec_init.items()}
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
            self._user_masks = {L.index[id(old.params[j])]: m for j, m in self._user_masks.items()
                                if id(old.params[j]) in L.index}
        self._grad_buf = torch.empty(L.total + len(params), **f32)  # + one has-grad flag per param
        self._denom = None
        self._layout = L
        self._layout_stale = False
        self._attach_views()
        return L

    def _attach_views(self) -> None:
        """Expose the flat state per parameter, as torch optimizers do (views, no copies)."""
        L = self._layout
        for i, p in enumerate(L.params):
            st = self.state[p]
            for name, buf in self._flat.items():
                st[name] = L.view(buf, i)
            for name, vec in self._vectors.items():
                st[name] = vec[i]

    def _prepare(self) -> _Layout:
        if self._world is None:
            self._world, self._rank = world_info(self.process_group)
        L = self._layout
        if L is None:
            return self._build_layout()
        if not self._layout_stale:
            for g in self.param_groups:
                for p in g["params"]:
                    if p.requires_grad and p.numel() > 0 and id(p) not in L.index:
                        self._layout_stale = True
                        break
        if self._layout_stale:
            if self._frozen:
                raise RuntimeError(f"{type(self).__name__}: a parameter started requiring grad after the freeze "
                                   f"(step {self._global_step}); the compressed momentum buffer has a fixed layout. "
                                   "Unfreeze parameters during the warmup, or leave them trainable from the start.")
            return self._build_layout()
        return L

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
        done = self._compression_step(L) if self._frozen else self._warmup_step(L)
        if not done:
            self.last_step_skipped = True
            self.skipped_steps += 1
            return loss
        self._global_step += 1
        if self._compresses and not self._frozen and self._global_step >= self.defaults["freeze_step"]:
            self._freeze(L)
        return loss

    def _collect_grads(self, L: _Layout) -> Tensor:
        """Copy every gradient into the flat fp32 buffer (zeros where a parameter has none)
        and set the has-grad flags after it. Returns the whole buffer."""
        buf = self._grad_buf
        flags = []
        for i, p in enumerate(L.params):
            view = L.view(buf, i)
            g = p.grad
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
        return buf

    def _average(self, buf: Tensor) -> None:
        """Sum buf over the ranks in buckets of bucket_cap_mb (all in flight at once), then
        divide by the world size: the warmup's fused gradient averaging."""
        cap = max(1, int(self.defaults.get("bucket_cap_mb", 25.0) * 2**20) // buf.element_size())
        works = [dist.all_reduce(buf[s:s + cap], group=self.process_group, async_op=True)
                 for s in range(0, buf.numel(), cap)]
        for w in works:
            w.wait()
        buf.div_(self._world)

    def _warmup_step(self, L: _Layout) -> bool:
        buf = self._collect_grads(L)
        if self._world > 1 and not self._grads_averaged:
            self._average(buf)
        # Every rank holds the same average (or, with a DDP hook, the same averaged grads),
        # so every rank reaches the same verdict here.
        if not bool(torch.isfinite(buf).all()):
            return self._nonfinite("the averaged gradients")
        active = (buf[L.total:] > 0).tolist()
        self._warmup_update(L, active)
        return True

    def _compression_step(self, L: _Layout) -> bool:
        # The gradients are read where autograd left them (see `_local_momentum`).
        return self._compressed_update(L)

    def _nonfinite(self, what: str) -> bool:
        msg = (f"{type(self).__name__}: {what} hold NaN or Inf at step {self._global_step + 1} (on at least one "
               "rank); the step was not taken and the optimizer state is unchanged")
        if self.defaults.get("nonfinite", "raise") == "raise":
            self.last_step_skipped = True
            self.skipped_steps += 1
            raise NonFiniteError(msg + "; pass nonfinite='skip' to skip such steps (e.g. with fp16 loss scaling)")
        (_log.warning if self.skipped_steps == 0 else _log.info)("%s; skipping it (nonfinite='skip')", msg)
        return False

    def _segments(self, L: _Layout, include: Sequence[bool], *, frozen: bool = False) -> List[_Segment]:
        """Advance the step count of the included parameters and cut them into runs of one
        group with equal step counts (the bias corrections are then scalars per run)."""
        idx = [i for i, on in enumerate(include) if on]
        if not idx:
            return []
        steps = self._vectors["step"]
        steps[idx] += 1
        s = steps.tolist()
        vs = self._vectors["variance_step"].tolist() if frozen else s
        segs: List[_Segment] = []
        for i in idx:
            lo, hi = L.offsets[i], L.offsets[i] + L.numels[i]
            last = segs[-1] if segs else None
            if (last is not None and last.idx[-1] == i - 1 and last.group == L.group_of[i] and last.step == s[i]
                    and last.vstep == vs[i]):
                last.idx.append(i)
                last.hi = hi
            else:
                segs.append(_Segment(L.group_of[i], i, lo, hi, s[i], vs[i]))
        return segs

    def _participating(self, L: _Layout) -> List[bool]:
        """Parameters updated after the freeze: trainable ones that saw a gradient in warmup."""
        steps = self._vectors["step"].tolist()
        return [p.requires_grad and steps[i] > 0 for i, p in enumerate(L.params)]

    def _bias_corrections(self, group: Dict[str, Any], seg: _Segment):
        if not group.get("bias_correction", True):
            return 1.0, 1.0
        b1, b2 = group["betas"]
        return 1 - b1 ** seg.step, 1 - b2 ** seg.vstep

    # ------------------------------------------------------------------ shared math
    def _update_moments(self, seg: _Segment) -> None:
        """Warmup moments on the averaged gradients: m <- b1 m + (1-b1) g, v <- b2 v + (1-b2) g^2."""
        b1, b2 = self.param_groups[seg.group]["betas"]
        g = self._grad_buf[seg.lo:seg.hi]
        self._flat["exp_avg"][seg.lo:seg.hi].lerp_(g, 1 - b1)
        self._flat["exp_avg_sq"][seg.lo:seg.hi].mul_(b2).addcmul_(g, g, value=1 - b2)

    def _denominator(self, v: Tensor, bc2: float, eps: float, out: Tensor) -> Tensor:
        """out = sqrt(v) / sqrt(bc2) + eps, i.e. sqrt(v^) + eps."""
        torch.sqrt(v, out=out)
        return out.div_(bc2 ** 0.5).add_(eps)

    def _local_momentum(self, L: _Layout, buf: Tensor) -> None:
        """buf = b1 m + (1-b1) g_local, per parameter straight from its .grad (no copy into
        the flat buffer first: one pass fewer over the model per step)."""
        m = self._flat["exp_avg"]
        for i, p in enumerate(L.params):
            w = 1 - self.param_groups[L.group_of[i]]["betas"][0]
            m_i, b_i, g = L.view(m, i), L.view(buf, i), p.grad
            if g is not None and g.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if g is None or g.dtype != torch.float32:
                b_i.zero_() if g is None else b_i.copy_(g)
                g = b_i
            torch.lerp(m_i, g, w, out=b_i)

    def _compress_momentum(self, L: _Layout, scale: Optional[Tensor] = None,
                           out: Optional[Tensor] = None) -> Optional[Tensor]:
        """The compression stage's momentum: m_new = b1 m + (1-b1) g_local, formed in the
        gradient buffer (m itself untouched), times scale[p] per parameter if given, reduced
        with one compressed allreduce, divided by scale[p], masked. Returns the new momentum
        (decoded into `out` if given, else into the gradient buffer), or None when the step
        is skipped (non-finite on some rank; `out` is then unchanged)."""
        buf = self._grad_buf[:L.total]
        self._local_momentum(L, buf)
        if scale is not None:
            for i in range(len(L.params)):
                L.view(buf, i).mul_(scale[i])
        target = buf if out is None else out
        if self._comp is None:  # one rank: nothing to reduce, nothing compressed
            ok = bool(torch.isfinite(buf).all())
            if ok and target is not buf:
                target.copy_(buf)
        else:
            try:  # every rank sees every server scale, so all ranks agree on the verdict
                # decoded in place: a fresh model-sized output would page-fault every step
                compressed_allreduce(buf, self._comp, out=target)
                ok = not self._comp.last_skipped
            except NonFiniteError:
                ok = False
        if not ok:
            self._nonfinite("the new momenta")  # raises, or logs for nonfinite='skip'
            return None
        if scale is not None:
            for i in range(len(L.params)):
                L.view(target, i).div_(scale[i])
        self._mask_momentum(target)
        return target

    def _mask_momentum(self, m: Tensor) -> None:
        """Zero the masked coordinates. Usually few (unused embedding rows, key biases): then
        an index list, built once per mask, beats a pass over the whole bool mask."""
        mask = self._zero_mask
        if mask is None:
            return
        if self._mask_index is None or self._mask_index[0] is not mask:
            count = int(mask.sum())
            idx = mask.nonzero().view(-1) if count * 16 < mask.numel() else None
            self._mask_index = (mask, idx)
        idx = self._mask_index[1]
        if idx is None:
            m.masked_fill_(mask, 0.0)
        else:
            m.index_fill_(0, idx, 0.0)

    def _frozen_denominator(self, L: _Layout, seg: _Segment, bc2: float, eps: float) -> Tensor:
        """sqrt(v^) + eps of a segment after the freeze. v and its bias correction no longer
        change then, so it is computed once per parameter (and again only if eps changes)
        and kept: three passes fewer per step for 4 bytes per parameter."""
        v = self._flat["exp_avg_sq"]
        if self._denom is None:
            self._denom = (torch.empty_like(v), {})
        d, valid = self._denom
        for i in seg.idx:
            if valid.get(i) != (bc2, eps):
                self._denominator(L.view(v, i), bc2, eps, out=L.view(d, i))
                valid[i] = (bc2, eps)
        return d[seg.lo:seg.hi]

    @staticmethod
    def _apply(p: Tensor, fn) -> None:
        """Run fn on p in fp32: in place for fp32 params, through an fp32 copy otherwise."""
        if p.dtype == torch.float32:
            fn(p)
        else:
            w = p.float()
            fn(w)
            p.copy_(w)

    # ------------------------------------------------------------------ freeze
    def _build_zero_mask(self, L: _Layout) -> None:
        """Hold at zero the momentum of coordinates whose frozen variance is zero, or at most
        mask_threshold times the mean variance: they never saw a gradient, or only rounding
        noise (e.g. attention key biases, to which softmax is invariant), and would move by
        (compression noise) / eps after the freeze. User masks override per parameter."""
        v = self._flat["exp_avg_sq"]
        thr = self.defaults.get("mask_threshold", 0.0) * float(v.mean()) if v.numel() else 0.0
        zero = v <= thr
        self._mask_counts = (int((v == 0).sum()), int(zero.sum()))
        for i, mask in self._user_masks.items():
            L.view(zero, i).copy_(~mask)
        self._zero_mask = zero if bool(zero.any()) else None

    def _make_compression_state(self, L: _Layout) -> None:
        self._comp = None
        if self._world > 1:
            device = L.params[0].device if L.params else torch.device("cpu")
            self._comp = CompressionState(L.total, group=self.process_group, device=device,
                                          block_size=self.defaults["block_size"], nonfinite="raise")

    def _freeze(self, L: _Layout) -> None:
        self._frozen = True
        self._denom = None
        self._vectors["variance_step"].copy_(self._vectors["step"])
        self._build_zero_mask(L)
        for name in self._frozen_buffers:
            self._flat[name] = torch.zeros_like(self._flat["exp_avg"])
        self._make_compression_state(L)
        self._on_freeze(L)
        self._attach_views()
        masked = 0 if self._zero_mask is None else int(self._zero_mask.sum())
        exact, below = self._mask_counts
        _log.info("%s: variance frozen after step %s; from now on one compressed allreduce of %s momentum elements "
                  "per step over %s ranks (block_size %s); %s coordinates held at zero (variance exactly zero: %s, "
                  "at most mask_threshold x mean: %s, user masks: %s params)", type(self).__name__,
                  self._global_step, L.total, self._world, self.defaults["block_size"], masked, exact, below,
                  len(self._user_masks))

    # ------------------------------------------------------------------ subclass hooks
    def _warmup_update(self, L: _Layout, active: List[bool]) -> None:
        raise NotImplementedError

    def _compressed_update(self, L: _Layout) -> bool:
        raise NotImplementedError

    def _on_freeze(self, L: _Layout) -> None:
        pass

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

    def state_dict(self) -> Dict[str, Any]:
        """The optimizer state (see torch.optim.Optimizer.state_dict) plus, under
        ``"lbcomm"``, the flat buffers, the step counters, the masks and this rank's
        compression error buffers (one shard per rank: see `lbcomm.save_sharded`)."""
        sd = super().state_dict()
        managed = set(self._flat) | set(self._vectors) | set(self._frozen_buffers)
        sd["state"] = {k: {n: v for n, v in st.items() if n not in managed} for k, st in sd["state"].items()}
        sd["state"] = {k: st for k, st in sd["state"].items() if st}
        L = self._layout
        index = self._param_indices()
        sd["lbcomm"] = {
            "version": _STATE_VERSION,
            "layout": None if L is None else [index[id(p)] for p in L.params],
            "numels": None if L is None else list(L.numels),
            "global_step": self._global_step,
            "frozen": self._frozen,
            "world_size": self._world if self._world is not None else world_info(self.process_group)[0],
            "buffers": dict(self._flat),
            "vectors": dict(self._vectors),
            "zero_mask": self._zero_mask,
            "user_masks": dict(self._user_masks),
            "compression": None if self._comp is None else self._comp.state_dict(),
            "skipped_steps": self.skipped_steps,
        }
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state saved by `state_dict`. The flat buffers are copied back exactly.
        Compression error buffers saved for another world size (or rank, or layout) are
        reset to zero with a logged warning; training continues from the loaded moments."""
        extra = state_dict.get("lbcomm")
        if extra is None:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state dict has no 'lbcomm' entry, so it was "
                             "not saved by an lbcomm optimizer; load it into the optimizer class that saved it")
        if extra.get("version") != _STATE_VERSION:
            raise ValueError(f"{type(self).__name__}.load_state_dict: unsupported lbcomm state version "
                             f"{extra.get('version')!r} (this lbcomm writes {_STATE_VERSION})")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "lbcomm"})
        self._world, self._rank = world_info(self.process_group)
        self._frozen = bool(extra["frozen"])
        self._global_step = int(extra["global_step"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        self._comp = None
        self._zero_mask = None
        self._denom = None
        self._layout = None
        self._flat, self._vectors, self._user_masks = {}, {}, {}
        if extra["layout"] is None:
            return
        L = self._build_layout(order=extra["layout"])
        if list(L.numels) != list(extra["numels"]):
            raise ValueError(f"{type(self).__name__}.load_state_dict: the parameters have other sizes than the saved "
                             f"ones ({L.numels} vs {extra['numels']})")
        for name, t in extra["buffers"].items():
            if name not in self._flat:
                self._flat[name] = torch.empty_like(self._flat["exp_avg"])
            self._flat[name].copy_(t)
        for name, t in extra["vectors"].items():
            self._vectors[name].copy_(t)
        self._user_masks = {int(i): m.to(device=L.params[int(i)].device, dtype=torch.bool).clone()
                            for i, m in extra["user_masks"].items()}
        if extra["zero_mask"] is not None:
            self._zero_mask = extra["zero_mask"].to(device=self._flat["exp_avg"].device, dtype=torch.bool).clone()
        self._attach_views()
        if self._frozen:
            self._make_compression_state(L)
            saved = extra.get("compression")
            if self._comp is not None and saved is not None:
                self._comp.load_state_dict(saved)  # logs a warning and resets on a layout change
            elif self._comp is not None or saved is not None:
                _log.warning("%s: the checkpoint was saved with world size %s, this run has %s; the compression error "
                             "buffers start from zero and training continues", type(self).__name__,
                             extra.get("world_size"), self._world)
