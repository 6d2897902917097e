"""0/1 Adam (Lu et al., 2022): the variance updated on an exponentially spaced schedule and
then frozen, 1-bit compressed momentum synchronization, and after the freeze local steps
between synchronizations on a growing interval. It holds a `OneBitStage` (the mask, the
finiteness agreement, the compressed momentum allreduce, max_update) and shares Adam's
updates with `OneBitAdam` (`adam.adamw_warmup_`, `adam.frozen_adamw_step_`); the equations
are in `ZeroOneAdam`'s docstring. It runs on the flat compressed reduction only."""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple, Union

from torch import Tensor

from ..comm import get_transport
from ..comm.counting import CountingTransport
from ..config import CommConfig, OneBitOptions, resolve, resolve_options
from . import functional as F
from .adam import adamw_warmup_, check_freeze_step, frozen_adamw_step_
from .freeze import AUTO
from .base import BaseOptimizer
from .flat import FlatLayout
from . import local_steps
from .onebit import OneBitStage
from .rescale import VECTORS as RESCALE_VECTORS
from .rescale import VarianceRescale

__all__ = ["ZeroOneAdam"]

_log = logging.getLogger(__name__)

_KINDS = ("variance", "onebit", "local", "sync")


def _positive_int(group: Dict[str, Any], name: str) -> None:
    value = group[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {name}: {value!r} (must be an int >= 1)")


class ZeroOneAdam(BaseOptimizer):
    _GLOBAL_OPTIONS = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "var_decay")
    # interval_lr: sum of the lrs since the last synchronization; interval_keep: product of
    # the weight-decay factors (1 - lr wd) since then (fp32, per parameter, checkpointed)
    _param_vectors: Dict[str, float] = {**OneBitStage.VECTORS, **RESCALE_VECTORS, "interval_lr": 0.0,
                                        "interval_keep": 1.0}
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
        var_freeze_step: Union[int, str] = 100000,
        *,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        var_decay: str = "time",
        comm: Optional[CommConfig] = None,
        options: Optional[OneBitOptions] = None,
    ) -> None:
        comm, self.options = resolve_options(options, resolve(comm, "ZeroOneAdam"), "ZeroOneAdam")
        o = self.options
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, var_freeze_step=var_freeze_step,
                        var_update_scaler=var_update_scaler, local_step_scaler=local_step_scaler,
                        local_step_clipper=local_step_clipper, var_decay=var_decay, bias_correction=o.bias_correction,
                        rescale_variance=o.rescale_variance)
        self._schedule = local_steps.initial_schedule()
        self._last_kind: Optional[str] = None
        self._counts = {k: 0 for k in _KINDS}
        super().__init__(params, defaults, comm)
        # the parameters of at most comm.exact_numel elements averaged exactly, the flat reduction only
        self._onebit = OneBitStage(self.flat_state, self.options, exact_numel=self.comm.exact_numel, flat_only=True,
                                   freeze_option="var_freeze_step")
        self._rescale = self.flat_state.local_stat = VarianceRescale(self.flat_state)

    # ------------------------------------------------------------------ options
    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        check_freeze_step("var_freeze_step", group["var_freeze_step"])
        for name in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            _positive_int(group, name)
        if group["var_decay"] not in ("time", "update"):
            raise ValueError(f"Invalid var_decay: {group['var_decay']!r} (must be 'time' or 'update')")
        if not isinstance(group["rescale_variance"], bool):
            raise ValueError(f"Invalid rescale_variance: {group['rescale_variance']!r} (must be True or False)")
        if self.options.max_update == "warmup":
            raise ValueError("Invalid max_update: 'warmup' is not supported by ZeroOneAdam (its variance keeps "
                             "changing until var_freeze_step); use a number, 'auto' or None")
        F.resolve_max_update(self.options.max_update, group["betas"])

    # ------------------------------------------------------------------ public API
    @property
    def transport(self) -> CountingTransport:
        """The `lbcomm.comm` transport of `process_group`, wrapped in a `CountingTransport`
        (what `comm_stats` reports)."""
        if self._transport is None:
            self._transport = CountingTransport(get_transport(self.process_group, backend=self.comm.backend))
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
        return local_steps.interval(s["syncs"], self._option("local_step_scaler"), self._option("local_step_clipper"))

    @property
    def frozen_after(self) -> Optional[int]:
        """The step after which the variance was frozen for good (the fixed freeze option, or the step
        "auto" decided on); None until then."""
        return self._onebit.frozen_after(self.local_steps_started)

    def compression_stats(self) -> Dict[str, Any]:
        """The momentum reducer's `lbcomm.common.compressor_stats` (zeros before the first
        step), and ``status``: "compressing", or why nothing is compressed."""
        return self._onebit.report.stats()

    def comm_stats(self) -> Dict[str, int]:
        """What this rank has sent so far: ``bytes_sent``, ``rounds`` (collectives started; a
        bucketed allreduce counts one per bucket), and the steps taken by kind:
        ``variance_steps`` (full-precision gradient allreduce, the variance updated),
        ``onebit_steps`` (compressed momentum, before var_freeze_step), ``local_steps`` (no
        communication but the finiteness agreement) and ``sync_steps``. Checkpointed."""
        tr = self.transport
        return {"bytes_sent": tr.bytes_sent, "rounds": tr.rounds,
                **{f"{k}_steps": v for k, v in self._counts.items()}}

    @property
    def compression_state(self):
        """The reducer of the momentum (a flat CompressionState); None before the first step and with one rank."""
        return self._onebit.reducer

    @property
    def masked_coordinates(self) -> int:
        """How many momentum coordinates are held at zero."""
        return self._onebit.masked_coordinates

    def set_momentum_mask(self, param: Tensor, mask: Optional[Tensor]) -> None:
        """Override the automatic zero-variance mask for one parameter, as `OneBitAdam.set_momentum_mask`."""
        self._onebit.set_momentum_mask(self._prepare(), param, mask)

    # ------------------------------------------------------------------ layout
    def _buffer_names(self) -> tuple:
        return self._flat_buffers + (self._local_buffers if self._schedule["local"] else ())

    # ------------------------------------------------------------------ step
    # rescale_variance's statistic (``flat_state.local_stat``) rides in every step's one collective:
    # the variance steps' gradient allreduce, the other steps' finiteness agreement
    def _take_step(self, L: FlatLayout) -> bool:
        t, s, st, fs = self.global_step + 1, self._schedule, self._onebit, self.flat_state
        if not self.frozen or t == s["next_var"]:
            self._last_kind = "variance"
            taken = self._variance_step(L)
            self._rescale.fold_warmup(L, taken)
            return taken
        # every rank agrees that the local gradients are finite (4 bytes, and the rescale's
        # statistic), so that every rank skips the same steps and the syncs stay aligned
        if not s["local"]:
            self._last_kind = "onebit"  # OneBitAdam's compression step with the current variance
            if not st.grads_finite(L):
                return self._nonfinite("the local gradients")
            if not frozen_adamw_step_(fs, st, L, self._rescale.factors_of(L)):
                return self._nonfinite("the new momenta")
            self._rescale.commit()
            return True
        self._last_kind = "sync" if t == s["next_sync"] else "local"
        if not st.grads_finite(L):
            return self._nonfinite("the local gradients")
        if self._last_kind == "sync":
            if not local_steps.sync_step_(fs, st, L, self._rescale.factors_of(L)):
                return self._nonfinite("the synchronized momenta")
        else:
            local_steps.local_step_(fs, st, L, self._rescale.factors_of(L))
        self._rescale.commit()
        st.report.watch_lr("var_freeze_step")  # the variance is frozen for good from here on
        return True

    def _variance_step(self, L: FlatLayout) -> bool:
        """AdamW on the gradients averaged at full precision, the variance updated."""
        if not self.frozen:
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
        paper) 1."""
        if self._option("var_decay") != "time":
            return 1
        return 2 ** (self._schedule["var_updates"] // self._option("var_update_scaler"))

    def _warmup_update(self, L: FlatLayout, active: List[bool]) -> None:
        """AdamW whose variance covers the steps since its last update (the bias correction
        counts them in variance_step, the decay is beta2 to their number). A variance step
        after the first 1-bit step takes its momentum from decoded compressed momenta:
        max_update bounds it as it bounds the compressed steps (coordinates of a tiny
        variance would otherwise move by lr x block scale / sqrt(v) and blow up). The steps
        before any compression are AdamW's."""
        idx = [i for i, on in enumerate(active) if on]
        gap = self._variance_gap()
        if idx:
            self.flat_state.vectors["variance_step"][idx] += gap
        bounds = self._onebit.update_bounds(L) if self._counts["onebit"] else [None] * len(L.params)
        adamw_warmup_(self.flat_state, L, active, bounds, vstep="variance_step", decay_steps=gap)

    def _after_step(self, L: FlatLayout) -> None:
        t, s, kind = self.global_step, self._schedule, self._last_kind
        self._counts[kind] += 1
        if kind == "variance":
            s["var_updates"] += 1
            nxt = t + 2 ** (s["var_updates"] // self._option("var_update_scaler"))
            limit = self._option("var_freeze_step")
            s["next_var"] = nxt if limit == AUTO or nxt <= limit else 0
            if not self.frozen:  # the reducer and the mask, from the first step on
                self._onebit.freeze(L)
                self._attach_views()
                self._onebit.report.log_freeze(L)
            else:
                self._onebit.build_mask(L)  # the variance changed
            self._rescale.record_reference(L)
            # 1-bit steps follow: the averaged gradients' buffer is dead until the next
            # variance step allocates it again
            if s["next_var"] != t + 1:
                self.flat_state.grad_buf = None
        elif kind == "sync":
            s["syncs"] += 1
            s["next_sync"] = t + local_steps.interval(s["syncs"], self._option("local_step_scaler"),
                                                      self._option("local_step_clipper"))
        # "auto" checks on the variance steps only: the variance changes on those
        if not s["local"] and self._onebit.freeze_due(L, vstep="variance_step",
                                                        check=kind == "variance"):
            self._start_local_steps(L)

    def _start_local_steps(self, L: FlatLayout) -> None:
        s = self._schedule
        fs = self.flat_state
        s.update(local=True, next_var=0, syncs=0, next_sync=fs.global_step + 1)
        local_steps.start_(fs, L)
        self._attach_views()
        _log.info("%s: variance frozen for good after step %s (%s variance updates); local steps from now on, "
                  "synchronized every min(2^(j // %s), %s) steps", type(self).__name__, fs.global_step,
                  s["var_updates"], self._option("local_step_scaler"), self._option("local_step_clipper"))

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
        self._schedule = {k: saved[k] for k in local_steps.initial_schedule()}
        self._counts = {k: int(saved["counts"][k]) for k in _KINDS}
        tr = self.transport
        tr.bytes_sent, tr.rounds = int(saved["bytes_sent"]), int(saved["rounds"])
        self._rescale.loaded()
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
            &\hat{m} = m / (1-\beta_1^t), \; d = \sqrt{f_t\, v / (1-\beta_2^{n_v})} + \epsilon
                \text{ (} n_v \text{: steps covered by the variance updates so far)}, \;
                \mathrm{cl}_c(x) = \mathrm{clamp}(x, -c, c)                                 \\
            &f_t = \hat{q}_t / \hat{q}_{t_v} \text{ per parameter tensor (rescale\_variance; 1 at a
                variance step and without it), } q \leftarrow \beta_2 q + (1-\beta_2)
                \tfrac{1}{p}\textstyle\sum_r \lVert g_r \rVert^2 \text{ every step}, \;
                t_v \text{: the last variance step}                                          \\
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

    rescale_variance (the default) keeps v's scale current between variance updates and,
    above all, after var_freeze_step, as OneBitAdam's does after its freeze: each tensor's
    :math:`\hat{v}` is multiplied by :math:`f_t`, the change of the ranks' mean squared
    local gradient norm since the last variance step. Without it a variance frozen while the
    gradients were larger makes every later step smaller than AdamW's at the same lr (the
    local steps use each step's factor; a sync rebuilds with the factor of its own step).

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
    With options.capped_decode (default) every compressed allreduce (1-bit step and sync)
    decodes each coordinate to at most the momentum whose step is that bound, as in
    OneBitAdam, and its error feedback keeps the rest.

    At AdamW's lr and schedule ZeroOneAdam trails AdamW more than OneBitAdam does, most at
    the top lrs and no less on long runs: its two savings over OneBitAdam, the 1-bit steps between the
    variance steps (from the 17th step on with var_update_scaler 16, where OneBitAdam trains
    at full precision up to its freeze) and the local steps, compound there. With
    var_update_scaler=1000 (every step up to var_freeze_step a variance step) and
    local_step_clipper=1 its final losses are OneBitAdam's to about 1 %, and so are its
    bytes. The measured cells are in docs/optimizers.md ("Same hyperparameters as the
    twin").

    Communication per step (4 ranks, n parameters, block scales aside): a variance step
    sends 2 (p-1)/p 4n bytes in one round per bucket; a 1-bit step or a sync about
    2 (p-1)/p n/8 bytes in 3 rounds (the finiteness agreement, an all-to-all, an
    all-gather), plus the fp32 mean of the ``exact_numel`` parameters (riding in the
    agreement at a 1-bit step, one more round at a sync); a local step 2 (p-1)/p 4 bytes
    in 1 round. rescale_variance adds one fp32 per parameter tensor to each step's one
    small collective (the agreement, or the variance step's allreduce): a local step then
    sends 2 (p-1)/p 4 (1 + tensors) bytes. `comm_stats` counts what was sent.

    The paper's defaults: var_update_scaler :math:`\kappa` = 16, local_step_scaler
    :math:`\alpha` = 32678 (DeepSpeed's default, meant to be derived from the learning-rate
    schedule; the paper's tutorial uses 1000), local_step_clipper :math:`H` = 16,
    var_freeze_step = 100000 (usually the end of the learning-rate warmup), var_decay
    "update", bias
    correction off in the paper's configurations (on here, as in the other lbcomm
    optimizers), no rescale_variance. For short runs scale var_freeze_step and local_step_scaler to the run
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
        var_freeze_step (int or str, optional): the last step at which the variance may be
            updated; local steps from the next one on; "auto": decided on the variance steps
            by the rule of `OneBitAdam`'s freeze_step="auto" (default: 100000)
        var_update_scaler (int, optional): :math:`\kappa`: the variance is updated
            :math:`\kappa` times at each interval 1, 2, 4, ... (default: 16)
        local_step_scaler (int, optional): :math:`\alpha`: the sync interval doubles every
            :math:`\alpha` synchronizations (default: 32678)
        local_step_clipper (int, optional): :math:`H`: the largest sync interval (default: 16)
        var_decay (str, optional): "time": a variance update after k steps decays v by
            beta2^k (as Adam's v over the same steps); "update": by beta2, the paper's
            (default: "time")
        comm (lbcomm.CommConfig, optional): the communication settings, as in
            :class:`OneBitAdam`, with these differences: ``topology`` "auto" resolves to the
            flat reduction (the local steps and syncs are built on it; a `Topology` of
            several nodes raises ValueError); ``exact_numel``'s parameters take the exact
            mean in place of the compressed one at every 1-bit step (from the mean gradient,
            as OneBitAdam's) and every sync (the mean of the ranks' inputs, one fp32
            allreduce of those coordinates), and local steps between syncs as the others;
            ``nonfinite`` applies to every rank's gradients (default: CommConfig())
        options (lbcomm.OneBitOptions, optional): as in :class:`OneBitAdam`, with these
            differences: ``max_update`` "warmup" is not supported; ``rescale_variance``
            scales each parameter tensor's variance between variance updates, and after
            var_freeze_step, by the change of its gradients' mean square (False: the
            published stale variance); ``bias_correction`` divides v by 1-b2^(n_v), n_v the
            variance updates so far (default: OneBitOptions())

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
