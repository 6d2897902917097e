"""Plain-torch, step-by-step simulation of `lbcomm.ZeroOneAdam` for p ranks in one process:
the oracle of its tests, written as `lbcomm.testing.optim` (with the helpers of
`lbcomm.testing.compressors`) with the same elementary operations as the optimizer, so that
the two agree to the last bit."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from .compressors import _bounds, _cat, _Compressor, _denom, _exact_mask, _f32, _keep, _mean, _split, decode_caps

__all__ = ["simulate_zero_one_adam"]


def simulate_zero_one_adam(params0: Sequence[Tensor], grads: Sequence[Sequence[Sequence[Tensor]]], *, lr,
                           betas=(0.9, 0.999), eps: float = 1e-8, weight_decay=0.0, var_freeze_step: int,
                           var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                           block_size: Optional[int], bias_correction: bool = True, mask_threshold: float = 1e-10,
                           max_update=1.0, var_decay: str = "time",
                           exact_numel: int = 4096, rescale_variance: bool = True,
                           capped_decode: bool = True) -> List[List[List[Tensor]]]:
    """0/1 Adam (the equations of lbcomm.ZeroOneAdam's docstring). grads[t][r][i]: gradient
    of parameter i on rank r at step t + 1; lr: a float, or lr(step, i) for a schedule or
    param groups; weight_decay: a float or one per parameter. Returns, after every step,
    every rank's parameters ([t][r][i]): identical on all ranks except between
    synchronizations of the local-step stage. exact_numel: the parameters of at most that
    many elements take the exact mean of the compressed call's inputs (a 1-bit step: the
    new momentum from the mean gradient; a sync: the mean of the ranks' inputs), their
    compression errors held at zero. rescale_variance: q, the EMA (beta2, every step from
    step 1, float64 arithmetic kept in fp32) of the ranks' mean squared local gradient norm
    of each parameter, bias-corrected, is recorded after every variance step (q_ref); every
    other step (1-bit, local, sync) divides v's bias correction by min(q_t / q_ref, 1).
    capped_decode: every compressed call (1-bit step, sync) decodes each coordinate to at
    most the momentum whose step is the bound (`lbcomm.testing.compressors.decode_caps`)."""
    b1, b2 = betas
    p, n_params = len(grads[0]), len(params0)
    lr_of = lr if callable(lr) else (lambda step, i: lr)
    wds = list(weight_decay) if isinstance(weight_decay, (list, tuple)) else [weight_decay] * n_params
    theta = [[t.detach().float().clone() for t in params0] for _ in range(p)]  # per rank
    m = [[torch.zeros_like(t) for t in theta[0]] for _ in range(p)]  # per rank (equal until local steps)
    v = [torch.zeros_like(t) for t in theta[0]]
    comp = _Compressor(sum(t.numel() for t in theta[0]), p, block_size, _exact_mask(theta[0], exact_numel))
    if max_update == "warmup":
        raise ValueError("simulate_zero_one_adam: max_update='warmup' is not part of 0/1 Adam")
    bounds = _bounds(max_update, betas, [None] * n_params, None, 1.0, 1.0, eps)  # a number, "auto" or None
    keep = None
    n_v, var_updates, next_var, local, syncs, next_sync, last_var = 0, 0, 1, False, 0, 0, 0
    compressed = False  # a 1-bit step has been taken: later variance steps are bounded too
    anchor = acc = lr_sum = decay_keep = None
    q = [0.0] * n_params  # rescale_variance's EMA, and its bias-corrected value at the last variance step
    q_ref: List[float] = []
    history = []

    def adam_step(w, m_i, v_i, bc2, decay, step_size, bound, frozen=True):  # frozen_adamw_'s operations
        if decay != 0:
            w.mul_(1 - decay)
        d = _denom(v_i, bc2, eps, frozen)  # variance steps: AdamW's root
        if bound is None:
            w.addcdiv_(m_i, d, value=-step_size)
        else:
            w.add_(torch.mul(m_i, -step_size).div_(d).clamp_(-bound, bound))

    for step, g_step in enumerate(grads, start=1):
        lrs = [lr_of(step, i) for i in range(n_params)]
        bc1 = 1 - b1 ** step if bias_correction else 1.0
        bcq = 1 - b2 ** step if bias_correction else 1.0
        if rescale_variance:
            sq = _mean([torch.stack([torch.linalg.vector_norm(g_step[r][i].float().reshape(-1)).square()
                                     for i in range(n_params)]) for r in range(p)]).tolist()
            q = _f32([qi * b2 + (1 - b2) * x for qi, x in zip(q, sq)])
        f = [None] * n_params  # v^'s factor at this step (None at variance steps)
        if rescale_variance and step != next_var:
            f = [qi / bcq / qr if qr > 0 else None for qi, qr in zip(q, q_ref)]
            f = [min(x, 1.0) if x is not None and 0 < x < math.inf else None for x in f]

        def vbc(bc2, i):  # v's bias correction, the factor folded in
            return bc2 if f[i] is None else bc2 / f[i]

        def caps(bc2):
            if not capped_decode or block_size is None:
                return None
            return decode_caps(v, bounds, bc1, [vbc(bc2, i) for i in range(n_params)], eps)
        if step == next_var:  # AdamW on the averaged gradients, the variance updated
            k = step - last_var if var_decay == "time" else 1  # the steps since the last update
            last_var = step
            n_v += k
            bc2 = 1 - b2 ** n_v if bias_correction else 1.0
            for i in range(n_params):
                g = _mean([g_step[r][i].float() for r in range(p)])
                m[0][i].lerp_(g, 1 - b1)
                v[i].mul_(b2 ** k).addcmul_(g, g, value=1 - b2 ** k)
                b = None if not compressed or bounds[i] is None else lrs[i] * bounds[i]
                adam_step(theta[0][i], m[0][i], v[i], bc2, lrs[i] * wds[i], lrs[i] / bc1, b, frozen=False)
            m = [[t.clone() for t in m[0]] for _ in range(p)]
            theta = [[t.clone() for t in theta[0]] for _ in range(p)]
            var_updates += 1
            nxt = step + 2 ** (var_updates // var_update_scaler)
            next_var = nxt if nxt <= var_freeze_step else 0
            keep = _keep(v, mask_threshold)
            if rescale_variance:
                q_ref = _f32([qi / bcq for qi in q])
        elif not local:  # OneBitAdam's compression step
            compressed = True
            bc2 = 1 - b2 ** n_v if bias_correction else 1.0
            local_m = [_cat([torch.lerp(m[0][i], g_step[r][i].float(), 1 - b1) for i in range(n_params)])
                       for r in range(p)]
            exact = _cat([torch.lerp(m[0][i], _mean([g_step[r][i].float() for r in range(p)]), 1 - b1)
                          for i in range(n_params)]) if exact_numel else None
            new = [torch.where(k, mi, 0.0) for mi, k in zip(_split(comp(local_m, exact, caps(bc2)), theta[0]), keep)]
            for i in range(n_params):
                b = None if bounds[i] is None else lrs[i] * bounds[i]
                adam_step(theta[0][i], new[i], v[i], vbc(bc2, i), lrs[i] * wds[i], lrs[i] / bc1, b)
            m = [[t.clone() for t in new] for _ in range(p)]
            theta = [[t.clone() for t in theta[0]] for _ in range(p)]
        else:
            bc2 = 1 - b2 ** n_v if bias_correction else 1.0
            new_sum = [lr_sum[i] + lrs[i] for i in range(n_params)]
            new_keep = [decay_keep[i] * (1 - lrs[i] * wds[i]) for i in range(n_params)]
            if step != next_sync:  # a local step on every rank
                for r in range(p):
                    for i in range(n_params):
                        m[r][i] = torch.where(keep[i], torch.lerp(m[r][i], g_step[r][i].float(), 1 - b1), 0.0)
                        b = None if bounds[i] is None else lrs[i] * bounds[i]
                        adam_step(theta[r][i], m[r][i], v[i], vbc(bc2, i), lrs[i] * wds[i], lrs[i] / bc1, b)
                        acc[r][i].add_(m[r][i], alpha=lrs[i] / bc1)
            else:  # the synchronization
                inputs = []
                for r in range(p):
                    parts = []
                    for i in range(n_params):
                        x = torch.lerp(m[r][i], g_step[r][i].float(), 1 - b1)
                        x = torch.add(acc[r][i], x, alpha=lrs[i] / bc1)
                        parts.append(x.mul_(bc1 / float(new_sum[i])))
                    inputs.append(_cat(parts))
                exact = _mean(inputs) if exact_numel else None
                new = [torch.where(k, mi, 0.0) for mi, k in zip(_split(comp(inputs, exact, caps(bc2)), theta[0]),
                                                                keep)]
                for i in range(n_params):
                    total = float(new_sum[i])
                    b = None if bounds[i] is None else total * bounds[i]
                    w = anchor[i].clone()
                    adam_step(w, new[i], v[i], vbc(bc2, i), 1 - float(new_keep[i]), total / bc1, b)
                    anchor[i] = w
                theta = [[t.clone() for t in anchor] for _ in range(p)]
                m = [[t.clone() for t in new] for _ in range(p)]
                acc = [[torch.zeros_like(t) for t in anchor] for _ in range(p)]
                new_sum = [torch.zeros(()) for _ in range(n_params)]
                new_keep = [torch.ones(()) for _ in range(n_params)]
                syncs += 1
                next_sync = step + min(2 ** (syncs // local_step_scaler), local_step_clipper)
            lr_sum, decay_keep = new_sum, new_keep
        if not local and step >= var_freeze_step:  # the local-step stage begins
            local, syncs, next_sync, next_var = True, 0, step + 1, 0
            anchor = [t.clone() for t in theta[0]]
            acc = [[torch.zeros_like(t) for t in anchor] for _ in range(p)]
            lr_sum = [torch.zeros(()) for _ in range(n_params)]
            decay_keep = [torch.ones(()) for _ in range(n_params)]
        history.append([[t.clone() for t in theta[r]] for r in range(p)])
    return history
