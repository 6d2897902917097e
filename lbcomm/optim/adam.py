"""1-bit Adam: AdamW during the warmup, then a frozen variance and a 1-bit compressed
allreduce of the momentum (the 1-bit machinery is the `OneBitStage` it holds; the update
math is `functional` / `kernels`; rescale_variance is `rescale.VarianceRescale`).

`adamw_warmup_` and `frozen_adamw_step_` are the two Adam updates over the flat state,
shared with `ZeroOneAdam`."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from torch import Tensor

from ..config import CommConfig, OneBitOptions, resolve, resolve_options
from . import functional as F
from . import kernels
from .base import BaseOptimizer
from .flat import FlatLayout
from .flatstate import FlatState
from .freeze import check_freeze_option as check_freeze_step
from .onebit import OneBitStage
from .rescale import VECTORS as RESCALE_VECTORS
from .rescale import VarianceRescale

__all__ = ["OneBitAdam", "adamw_warmup_", "frozen_adamw_step_", "check_freeze_step"]


def adamw_warmup_(fs: FlatState, L: FlatLayout, active: List[bool], bounds: List[Optional[float]],
                  vstep: Optional[str] = None, decay_steps: int = 1) -> None:
    """AdamW on the averaged gradients in ``fs.grad_buf`` (`fs`: the optimizer's flat state)
    for the `active` parameters (`bounds`: per parameter, max_update's U of the step, None:
    AdamW's unbounded update; `vstep`: the vector counting the variance's steps;
    `decay_steps`: the variance decays by beta2 to that power)."""
    v = fs.buffers["exp_avg_sq"]
    m = fs.buffers["exp_avg"]
    for seg in fs.segments(L, active, vstep=vstep):
        fs.moments(seg, decay_steps)
        group = fs.param_groups[seg.group]
        lr, wd = group["lr"], group["weight_decay"]
        bc1, bc2 = fs.bias_corrections(group, seg)
        # the gradient buffer is consumed by now: it receives sqrt(v^) + eps
        d = F.denominator(v[seg.lo:seg.hi], bc2, group["eps"], out=fs.grad_buf[seg.lo:seg.hi])
        for i in seg.idx:
            o = L.offsets[i] - seg.lo
            d_i = d[o:o + L.numels[i]].view(L.shapes[i])
            b = None if bounds[i] is None else lr * bounds[i]
            F.apply_fp32(L.tensor(i), lambda w, m_i=L.view(m, i), d_i=d_i, b=b: F.adamw_(w, m_i, d_i, lr * wd,
                                                                                         lr / bc1, b))


def frozen_adamw_step_(fs: FlatState, stage: OneBitStage, L: FlatLayout,
                       factors_of: Optional[Callable[[List[bool]], Optional[Sequence]]] = None) -> bool:
    """The compression stage's step: the new momentum reduced by `stage` straight into m
    (only once every rank has the result; decoded under max_update's caps, see
    `OneBitStage.decode_caps`), then AdamW with the frozen variance, each coordinate's step
    bounded by max_update; `factors_of(participating)` (rescale_variance, called
    once the step counts have advanced) gives per parameter a factor of its v^ or None.
    False when the reduction saw NaN/Inf (state unchanged). Where the reducer leaves the
    result's caps to this update (on the CPU), the update caps m from the root it takes
    anyway, which spares the decode a pass over the variance."""
    m, v = fs.buffers["exp_avg"], fs.buffers["exp_avg_sq"]
    applied, bounds, segs, factors, left = stage.step_and_reduce(L, stage.participating(L), stage.momentum_source(L),
                                                                 m, factors_of, caps_in_update=True)
    if not applied:
        return False
    caps = [None] * len(L.params) if left is None else left
    scratch = stage.stage_buffer(L)
    for seg in segs:
        group = fs.param_groups[seg.group]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        bc1, bc2 = fs.bias_corrections(group, seg)
        for i in seg.idx:
            # max_update U: |lr m^ / (sqrt(v^) + eps)| <= lr U for every coordinate
            step_bound = None if bounds[i] is None else lr * bounds[i]
            c = F.rescaled_bc2(bc2, factors, i)  # rescale_variance
            F.apply_fp32(L.tensor(i), lambda w, i=i, b=step_bound, c=c: kernels.frozen_adamw_(
                w, L.view(m, i), L.view(v, i), c, eps, lr * wd, lr / bc1, scratch, b, caps[i]))
    return True


class OneBitAdam(BaseOptimizer):
    _GLOBAL_OPTIONS = ("freeze_step",)
    _param_vectors: Dict[str, float] = {**OneBitStage.VECTORS, **RESCALE_VECTORS}

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        freeze_step: Union[int, str] = 100000,
        *,
        comm: Optional[CommConfig] = None,
        options: Optional[OneBitOptions] = None,
    ) -> None:
        comm, self.options = resolve_options(options, resolve(comm, "OneBitAdam"), "OneBitAdam")
        o = self.options
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, freeze_step=freeze_step,
                        bias_correction=o.bias_correction, rescale_variance=o.rescale_variance)
        super().__init__(params, defaults, comm)
        self._onebit = OneBitStage(self.flat_state, o, exact_numel=self.comm.exact_numel)
        self._rescale = self.flat_state.local_stat = VarianceRescale(self.flat_state)

    def _validate_group(self, group) -> None:
        super()._validate_group(group)
        check_freeze_step("freeze_step", group["freeze_step"])
        F.resolve_max_update(self.options.max_update, group["betas"])
        if not isinstance(group["rescale_variance"], bool):
            raise ValueError(f"Invalid rescale_variance: {group['rescale_variance']!r} (must be True or False)")

    # ------------------------------------------------------------------ public API
    @property
    def compression_state(self):
        """The reducer of the momentum (`lbcomm.reducer.Reducer`: a CompressionState, flat,
        or a HierarchicalState, nodes of several ranks); None before the freeze and with one rank."""
        return self._onebit.reducer

    @property
    def frozen_after(self) -> Optional[int]:
        """The step after which the variance was frozen (the fixed freeze option, or the step
        "auto" decided on); None until then."""
        return self._onebit.frozen_after(self.frozen)

    def compression_stats(self) -> Dict[str, Any]:
        """The momentum reducer's `lbcomm.common.compressor_stats` (zeros before the freeze),
        and ``status``: "compressing", or why nothing is compressed (the warmup, one rank)."""
        return self._onebit.report.stats()

    def bytes_per_step(self) -> Optional[Dict[str, int]]:
        """What this rank sends per compression-stage step: {"compressed", "exact" (the
        exact_numel parameters' fp32 mean), "agreement" (the finiteness check), "total"};
        with a hierarchical reduction the first two count the bytes between nodes; None
        before the freeze and with one rank."""
        return self._onebit.report.bytes_per_step()

    @property
    def masked_coordinates(self) -> int:
        """How many momentum coordinates are held at zero (0 before the freeze)."""
        return self._onebit.masked_coordinates

    def set_momentum_mask(self, param: Tensor, mask: Optional[Tensor]) -> None:
        """Override the automatic zero-variance mask for one parameter.

        Args:
            param (Tensor): a parameter of this optimizer.
            mask (Tensor or None): bool tensor of param's shape, True where the parameter is
                trained after the freeze and False where its momentum is held at zero; None
                returns to the automatic mask (coordinates whose variance is zero, or at most
                options.mask_threshold times the mean, at the freeze are held at zero).
        """
        self._onebit.set_momentum_mask(self._prepare(), param, mask)

    # ------------------------------------------------------------------ step
    def _take_step(self, L: FlatLayout) -> bool:
        st = self._onebit
        if not st.frozen:
            taken = self._warmup_step(L)
            self._rescale.fold_warmup(L, taken)
            return taken
        # The gradients are read where autograd left them; all ranks first agree they are finite.
        if not st.grads_finite(L):
            return self._nonfinite("the local gradients")
        if not frozen_adamw_step_(self.flat_state, st, L, self._rescale.factors_of(L)):
            return self._nonfinite("the new momenta")
        self._rescale.commit()
        st.report.watch_lr()
        return True

    def _warmup_update(self, L: FlatLayout, active: List[bool]) -> None:
        adamw_warmup_(self.flat_state, L, active, [None] * len(L.params))

    def _load_extra_state(self, state, extra) -> None:
        self._rescale.loaded()
        super()._load_extra_state(state, extra)

    def _after_step(self, L: FlatLayout) -> None:
        if not self.frozen and self._onebit.freeze_due(L):
            self._onebit.freeze(L)
            self._rescale.record_reference(L)
            self._attach_views()
            self._onebit.report.log_freeze(L)


OneBitAdam.__doc__ = r"""Implements 1-bit Adam: AdamW in the warmup, then a frozen variance
    and one 1-bit compressed allreduce of the momentum per step.

    .. math::
       \begin{aligned}
            &\rule{110mm}{0.4pt}                                                                 \\
            &\textbf{input}: \gamma \text{ (lr)}, \beta_1, \beta_2 \text{ (betas)},
                \epsilon, \lambda \text{ (weight decay)}, T_w \text{ (freeze\_step)},
                p \text{ ranks}                                                                  \\
            &\textbf{initialize}: m_0 \leftarrow 0, \: v_0 \leftarrow 0,
                \: e \leftarrow 0, \: s \leftarrow 0 \text{ (error feedback)}                     \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                                 \\
            &\textbf{for} \: t=1 \: \textbf{to} \: \ldots \: \textbf{do}                         \\
            &\hspace{5mm}g_{t,r} \leftarrow \nabla_{\theta} f_{t,r}(\theta_{t-1})
                \text{ on rank } r                                                               \\
            &\hspace{5mm}\textbf{if} \: t \leq T_w \text{ (warmup)}:                              \\
            &\hspace{10mm} g_t \leftarrow \tfrac{1}{p}\textstyle\sum_r g_{t,r}
                \text{ (bucketed allreduce)}                                                     \\
            &\hspace{10mm} m_t \leftarrow \beta_1 m_{t-1} + (1-\beta_1) g_t                       \\
            &\hspace{10mm} v_t \leftarrow \beta_2 v_{t-1} + (1-\beta_2) g_t^2                     \\
            &\hspace{10mm} \hat{v} \leftarrow v_t / (1-\beta_2^t)                                  \\
            &\hspace{5mm}\textbf{else} \text{ (compression)}:                                     \\
            &\hspace{10mm} m_t \leftarrow \mathrm{CompressedAllreduce}_{e,s,c}\big(
                \beta_1 m_{t-1} + (1-\beta_1) g_{t,r}\big) \odot \mathrm{mask}                     \\
            &\hspace{10mm} \text{(decoded values capped at } c = U \, (1-\beta_1^t)
                (\sqrt{\hat{v}} + \epsilon) \text{, capped\_decode)}                            \\
            &\hspace{10mm} \hat{v} \leftarrow v_{T_w} / (1-\beta_2^{T_w}) \text{ (frozen)}         \\
            &\hspace{10mm} \hat{v} \leftarrow \hat{v} \, \hat{q}_t / \hat{q}_{T_w}
                \text{ (rescale\_variance, per parameter tensor)}                               \\
            &\hspace{10mm} \mathrm{mask} = [v_{T_w} > \tau \, \mathrm{mean}(v_{T_w})]
                \text{ (}\tau\text{: mask\_threshold; or set by the user)}                    \\
            &\hspace{5mm}q_t \leftarrow \beta_2 q_{t-1} + (1-\beta_2)\tfrac{1}{p}\textstyle\sum_r
                \|g_{t,r}\|^2, \: \hat{q}_t \leftarrow q_t / (1-\beta_2^t)
                \text{ (per parameter tensor)}                                                   \\
            &\hspace{5mm}\hat{m} \leftarrow m_t / (1-\beta_1^t), \:
                u \leftarrow \hat{m} / (\sqrt{\hat{v}} + \epsilon)                                \\
            &\hspace{5mm}\textbf{if} \: t > T_w \textbf{ and } U \neq \text{None}:
                u \leftarrow \mathrm{clamp}(u, -U, U) \text{ (per coordinate; } U
                \text{: max\_update)}                                                            \\
            &\hspace{5mm}\theta_t \leftarrow \theta_{t-1} - \gamma \lambda \theta_{t-1}
                - \gamma u                                                                       \\
            &\rule{110mm}{0.4pt}                                                          \\[-1.ex]
       \end{aligned}

    The warmup is exactly :class:`torch.optim.AdamW` on the gradients averaged over the
    ranks (the optimizer averages them itself, fused into buckets, unless a DDP hook has
    set `grads_averaged`). The mask holds at zero the momentum of coordinates whose
    variance is zero (or negligible, see mask_threshold) at the freeze: they never saw a
    gradient (unused embedding rows, constant input features), and the compression noise
    in their momentum would move them by noise / eps. Override it per parameter with
    :meth:`set_momentum_mask`.

    max_update makes the compression stage safe by construction: sign compression gives
    every coordinate of a block the block's magnitude, so a coordinate whose frozen variance
    is far below its block's (a nearly dead unit, a rarely active feature, a rarely seen
    embedding row) would get a step of lr x scale / sqrt(v), orders of magnitude above any
    full-precision step, and oscillate into divergence. With U = 1 no coordinate moves more
    than lr per step (plus weight decay): the most a coordinate with steady gradients gets
    from Adam with a frozen variance, since |E g| <= sqrt(E g^2). An unclamped coordinate gets
    bitwise the unbounded update. With options.capped_decode (default) the bound also caps
    each coordinate's decoded momentum inside the compressed allreduce at c, the momentum
    whose step is the bound, and the error feedback keeps what the cap held back for later
    steps instead of the clamp discarding it (docs/concepts.md, "max_update").

    rescale_variance keeps the frozen variance's scale current: a variance frozen early holds
    the gradients of the first steps, and as the gradients of a tensor shrink over the run,
    the frozen preconditioner makes its steps ever smaller than Adam's (the earlier the
    freeze, the larger the gap). Each
    tensor's frozen v^ is multiplied by q^_t / q^_freeze, q^ the bias-corrected EMA (beta2, the
    variance's own window) of the ranks' mean squared local gradient norm of that tensor, so
    that the factor is 1 at the freeze and follows the change of the gradient scale after it;
    the shape of the preconditioner inside the tensor stays frozen. The norms ride in
    collectives that exist (the warmup's gradient allreduce, the compression stage's
    finiteness agreement: one fp32 scalar per parameter tensor); with lbcomm's warmup hook
    the hook hands the local gradients over first (`note_local_grads`; one small allreduce
    per warmup step), and under FSDP2 the shards' norms are summed over the shard
    group (one small allreduce per step). max_update still bounds every coordinate's step.

    All momenta live in one flat fp32 buffer, so
    one compressed allreduce serves the whole model; optimizer state is fp32 for
    fp16/bf16 parameters too. Parameters that never received a gradient during the warmup
    are not updated after the freeze.

    Args:
        params (iterable): iterable of parameters or named parameters to optimize
            or iterable of dicts defining parameter groups.
        lr (float, optional): learning rate (default: 1e-3)
        betas (Tuple[float, float], optional): coefficients of the running averages of the
            gradient and its square (default: (0.9, 0.999))
        eps (float, optional): term added to the denominator (default: 1e-8)
        weight_decay (float, optional): decoupled weight decay, as in AdamW (default: 1e-2)
        freeze_step (int or str, optional): warmup steps; the variance is frozen after this
            step and the momentum is compressed from the next one on; "auto": the optimizer
            freezes it once it has settled and the lr warmup is over (`lbcomm.optim.freeze`,
            docs/optimizers.md) (default: 100000)
        comm (lbcomm.CommConfig, optional): the communication settings (default: CommConfig()).
            What they do here: ``block_size``, the compressed allreduce's scale blocks
            (None: the published single-scale scheme); ``exact_numel``, the parameters of
            at most this many elements get the exact mean of the ranks' gradients in the
            compression stage instead of 1-bit compression, their errors held at zero
            (biases, norm weights, small heads; flat, hierarchical and FSDP2 alike; 0
            compresses every parameter, as published); ``nonfinite``, "skip" (every rank skips a step whose averaged
            gradients or new momenta hold NaN/Inf on any rank, ``last_step_skipped`` is set)
            or "raise" a NonFiniteError on every rank, the state unchanged either way;
            ``bucket_cap_mb``, the warmup allreduce's buckets; ``detect_averaged_grads``,
            raise `lbcomm.errors.AveragedGradientsError` when the gradients are identical on
            every rank at the first warmup or compression step (False only when every rank
            really trains on the same batch); ``process_group`` / ``backend``, the ranks to
            average over and the transport (`lbcomm.comm.get_transport`); ``topology``,
            nodes of fast-linked ranks: a `Topology` of several nodes reduces the momentum
            hierarchically (fp32 inside the node, 1 bit across nodes: G times less traffic
            between nodes for one more model-sized fp32 buffer), "auto" makes one with
            `Topology.auto` under torchrun with more than one node (world group,
            torch.distributed only), "flat" the flat call; checkpoints carry the errors, and
            loading them on another topology resets them with a logged warning, like a
            world-size change; ``shard_group``, set by `lbcomm.fsdp.onebit_optimizer`, the
            way to build an optimizer for an FSDP2-sharded model.
        options (lbcomm.OneBitOptions, optional): the compression stage's math (default:
            OneBitOptions()): ``max_update``, the bound U on each coordinate's
            |m^ / (sqrt(v^) + eps)| in the compression stage (a number > 0; "warmup": per
            parameter tensor its largest value after the last warmup step, recorded at the
            freeze and checkpointed; "auto": (1-b1) / sqrt((1-b2)(1-b1^2/b2)), Adam's largest
            possible update, 7.27 at betas (0.9, 0.999), needs b1^2 < b2; None: the
            published, unbounded update, exactly the published algorithm together with
            ``CommConfig(block_size=None, exact_numel=0)`` and rescale_variance=False);
            ``capped_decode``, the bound inside the compressed allreduce (above);
            ``mask_threshold``, at the freeze the momentum of coordinates whose variance is
            at most mask_threshold times the mean variance is held at zero (0: exactly the
            zero-variance ones; the default also catches variances of rounding noise, e.g.
            attention key biases); ``rescale_variance``, scale each parameter tensor's frozen
            variance by the change of its gradients' mean square since the freeze (above),
            so that the compression stage keeps Adam's step size as the gradients shrink or
            grow; False: the published frozen variance. Checkpoints carry the statistic. If
            the warmup's gradients reach the optimizer averaged by anything but its own
            allreduce or lbcomm's warmup hook, the local norms are unknown: a warning, and
            the variance stays frozen; ``bias_correction``, divide m by 1-b1^t and v by
            1-b2^t (the latter frozen at freeze_step); False gives the published formulas.

    Example::

        >>> # xdoctest: +SKIP
        >>> optimizer = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2000)
        >>> for x, y in loader:  # each rank its own shard of the global batch
        ...     optimizer.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     optimizer.step()
    """
