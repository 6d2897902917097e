"""0/1 Adam (Lu et al., 2022): the variance updated on an exponentially spaced schedule and
then frozen, 1-bit compressed momentum synchronization, and after the freeze local steps
between synchronizations on a growing interval. Built on `OneBitAdam`'s machinery (the
freeze, the mask, the finiteness agreement, the compressed momentum allreduce, max_update);
the equations are in `ZeroOneAdam`'s docstring."""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from ..comm import get_transport
from ..comm.counting import CountingTransport
from ..config import DEFAULT_BLOCK_SIZE
from . import functional as F
from . import kernels
from .adam import OneBitAdam
from .flat import FlatLayout
from .onebit import OneBitOptimizer

__all__ = ["ZeroOneAdam"]

_log = logging.getLogger(__name__)

_KINDS = ("variance", "onebit", "local", "sync")


def _positive_int(group: Dict[str, Any], name: str) -> None:
    value = group[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {name}: {value!r} (must be an int >= 1)")


class ZeroOneAdam(OneBitAdam):
    _GLOBAL_OPTIONS = tuple(o for o in OneBitOptimizer._GLOBAL_OPTIONS if o not in ("freeze_step", "exact_numel")) + (
        "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "var_decay")
    # interval_lr: sum of the lrs since the last synchronization; interval_keep: product of
    # the weight-decay factors (1 - lr wd) since then (fp32, per parameter, checkpointed)
    _param_vectors: Dict[str, float] = {**OneBitOptimizer._param_vectors, "interval_lr": 0.0, "interval_keep": 1.0}
    _WARMUP_VSTEP = "variance_step"  # the variance's bias correction counts the steps its updates cover
    # flat buffers of the local-step stage: the accumulated lr-weighted momentum and the
    # parameters at the last synchronization (identical on every rank)
    _local_buffers: tuple = ("local_update", "anchor")

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        var_freeze_step: int = 100000,
        *,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        var_decay: str = "time",
        bias_correction: bool = True,
        block_size: Optional[int] = DEFAULT_BLOCK_SIZE,
        mask_threshold: float = 1e-10,
        max_update: Union[float, str, None] = 1.0,
        nonfinite: str = "raise",
        bucket_cap_mb: float = 25.0,
        detect_averaged_grads: bool = True,
        process_group=None,
        backend: str = "auto",
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, var_freeze_step=var_freeze_step,
                        var_update_scaler=var_update_scaler, local_step_scaler=local_step_scaler,
                        local_step_clipper=local_step_clipper, var_decay=var_decay, bias_correction=bias_correction,
                        block_size=block_size, mask_threshold=mask_threshold, max_update=max_update,
                        nonfinite=nonfinite, bucket_cap_mb=bucket_cap_mb,
                        detect_averaged_grads=detect_averaged_grads)
        self._schedule = self._initial_schedule()
        self._last_kind: Optional[str] = None
        self._counts = {k: 0 for k in _KINDS}
        # flat compression only: its local steps and syncs are not built on the hierarchical reduction
        OneBitOptimizer.__init__(self, params, defaults, process_group=process_group, backend=backend, topology="flat")

    @staticmethod
    def _initial_schedule() -> Dict[str, Any]:
        # var_updates: variance updates so far; next_var: the step of the next one (0: none
        # left); local: the local-step stage has begun; syncs: synchronizations in it so far;
        # next_sync: the step of the next one
        return {"var_updates": 0, "next_var": 1, "local": False, "syncs": 0, "next_sync": 0}

    # ------------------------------------------------------------------ options
    def _validate_group(self, group: Dict[str, Any]) -> None:
        for name in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
            _positive_int(group, name)
        if group.get("var_decay", "update") not in ("time", "update"):
            raise ValueError(f"Invalid var_decay: {group['var_decay']!r} (must be 'time' or 'update')")
        if group["max_update"] == "warmup":
            raise ValueError("Invalid max_update: 'warmup' is not supported by ZeroOneAdam (its variance keeps "
                             "changing until var_freeze_step); use a number, 'auto' or None")
        # OneBitOptimizer's checks; its freeze is ZeroOneAdam's var_freeze_step
        super()._validate_group({**group, "freeze_step": group["var_freeze_step"]})

    # ------------------------------------------------------------------ public API
    @property
    def transport(self) -> CountingTransport:
        """The `lbcomm.comm` transport of `process_group`, wrapped in a `CountingTransport`
        (what `comm_stats` reports)."""
        if self._transport is None:
            self._transport = CountingTransport(get_transport(self.process_group, backend=self.backend))
        return self._transport

    @property
    def local_steps_started(self) -> bool:
        """True once the variance is frozen for good (after var_freeze_step): parameters are
        then updated locally and synchronized every `sync_interval` steps."""
        return self._schedule["local"]

    @property
    def sync_interval(self) -> int:
        """The current interval between synchronizations (1 before the local-step stage)."""
        s = self._schedule
        if not s["local"]:
            return 1
        return min(2 ** (s["syncs"] // self._option("local_step_scaler")), self._option("local_step_clipper"))

    def comm_stats(self) -> Dict[str, int]:
        """What this rank has sent so far: ``bytes_sent``, ``rounds`` (collectives started; a
        bucketed allreduce counts one per bucket), and the steps taken by kind:
        ``variance_steps`` (full-precision gradient allreduce, the variance updated),
        ``onebit_steps`` (compressed momentum, before var_freeze_step), ``local_steps`` (no
        communication but the finiteness agreement) and ``sync_steps``. Checkpointed."""
        tr = self.transport
        return {"bytes_sent": tr.bytes_sent, "rounds": tr.rounds,
                **{f"{k}_steps": v for k, v in self._counts.items()}}

    # ------------------------------------------------------------------ layout
    def _buffer_names(self) -> tuple:
        return super()._buffer_names() + (self._local_buffers if self._schedule["local"] else ())

    # ------------------------------------------------------------------ step
    def _take_step(self, L: FlatLayout) -> bool:
        t, s = self._global_step + 1, self._schedule
        if not self._frozen or t == s["next_var"]:
            self._last_kind = "variance"
            return self._variance_step(L)
        if not s["local"]:
            self._last_kind = "onebit"
            return super()._take_step(L)  # OneBitAdam's compression step with the current variance
        self._last_kind = "sync" if t == s["next_sync"] else "local"
        # every rank agrees that the local gradients are finite (4 bytes), so that every rank
        # skips the same steps and the synchronizations stay aligned
        if not self._grads_finite(L):
            return self._nonfinite("the local gradients")
        if self._last_kind == "sync":
            return self._sync_step(L) or self._nonfinite("the synchronized momenta")
        self._local_step(L)
        return True

    def _variance_step(self, L: FlatLayout) -> bool:
        """AdamW on the gradients averaged at full precision, the variance updated."""
        if not self._frozen:
            return self._warmup_step(L)
        # after the first step a DDP hook no longer averages (the optimizer is frozen for it)
        hooked, self._grads_averaged = self._grads_averaged, False
        try:
            return self._warmup_step(L)
        finally:
            self._grads_averaged = hooked

    def _variance_gap(self) -> int:
        """The variance's decay exponent at this variance update: with var_decay="time" the
        steps since the last update (the schedule's interval, 2^(n // kappa) after n
        updates), so that v forgets at beta2 per step as Adam's does; with "update" (the
        paper; checkpoints from before the option) 1."""
        if self.param_groups[0].get("var_decay", "update") != "time":
            return 1
        return 2 ** (self._schedule["var_updates"] // self._option("var_update_scaler"))

    def _warmup_update(self, L: FlatLayout, active: List[bool]) -> None:
        idx = [i for i, on in enumerate(active) if on]
        if idx:  # the bias correction's count: the steps the variance covers
            self._vectors["variance_step"][idx] += self._variance_gap()
        super()._warmup_update(L, active)

    def _warmup_bounds(self, L: FlatLayout) -> List[Optional[float]]:
        """A variance step after the first 1-bit step takes its momentum from decoded
        compressed momenta: max_update bounds it as it bounds the compressed steps (coordinates
        of a tiny variance would otherwise move by lr x block scale / sqrt(v) and blow up).
        The steps before any compression are AdamW's."""
        if not self._counts["onebit"]:
            return super()._warmup_bounds(L)
        return self._update_bounds(L)

    def _moments(self, seg) -> None:
        super()._moments(seg, self._variance_gap())

    def _after_step(self, L: FlatLayout) -> None:
        t, s, kind = self._global_step, self._schedule, self._last_kind
        self._counts[kind] += 1
        if kind == "variance":
            s["var_updates"] += 1
            nxt = t + 2 ** (s["var_updates"] // self._option("var_update_scaler"))
            s["next_var"] = nxt if nxt <= self._option("var_freeze_step") else 0
            if not self._frozen:
                self._freeze(L)  # the compression state and the mask, from the first step on
            else:
                self._build_mask(L)  # the variance changed
        elif kind == "sync":
            s["syncs"] += 1
            s["next_sync"] = t + min(2 ** (s["syncs"] // self._option("local_step_scaler")),
                                     self._option("local_step_clipper"))
        if not s["local"] and t >= self._option("var_freeze_step"):
            self._start_local_steps(L)

    def _start_local_steps(self, L: FlatLayout) -> None:
        s = self._schedule
        s.update(local=True, next_var=0, syncs=0, next_sync=self._global_step + 1)
        self._grad_buf = None
        self._flat["local_update"] = torch.zeros_like(self._flat["exp_avg"])
        anchor = self._flat["anchor"] = torch.empty_like(self._flat["exp_avg"])
        for i, p in enumerate(L.params):
            L.view(anchor, i).copy_(p.detach())
        self._vectors["interval_lr"].zero_()
        self._vectors["interval_keep"].fill_(1.0)
        self._attach_views()
        _log.info("%s: variance frozen for good after step %s (%s variance updates); local steps from now on, "
                  "synchronized every min(2^(j // %s), %s) steps", type(self).__name__, self._global_step,
                  s["var_updates"], self._option("local_step_scaler"), self._option("local_step_clipper"))

    # ------------------------------------------------------------------ local steps
    def _bc1(self, group: Dict[str, Any], step: float) -> float:
        return 1 - group["betas"][0] ** step if group["bias_correction"] else 1.0

    @staticmethod
    def _local_momentum(m_i: Tensor, g: Optional[Tensor], weight: float, out: Tensor) -> None:
        """out = b1 m + (1-b1) g (torch.lerp), g None counting as zeros."""
        if g is None:
            g = torch.zeros_like(m_i)
        elif g.dtype != torch.float32:
            g = g.float()
        torch.lerp(m_i, g.reshape(-1), weight, out=out)

    def _interval_vectors(self, idx_by_group: Dict[int, List[int]], out_lr: Tensor, out_keep: Tensor) -> None:
        """Add this step's lr to interval_lr and its decay factor to interval_keep (fp32)."""
        for gi, idx in idx_by_group.items():
            group = self.param_groups[gi]
            out_lr[idx] += group["lr"]
            out_keep[idx] *= 1 - group["lr"] * group["weight_decay"]

    @staticmethod
    def _by_group(L: FlatLayout, include: List[bool]) -> Dict[int, List[int]]:
        out: Dict[int, List[int]] = {}
        for i, on in enumerate(include):
            if on:
                out.setdefault(L.group_of[i], []).append(i)
        return out

    def _local_step(self, L: FlatLayout) -> None:
        """No communication: the local momentum and an AdamW step with the frozen variance,
        accumulated into local_update."""
        m, v, acc = self._flat["exp_avg"], self._flat["exp_avg_sq"], self._flat["local_update"]
        part = self._participating(L)
        for i, on in enumerate(part):
            if on:
                m_i = L.view(m, i).view(-1)
                self._local_momentum(m_i, L.params[i].grad, 1 - self.param_groups[L.group_of[i]]["betas"][0], m_i)
        self._mask_range(m, 0, L.total)
        scratch, bounds = self._stage_buffer(L), self._update_bounds(L)
        for seg in self._segments(L, part, vstep="variance_step"):
            group = self.param_groups[seg.group]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            bc1, bc2 = self._bias_corrections(group, seg)
            for i in seg.idx:
                b = None if bounds[i] is None else lr * bounds[i]
                F.apply_fp32(L.params[i], lambda w, i=i, b=b: kernels.frozen_adamw_(
                    w, L.view(m, i), L.view(v, i), bc2, eps, lr * wd, lr / bc1, scratch, b))
                L.view(acc, i).add_(L.view(m, i), alpha=lr / bc1)
        self._interval_vectors(self._by_group(L, part), self._vectors["interval_lr"], self._vectors["interval_keep"])

    def _sync_step(self, L: FlatLayout) -> bool:
        """The local step's momentum, then one compressed allreduce of the interval's mean
        bias-corrected momentum (times bc1) into m, and every rank's parameters rebuilt from
        the anchor; False (nothing changed) when the result is non-finite."""
        m, v = self._flat["exp_avg"], self._flat["exp_avg_sq"]
        acc, anchor = self._flat["local_update"], self._flat["anchor"]
        part = self._participating(L)
        steps = self._vectors["step"].tolist()
        lr_sum, keep = self._vectors["interval_lr"].clone(), self._vectors["interval_keep"].clone()
        self._interval_vectors(self._by_group(L, part), lr_sum, keep)
        sums = lr_sum.tolist()
        weights, alphas, scales = [], [], []
        for i, gi in enumerate(L.group_of):
            group = self.param_groups[gi]
            weights.append(1 - group["betas"][0])
            if part[i]:
                bc1 = self._bc1(group, steps[i] + 1)
                alphas.append(group["lr"] / bc1)
                scales.append(bc1 / sums[i] if sums[i] > 0 else 0.0)
            else:  # not trained: its momentum is reduced as OneBitAdam's, it does not move
                alphas.append(None)
                scales.append(None)

        def source(lo: int, hi: int, buf: Tensor) -> None:
            for i, a, b in L.overlapping(lo, hi):
                o = L.offsets[i]
                out, g = buf[o + a - lo:o + b - lo], L.params[i].grad
                self._local_momentum(m[o + a:o + b], None if g is None else g.reshape(-1)[a:b], weights[i], out)
                if alphas[i] is not None:
                    torch.add(acc[o + a:o + b], out, alpha=alphas[i], out=out)
                    out.mul_(scales[i])

        if not self._reduce_momentum(L, source, m):
            return False
        scratch, bounds = self._stage_buffer(L), self._update_bounds(L)
        keeps = keep.tolist()
        for seg in self._segments(L, part, vstep="variance_step"):
            group = self.param_groups[seg.group]
            eps = group["eps"]
            bc1, bc2 = self._bias_corrections(group, seg)
            for i in seg.idx:
                total = sums[i]
                b = None if bounds[i] is None else total * bounds[i]
                a_i = L.view(anchor, i)

                def rebuild(w, i=i, b=b, total=total, a_i=a_i):
                    w.copy_(a_i)
                    kernels.frozen_adamw_(w, L.view(m, i), L.view(v, i), bc2, eps, 1 - keeps[i], total / bc1,
                                          scratch, b)
                    a_i.copy_(w)

                F.apply_fp32(L.params[i], rebuild)
        acc.zero_()
        self._vectors["interval_lr"].zero_()
        self._vectors["interval_keep"].fill_(1.0)
        return True

    # ------------------------------------------------------------------ checkpoints
    def _extra_state(self) -> Dict[str, Any]:
        extra = super()._extra_state()
        tr = self.transport
        extra["zero_one"] = {**self._schedule, "counts": dict(self._counts), "bytes_sent": tr.bytes_sent,
                             "rounds": tr.rounds}
        return extra

    def _load_extra_state(self, state: Dict[Any, Dict[str, Tensor]], extra: Dict[str, Any]) -> None:
        saved = extra.get("zero_one")
        if saved is None:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state dict has no 'zero_one' entry (it was "
                             "saved by another lbcomm optimizer); load it into the optimizer class that saved it")
        self._schedule = {k: saved[k] for k in self._initial_schedule()}
        self._counts = {k: int(saved["counts"].get(k, 0)) for k in _KINDS}
        tr = self.transport
        tr.bytes_sent, tr.rounds = int(saved["bytes_sent"]), int(saved["rounds"])
        super()._load_extra_state(state, extra)


ZeroOneAdam.__doc__ = r"""Implements 0/1 Adam (Lu et al., 2022, "Maximizing Communication
    Efficiency for Large-scale Training via 0/1 Adam"): the variance updated on an
    exponentially spaced schedule and then frozen, 1-bit compressed momentum, and local
    steps between synchronizations on a growing interval.

    Three kinds of steps, all ranks taking the same kind at the same step:

    * variance steps :math:`t \in T_v` (step 1, then intervals :math:`2^{\lfloor j/\kappa
      \rfloor}` after the :math:`j`-th update, up to var_freeze_step): AdamW on the
      gradients averaged at full precision (one bucketed allreduce), the variance updated;
    * 1-bit steps (the other steps up to var_freeze_step): OneBitAdam's compression step
      with the variance as it stands;
    * after var_freeze_step, local steps: no communication but a 4-byte finiteness
      agreement; every :math:`H_j = \min(2^{\lfloor j/\alpha \rfloor}, H)` steps (after the
      :math:`j`-th synchronization of this stage) a synchronization step.

    .. math::
       \begin{aligned}
            &\textbf{input}: \gamma_t \text{ (lr)}, \beta_1, \beta_2, \epsilon,
                \lambda \text{ (weight decay)}, T_f \text{ (var\_freeze\_step)},
                \kappa, \alpha, H \text{ (var\_update\_scaler, local\_step\_scaler,
                local\_step\_clipper)}, U \text{ (max\_update)}                              \\
            &\hat{m} = m / (1-\beta_1^t), \; d = \sqrt{v / (1-\beta_2^{n_v})} + \epsilon
                \text{ (} n_v \text{: steps covered by the variance updates so far)}, \;
                \mathrm{cl}_c(x) = \mathrm{clamp}(x, -c, c)                                 \\
            &t \in T_v: \; g = \tfrac{1}{p}\textstyle\sum_r g_r, \;
                m \leftarrow \beta_1 m + (1-\beta_1) g, \;
                v \leftarrow \beta_2^k v + (1-\beta_2^k) g^2, \; n_v \leftarrow n_v + k, \;
                \theta \leftarrow \theta(1-\gamma_t\lambda) - \mathrm{cl}_{\gamma_t U'}(\gamma_t \hat{m}/d)
                \text{ (} U' = \infty \text{ before the first 1-bit step, } U \text{ after)}   \\
            &t \le T_f, t \notin T_v: \;
                m \leftarrow \mathrm{CompressedAllreduce}(\beta_1 m + (1-\beta_1) g_r)
                \odot \mathrm{mask}, \;
                \theta \leftarrow \theta(1-\gamma_t\lambda)
                - \mathrm{cl}_{\gamma_t U}(\gamma_t \hat{m}/d)                                \\
            &t > T_f \text{, on rank } r: \; m \leftarrow (\beta_1 m + (1-\beta_1) g_r)
                \odot \mathrm{mask}, \;
                a \leftarrow a + \gamma_t \hat{m}, \; \Gamma \leftarrow \Gamma + \gamma_t, \;
                K \leftarrow K (1 - \gamma_t\lambda)                                          \\
            &\hspace{10mm}\text{local step: } \theta \leftarrow \theta(1-\gamma_t\lambda)
                - \mathrm{cl}_{\gamma_t U}(\gamma_t \hat{m}/d)                                \\
            &\hspace{10mm}\text{sync step: } m \leftarrow \mathrm{CompressedAllreduce}
                \big((1-\beta_1^t)\, a / \Gamma\big) \odot \mathrm{mask}, \;
                \theta \leftarrow \theta_{\mathrm{anchor}} K
                - \mathrm{cl}_{\Gamma U}(\Gamma \hat{m}/d), \;
                \theta_{\mathrm{anchor}} \leftarrow \theta, \; a, \Gamma, K \leftarrow 0, 0, 1
       \end{aligned}

    :math:`k` is the number of steps since the previous variance update (the schedule's
    interval) with ``var_decay="time"``, the default, and 1 with ``var_decay="update"``,
    the paper's update. With the paper's, v forgets by beta2 per update, so as the
    intervals grow it averages gradients from ever further back: at var_freeze_step it
    reflects the early, larger gradients and shrinks the compression stage's steps. With
    "time" v forgets at Adam's rate per step whatever the interval, so it tracks the current
    gradients and the compression stage keeps AdamW's step sizes; use "update" only to
    reproduce the paper.

    (the sync step first takes the local step's momentum and accumulation; its own local
    parameter update is replaced by the rebuild). :math:`\theta_{\mathrm{anchor}}` (the
    parameters at the last synchronization, set when the local stage begins),
    :math:`a`, :math:`\Gamma` and :math:`K` are identical on every rank after a sync, so
    every rank holds bitwise the same parameters after every synchronization; between
    them each rank follows its own momentum. The compressed allreduce's input is the
    interval's lr-weighted mean bias-corrected momentum, scaled back to momentum units:
    with :math:`H_j = 1` it is the momentum itself (OneBitAdam's step), and the error
    feedback carries over between all compressed steps. max_update bounds each coordinate
    of every compressed (and local) step to :math:`U` per unit of lr, as in OneBitAdam,
    and of every variance step after the first 1-bit step (their momentum carries decoded
    compressed momenta, whose values are of the size of a block scale: unbounded, a
    coordinate of a tiny variance, such as a nearly dead unit or a rare feature, would take
    a huge step); the mask (zero or negligible variance) is rebuilt after every variance update.

    Communication per step (4 ranks, n parameters, block scales aside): a variance step
    sends 2 (p-1)/p 4n bytes in one round per bucket; a 1-bit step or a sync about
    2 (p-1)/p n/8 bytes in 3 rounds (the finiteness agreement, an all-to-all, an
    all-gather); a local step 6 bytes in 1 round. `comm_stats` counts what was sent.

    The paper's defaults: var_update_scaler :math:`\kappa` = 16, local_step_scaler
    :math:`\alpha` = 32678 (DeepSpeed's default, meant to be derived from the learning-rate
    schedule; the paper's tutorial uses 1000), local_step_clipper :math:`H` = 16,
    var_freeze_step = 100000 (usually the end of the learning-rate warmup), var_decay
    "update", bias
    correction off in the paper's configurations (on here, as in the other lbcomm
    optimizers). For short runs scale var_freeze_step and local_step_scaler to the run
    (see bench/convergence.py). Differences from the removed DeepSpeed implementation:
    checkpoints carry the local-step state (anchor, accumulation, schedule counters,
    compression errors) and resume bitwise exactly, instead of resetting it on every
    load; NaN/Inf in any rank's gradients skips (or raises on) the same step on every rank.

    Memory: besides m and v, the local-step stage keeps two more fp32 copies of the model
    (the anchor and the accumulation); optimizer state is fp32 for fp16/bf16 parameters.
    The optimizer does all of its communication itself: with lbcomm's DDP hook the hook
    averages the first step only (`frozen` is True from then on, and param groups can no
    longer be added).

    Args:
        params (iterable): iterable of parameters or named parameters to optimize
            or iterable of dicts defining parameter groups.
        lr (float, optional): learning rate (default: 1e-3)
        betas (Tuple[float, float], optional): coefficients of the running averages of the
            gradient and its square (default: (0.9, 0.999))
        eps (float, optional): term added to the denominator (default: 1e-8)
        weight_decay (float, optional): decoupled weight decay, as in AdamW (default: 1e-2)
        var_freeze_step (int, optional): the last step at which the variance may be updated;
            local steps from the next one on (default: 100000)
        var_update_scaler (int, optional): :math:`\kappa`: the variance is updated
            :math:`\kappa` times at each interval 1, 2, 4, ... (default: 16)
        local_step_scaler (int, optional): :math:`\alpha`: the sync interval doubles every
            :math:`\alpha` synchronizations (default: 32678)
        local_step_clipper (int, optional): :math:`H`: the largest sync interval (default: 16)
        var_decay (str, optional): "time": a variance update after k steps decays v by
            beta2^k (as Adam's v over the same steps); "update": by beta2, the paper's
            (default: "time")
        bias_correction (bool, optional): divide m by 1-b1^t and v by 1-b2^(n_v);
            False gives the published formulas (default: True)
        block_size (int or None, optional): elements per scale block of the compressed
            allreduce; None: one scale per tensor, the published scheme
            (default: lbcomm.DEFAULT_BLOCK_SIZE)
        mask_threshold (float, optional): coordinates whose variance is at most
            mask_threshold times the mean variance have their momentum held at zero after
            every compressed allreduce (default: 1e-10)
        max_update (float, str or None, optional): the bound U of the compressed and local
            steps: a number > 0, "auto" (Adam's largest possible update) or None (unbounded,
            the published update); "warmup" is not supported (default: 1.0)
        nonfinite (str, optional): "raise" or "skip" a step whose gradients (on any rank)
            hold NaN/Inf; every rank does the same and the state is unchanged
            (default: "raise")
        bucket_cap_mb (float, optional): bucket size of the variance steps' allreduce
            (default: 25)
        detect_averaged_grads (bool, optional): raise when every rank holds the same
            gradients (a DDP without lbcomm's hook averaged them) (default: True)
        process_group (ProcessGroup, optional): the ranks to average over (default: the world)
        backend (str, optional): "torch", "mpi" or "auto", as in OneBitAdam (default: "auto")

    Example::

        >>> # xdoctest: +SKIP
        >>> optimizer = lbcomm.ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=4000,
        ...                                local_step_scaler=1000)
        >>> for x, y in loader:  # each rank its own shard of the global batch
        ...     optimizer.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     optimizer.step()
        >>> optimizer.comm_stats()["bytes_sent"]
    """
