"""1-bit Adam: AdamW during the warmup, then a frozen variance and a
1-bit compressed allreduce of the momentum."""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from ..config import DEFAULT_BLOCK_SIZE
from ..topology import Topology
from . import functional as F
from . import kernels
from .flat import FlatLayout
from .onebit import OneBitOptimizer

__all__ = ["OneBitAdam"]


class OneBitAdam(OneBitOptimizer):
    # the variance's step count in the warmup update (None: the step; ZeroOneAdam: the steps its updates cover)
    _WARMUP_VSTEP: Optional[str] = None
    # rescale_variance: EMA of local_grad_sq and its bias-corrected value at the freeze (-1: untracked)
    _param_vectors = {**OneBitOptimizer._param_vectors, "grad_sq": -1.0, "grad_sq_frozen": -1.0}

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        freeze_step: int = 100000,
        *,
        bias_correction: bool = True,
        block_size: Optional[int] = DEFAULT_BLOCK_SIZE,
        mask_threshold: float = 1e-10,
        max_update: Union[float, str, None] = 1.0,
        exact_numel: int = 4096,
        rescale_variance: bool = True,
        nonfinite: str = "raise",
        bucket_cap_mb: float = 25.0,
        detect_averaged_grads: bool = True,
        process_group=None,
        backend: str = "auto",
        topology: Union[str, "Topology", None] = "auto",
        shard_group=None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, freeze_step=freeze_step,
                        bias_correction=bias_correction, block_size=block_size, mask_threshold=mask_threshold,
                        max_update=max_update, exact_numel=exact_numel, rescale_variance=rescale_variance,
                        nonfinite=nonfinite,
                        bucket_cap_mb=bucket_cap_mb,
                        detect_averaged_grads=detect_averaged_grads)
        super().__init__(params, defaults, process_group=process_group, backend=backend, topology=topology,
                         shard_group=shard_group)

    def _warmup_bounds(self, L: FlatLayout) -> List[Optional[float]]:
        """Per parameter, the bound U of a warmup step (None: AdamW's update, unbounded)."""
        return [None] * len(L.params)

    def _warmup_update(self, L: FlatLayout, active: List[bool]) -> None:
        m, v = self._flat["exp_avg"], self._flat["exp_avg_sq"]
        bounds = self._warmup_bounds(L)
        for seg in self._segments(L, active, vstep=self._WARMUP_VSTEP):
            self._moments(seg)
            group = self.param_groups[seg.group]
            lr, wd = group["lr"], group["weight_decay"]
            bc1, bc2 = self._bias_corrections(group, seg)
            # the gradient buffer is consumed by now: it receives sqrt(v^) + eps
            d = F.denominator(v[seg.lo:seg.hi], bc2, group["eps"], out=self._grad_buf[seg.lo:seg.hi])
            for i in seg.idx:
                o = L.offsets[i] - seg.lo
                d_i = d[o:o + L.numels[i]].view(L.shapes[i])
                b = None if bounds[i] is None else lr * bounds[i]
                F.apply_fp32(L.tensor(i), lambda w, m_i=L.view(m, i), d_i=d_i, b=b: F.adamw_(w, m_i, d_i, lr * wd,
                                                                                             lr / bc1, b))

    def _compressed_update(self, L: FlatLayout) -> bool:
        m, v = self._flat["exp_avg"], self._flat["exp_avg_sq"]
        # decoded straight into m, and only once every rank has the result
        if not self._reduce_momentum(L, self._momentum_source(L), m):
            return False
        scratch = self._stage_buffer(L)
        bounds = self._update_bounds(L)
        include = self._participating(L)
        segs = self._segments(L, include, vstep="variance_step")
        factors, grad_sq = self._variance_factors(L, include)
        for seg in segs:
            group = self.param_groups[seg.group]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            bc1, bc2 = self._bias_corrections(group, seg)
            for i in seg.idx:
                # max_update U: |lr m^ / (sqrt(v^) + eps)| <= lr U for every coordinate
                step_bound = None if bounds[i] is None else lr * bounds[i]
                # rescale_variance: v^ f = v / (bc2 / f)
                bc2_i = bc2 if factors is None or factors[i] is None else bc2 / factors[i]
                F.apply_fp32(L.tensor(i), lambda w, i=i, b=step_bound, c=bc2_i: kernels.frozen_adamw_(
                    w, L.view(m, i), L.view(v, i), c, eps, lr * wd, lr / bc1, scratch, b))
        if grad_sq is not None:
            self._vectors["grad_sq"].copy_(grad_sq)
        return True


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
            &\hspace{10mm} m_t \leftarrow \mathrm{CompressedAllreduce}_{e,s}\big(
                \beta_1 m_{t-1} + (1-\beta_1) g_{t,r}\big) \odot \mathrm{mask}                     \\
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
    bitwise the unbounded update.

    rescale_variance keeps the frozen variance's scale current: a variance frozen early holds
    the gradients of the first steps, and as the gradients of a tensor shrink over the run,
    the frozen preconditioner makes its steps ever smaller than Adam's (the earlier the
    freeze, the larger the gap). Each
    tensor's frozen v^ is multiplied by q^_t / q^_freeze, q^ the bias-corrected EMA (beta2, the
    variance's own window) of the ranks' mean squared local gradient norm of that tensor, so
    that the factor is 1 at the freeze and follows the change of the gradient scale after it;
    the shape of the preconditioner inside the tensor stays frozen. The norms ride in
    collectives that exist (the warmup's gradient allreduce, the compression stage's
    finiteness agreement: one fp32 scalar per parameter tensor); with
    `lbcomm.ddp.onebit_optimizer_hook` the hook records them before it averages (one small
    allreduce per warmup step), and under FSDP2 the shards' norms are summed over the shard
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
        freeze_step (int, optional): warmup steps; the variance is frozen after this step and
            the momentum is compressed from the next one on. 15-25 % of the training is a
            good start (default: 100000)
        bias_correction (bool, optional): divide m by 1-b1^t and v by 1-b2^t (the latter
            frozen at freeze_step); False gives the published formulas (default: True)
        block_size (int or None, optional): elements per scale block of the compressed
            allreduce; None selects the published single-scale scheme
            (default: lbcomm.DEFAULT_BLOCK_SIZE)
        mask_threshold (float, optional): at the freeze, the momentum of coordinates whose
            variance is at most mask_threshold times the mean variance of all coordinates is
            held at zero; 0 masks exactly the coordinates with zero variance. The default
            also catches variances made of rounding noise only (e.g. attention key biases, to
            which softmax is invariant: their variance lies many orders of magnitude below
            the mean) (default: 1e-10)
        max_update (float, str or None, optional): in the compression stage, the bound U on
            each coordinate's |m^ / (sqrt(v^) + eps)|, so that no coordinate moves more than
            lr U per step (plus weight decay). A number > 0; "warmup": per parameter tensor,
            its largest |m^ / (sqrt(v^) + eps)| after the last warmup step (recorded at the
            freeze, saved in checkpoints); "auto": (1-b1) / sqrt((1-b2)(1-b1^2/b2)), the
            largest value Adam's update can take (7.27 at betas (0.9, 0.999), needs
            b1^2 < b2); None: the published, unbounded update (with block_size=None,
            exact_numel=0 and rescale_variance=False, exactly the published algorithm)
            (default: 1.0)
        exact_numel (int, optional): in the compression stage, the parameters of at most
            this many elements (whole parameters, also under FSDP2) get the exact mean of
            the ranks' gradients (summed in fp32 by the finiteness agreement's allreduce
            over the ranks the momentum is reduced over; on nodes by `hierarchical_mean_`)
            instead of 1-bit compression, their
            compression errors held at zero: biases, norm weights and small heads, where
            sign compression saves little and costs the most accuracy. Flat, hierarchical
            and FSDP2 alike. The INFO line at the freeze gives the share (a warning when it
            is most of the model); 0 compresses every parameter, as published (default: 4096,
            as onebit_hook)
        rescale_variance (bool, optional): scale each parameter tensor's frozen variance by
            the change of its gradients' mean square since the freeze (above), so that the
            compression stage keeps Adam's step size as the gradients shrink or grow; False:
            the published frozen variance. Checkpoints carry the statistic; one saved before
            the option resumes with False (a warning). If the warmup's gradients reach the
            optimizer averaged by anything but its own allreduce or onebit_optimizer_hook,
            the local norms are unknown: a warning, and the variance stays frozen
            (default: True)
        nonfinite (str, optional): what a step does when the averaged gradients (warmup) or
            the momenta of any rank (compression) hold NaN/Inf: "raise" a NonFiniteError
            on every rank, or "skip" the step on every rank (``last_step_skipped`` is set,
            e.g. for fp16 loss scaling). The state is unchanged either way (default: "raise")
        bucket_cap_mb (float, optional): bucket size of the warmup gradient allreduce
            (default: 25)
        detect_averaged_grads (bool, optional): with several ranks, raise
            `lbcomm.errors.AveragedGradientsError` when the gradients are identical on every
            rank at the first warmup step or the first compression step (a DDP without
            lbcomm's hook averaged them); costs 2 floats per rank in collectives the
            optimizer makes anyway, twice. Set False only when every rank really trains on
            the same batch (default: True)
        process_group (ProcessGroup, optional): the ranks to average over (default: the
            world; one rank, or no torch.distributed, means no communication)
        backend (str, optional): "torch" (torch.distributed), "mpi" (mpi4py, launched with
            mpirun; `process_group` is then an mpi4py communicator or None) or "auto":
            torch.distributed when initialized, else MPI under mpirun; every collective goes
            through `lbcomm.comm.get_transport` (default: "auto")
        topology (Topology, str or None, optional): nodes of fast-linked ranks
            (`lbcomm.topology`): with a Topology of several nodes of several ranks, the
            compression stage reduces the momentum hierarchically (fp32 reduce-scatter
            inside the node, 1 bit across nodes, all-gather: G times less traffic between
            nodes than the flat call, for one more model-sized fp32 buffer); "auto" makes
            one with `Topology.auto` under torchrun with more than one node (world group,
            torch.distributed only) and is flat otherwise; "flat" or None: the flat call
            over `process_group`. Checkpoints carry the hierarchical errors; loading them
            on another topology resets them with a logged warning, like a world-size
            change (default: "auto")
        shard_group (ProcessGroup, optional): for FSDP2-sharded (DTensor) parameters, the
            ranks holding the other shards; set by `lbcomm.fsdp.onebit_optimizer`, which
            is the way to build an optimizer for a sharded model (default: None)

    Example::

        >>> # xdoctest: +SKIP
        >>> optimizer = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2000)
        >>> for x, y in loader:  # each rank its own shard of the global batch
        ...     optimizer.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     optimizer.step()
    """
