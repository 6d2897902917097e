"""Plain-torch, step-by-step simulation of the lbcomm optimizers for p ranks in one process.

The oracle the optimizer tests compare against: per-parameter tensors, explicit loops
over ranks, no flat buffers, no buckets, no state dicts, and the whole compressed
allreduce from `lbcomm.testing.kernels` (all ranks at once). Each formula is written with the
same elementary torch operations as `lbcomm.optim.functional`, in their natural order
(e.g. the Adam denominator is sqrt(v) / sqrt(1 - b2^t) + eps, as in torch.optim.AdamW),
so the real optimizers and this simulation can be compared to the last bit.

Inputs are the parameters at step 0 and, for every step, every rank's local gradients;
the warmup gradient is their mean (sum over ranks, then divided by p). ZeroOneAdam's
simulation is `lbcomm.testing.zeroone`, OneBitLocalUpdates' is `lbcomm.testing.local`; the
shared compressors and formulas are in `lbcomm.testing.compressors`.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .compressors import _bounds, _cat, _compressor, _denom, _f32, _keep, _mean, _split, decode_caps

__all__ = ["simulate_onebit_adam", "simulate_onebit_lamb", "simulate_lamb", "simulate_lars", "decode_caps"]


def simulate_onebit_adam(params0: Sequence[Tensor], grads: Sequence[Sequence[Sequence[Tensor]]], *, lr: float,
                         betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int,
                         block_size: Optional[int], bias_correction: bool = True,
                         mask_threshold: float = 1e-10, max_update=1.0, nodes: Optional[int] = None,
                         shards: Optional[int] = None, exact_numel: int = 4096,
                         rescale_variance: bool = True, capped_decode: bool = True) -> List[List[Tensor]]:
    """1-bit Adam. grads[t][r][i]: gradient of parameter i on rank r at step t + 1.
    Returns the parameters after every step. nodes: the compression stage's reduction is
    the hierarchical one on that many nodes (ranks node by node; None: flat). shards: the
    parameters are FSDP2-sharded in that many pieces along dim 0 and each shard's momentum
    is compressed on its own across the p ranks (the nodes; grads[t][r] is node r's mean
    gradient). In the compression stage each coordinate's
    step lr m^ / (sqrt(v^) + eps) is clamped to lr U (max_update; None: unbounded).
    exact_numel: the momentum of parameters of at most that many elements is averaged
    exactly instead of compressed, its compression errors held at zero. rescale_variance:
    in the compression stage parameter i's frozen v^ is multiplied by min(q_t / q_freeze, 1), q the
    bias-corrected EMA (beta2, from step 1) of the ranks' mean squared local gradient norm
    of parameter i (float64 arithmetic, kept in fp32). capped_decode: the compressed call
    decodes each coordinate to at most the momentum whose step is the bound (`decode_caps`;
    with blocks and a bound only)."""
    b1, b2 = betas
    p = len(grads[0])
    theta = [t.detach().float().clone() for t in params0]
    m = [torch.zeros_like(t) for t in theta]
    v = [torch.zeros_like(t) for t in theta]
    comp = _compressor(theta, p, nodes, block_size, shards, exact_numel)
    keep = bounds = None
    q = [0.0] * len(theta)  # rescale_variance's EMA, and its bias-corrected value at the freeze
    q_frozen: List[float] = []
    factors: List[Optional[float]] = [None] * len(theta)
    history = []
    for step, g_step in enumerate(grads, start=1):
        if rescale_variance:
            sq = _mean([torch.stack([torch.linalg.vector_norm(g_step[r][i].float().reshape(-1)).square()
                                     for i in range(len(theta))]) for r in range(p)]).tolist()
            q = _f32([qi * b2 + (1 - b2) * x for qi, x in zip(q, sq)])
        if step <= freeze_step:
            for i in range(len(theta)):
                g = _mean([g_step[r][i].float() for r in range(p)])
                m[i].lerp_(g, 1 - b1)
                v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
            vstep = step
        else:
            if keep is None:  # the zero-variance mask and the bounds, taken at the freeze
                keep = _keep(v, mask_threshold)
                bc = (1 - b1 ** freeze_step, 1 - b2 ** freeze_step) if bias_correction else (1.0, 1.0)
                bounds = _bounds(max_update, betas, m, v, *bc, eps)
            local = [_cat([torch.lerp(m[i], g_step[r][i].float(), 1 - b1) for i in range(len(theta))])
                     for r in range(p)]
            exact = _cat([torch.lerp(m[i], _mean([g_step[r][i].float() for r in range(p)]), 1 - b1)
                          for i in range(len(theta))]) if exact_numel else None
            vstep = freeze_step
            if rescale_variance:
                bct = 1 - b2 ** step if bias_correction else 1.0
                factors = [qi / bct / qf if qf > 0 else None for qi, qf in zip(q, q_frozen)]
                factors = [min(f, 1.0) if f is not None and 0 < f < math.inf else None for f in factors]
            cap = None
            if capped_decode and block_size is not None:
                bc1, bc2 = (1 - b1 ** step, 1 - b2 ** vstep) if bias_correction else (1.0, 1.0)
                cap = decode_caps(v, bounds, bc1, [bc2 if f is None else bc2 / f for f in factors], eps)
            m = [torch.where(k, mi, 0.0) for mi, k in zip(_split(comp(local, exact, cap), theta), keep)]
        if rescale_variance and step == freeze_step:
            bcf = 1 - b2 ** freeze_step if bias_correction else 1.0
            q_frozen = _f32([qi / bcf for qi in q])
        bc1 = 1 - b1 ** step if bias_correction else 1.0
        bc2 = 1 - b2 ** vstep if bias_correction else 1.0
        for i in range(len(theta)):
            if weight_decay != 0:
                theta[i].mul_(1 - lr * weight_decay)
            bc2_i = bc2 if factors[i] is None else bc2 / factors[i]
            if bounds is None or bounds[i] is None:
                theta[i].addcdiv_(m[i], _denom(v[i], bc2_i, eps, step > freeze_step), value=-lr / bc1)
            else:  # the clamped step (-lr/bc1) m / d, addcdiv's roundings
                step_i = torch.mul(m[i], -lr / bc1).div_(_denom(v[i], bc2_i, eps, step > freeze_step))
                theta[i].add_(step_i.clamp_(-lr * bounds[i], lr * bounds[i]))
        history.append([t.clone() for t in theta])
    return history


def _lamb_coeff(theta: Tensor, u: Tensor, lo: float, hi: float) -> Tensor:
    pn, un = torch.linalg.vector_norm(theta), torch.linalg.vector_norm(u)
    if pn > 0 and un > 0:
        return (pn / un).clamp(lo, hi)
    return torch.ones(())


def simulate_lamb(params0, grads, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                  max_coeff: float = 10.0, min_coeff: float = 0.01, bias_correction: bool = True):
    """LAMB on the averaged gradients. Returns the parameters after every step."""
    return _lamb(params0, grads, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                 min_coeff=min_coeff, bias_correction=bias_correction, freeze_step=None)


def simulate_onebit_lamb(params0, grads, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                         weight_decay: float = 0.0, freeze_step: int, block_size: Optional[int],
                         max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                         factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                         bias_correction: bool = True, mask_threshold: float = 1e-10, max_update=1.0,
                         nodes: Optional[int] = None, shards: Optional[int] = None, exact_numel: int = 4096,
                         trust_ratio: str = "aligned", capped_decode: bool = True, norm_samples: int = 256,
                         norm_step_bound: Optional[float] = 0.1, pass_budget: Optional[int] = None):
    """1-bit LAMB. Returns the parameters after every step (nodes, shards, exact_numel: as
    simulate_onebit_adam; LAMB's norms are those of whole parameters). In the compression stage each
    coordinate of u0 = m^ / (sqrt(v^) + eps) is clamped to [-U, U] (max_update; None: unbounded);
    trust_ratio "live": the step is lr clamp(||theta|| / ||u||) u, LAMB's rule on this step's u
    ("aligned": ||u|| replaced by the estimate of u's length along the clean direction);
    "frozen": lr c_frz f u (the warmup's average coefficient and the variance factor); "max":
    the larger of the two coefficients. capped_decode (OneBitLamb's default: on): as
    simulate_onebit_adam, each cap times the parameter's momentum scale k (the reduced
    momentum is m k). norm_samples > 0 (with more than one rank): the live coefficient
    divides by an estimate of the norm of the direction an uncompressed allreduce would
    give, from every rank's own momentum (`_clean_sq`), bounded by norm_step_bound (the lr
    is constant here, so it is also the peak lr); parameters averaged exactly keep the
    decoded norm. A parameter of more than pass_budget elements (default: OneBitLamb's,
    lbcomm.optim.lamb_norm.PASS_BUDGET), unsharded, is estimated from its runs of 512
    elements 0, k, 2k, ... alone, k the least that keeps them within the budget, the sums
    scaled by its size / theirs."""
    if pass_budget is None:
        from ..optim.lamb_norm import PASS_BUDGET as pass_budget
    return _lamb(params0, grads, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                 min_coeff=min_coeff, bias_correction=bias_correction, freeze_step=freeze_step,
                 block_size=block_size, coeff_beta=coeff_beta, factor_max=factor_max, factor_min=factor_min,
                 factor_threshold=factor_threshold, mask_threshold=mask_threshold, max_update=max_update,
                 nodes=nodes, shards=shards, exact_numel=exact_numel, trust_ratio=trust_ratio,
                 capped_decode=capped_decode, norm_samples=norm_samples, norm_step_bound=norm_step_bound,
                 pass_budget=pass_budget)


def _covered(n: int, budget: int, shards: Optional[int]) -> Tensor:
    """Which of n coordinates the estimate looks at: all, or (n > budget, unsharded) those
    of the 512-element runs 0, k, 2k, ... with the least k that keeps them within budget."""
    runs = -(-n // 512)
    k = 1
    if not shards:
        while -(-runs // k) * 512 > budget:
            k += 1
    return (torch.arange(n) // 512) % k == 0


def _clean_sq(m: Tensor, locals_: List[Tensor], v: Tensor, bc1: float, bc2: float, eps: float,
              bound: Optional[float], theta: Tensor, keep: Tensor, weight_decay: float, k: int, seed: int,
              covered: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Estimated ||clamp(mean_r local_r / (d bc1)) + wd theta||^2 of one (piece of a)
    parameter, fp64, with d = sqrt(v) / sqrt(bc2) + eps and the correctly rounded fp32 sqrt
    (the fp64 root rounded: exact), so u0 = m / (d bc1) may differ from the direction's by
    an ulp: the ranks' mean of clamp(y_r) projected on the decoded direction u0
    where u0 is neither clamped nor masked (not `keep`), plus k of the other coordinates
    (drawn with `seed`; all of them when there are at most k) averaged exactly, clamped,
    and their squares scaled to all of them; plus the weight decay's terms with the
    decoded u0. What the ranks exchange is fp32: each rank's projection (its fp64 sum
    rounded) and its y at the drawn coordinates, averaged in fp32 (summed here in rank
    order: the real allreduce sums in its own order, which can round differently). With
    `covered` (a mask of the coordinates), both sums are over those alone, scaled by n /
    their number; the weight decay's terms are not. Returns (the weight decay's terms,
    [that estimate without them, the same with u0 z in place of z^2 on the edge, the
    projection alone, sum z^2 and sum u0 z over k coordinates drawn uniformly (seed +
    2^32) from the covered ones]): "aligned" reads all five (`_aligned_sq`), "live" the
    first."""
    m, v, theta, keep = m.reshape(-1), v.reshape(-1), theta.reshape(-1), keep.reshape(-1)
    wd_terms = torch.zeros((), dtype=torch.float64)
    if weight_decay != 0:
        th = theta.double()
        u_all = (m / ((torch.sqrt(v.double()).float() / bc2 ** 0.5 + eps) * bc1))
        u_all = u_all.clamp(-bound, bound) if bound is not None else u_all
        wd_terms = 2 * weight_decay * torch.dot(u_all.double(), th) + weight_decay * weight_decay * torch.dot(th, th)
    scale = 1.0
    if covered is not None and not bool(covered.all()):
        scale = m.numel() / int(covered.sum())
        m, v, keep = m[covered], v[covered], keep[covered]
        locals_ = [l.reshape(-1)[covered] for l in locals_]
    p = len(locals_)
    q = (torch.sqrt(v.double()).float() / bc2 ** 0.5 + eps) * bc1
    u0 = m / q
    ys = [l.reshape(-1) / q for l in locals_]
    edge = ~keep
    if bound is not None:
        u0 = u0.clamp(-bound, bound)
        edge = edge | (u0.abs() >= bound * (1 - 1e-5))  # at the bound up to the decode's roundings
    where = edge.nonzero().view(-1)
    u64 = u0.double()
    projs = [((y.clamp(-bound, bound) if bound is not None else y).double() * u64)[~edge].sum().float() for y in ys]
    proj = (torch.stack(projs).sum() / p).double()
    if where.numel() > k:
        where = where[torch.randint(where.numel(), (k,), generator=torch.Generator().manual_seed(seed))]
    z = torch.stack([y[where] for y in ys]).sum(0) / p
    if bound is not None:
        z = z.clamp(-bound, bound)
    sampled = z.double().square().sum() * (int(edge.sum()) / where.numel()) if where.numel() else 0.0
    along = (u64[where] * z.double()).sum() * (int(edge.sum()) / where.numel()) if where.numel() else 0.0
    n = m.numel()
    j = (torch.randint(n, (k,), generator=torch.Generator().manual_seed(seed + (1 << 32))) if n > k
         else torch.arange(n))
    y = torch.stack([y[j] for y in ys]).sum(0) / p
    y = (y.clamp(-bound, bound) if bound is not None else y).double()
    parts = [(proj + sampled) * scale, (proj + along) * scale, proj * scale, y.square().sum(), (u64[j] * y).sum()]
    return wd_terms, torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in parts])


def _aligned_sq(wd_terms: Tensor, parts: Tensor) -> Tensor:
    """'aligned''s squared norm from `_clean_sq`'s parts summed over the pieces: <u, u*>^2 /
    ||u*||^2, with ||u0*||^2 off the edge = (sum z^2 / sum u0 z) times the projection."""
    rho = parts[3] / parts[4] if parts[4] > 0 else 1.0
    sq, dot = parts[0] + (rho - 1) * parts[2] + wd_terms, parts[1] + wd_terms
    return dot * dot / sq if dot > 0 and sq > 0 else parts[0] + wd_terms


def _pieces(t: Tensor, shards: Optional[int]) -> List[Tensor]:
    """FSDP2's dim-0 shards of t (t itself unsharded)."""
    return [t] if not shards or t.dim() == 0 else list(t.chunk(shards))


def _lamb(params0, grads, *, lr, betas, eps, weight_decay, max_coeff, min_coeff, bias_correction, freeze_step,
          block_size=None, coeff_beta=0.9, factor_max=4.0, factor_min=0.5, factor_threshold=0.1, mask_threshold=0.0,
          max_update=None, nodes=None, shards=None, exact_numel=0, trust_ratio="frozen", capped_decode=True,
          norm_samples=0, norm_step_bound=None, pass_budget=1 << 17):
    b1, b2 = betas
    p = len(grads[0])
    n_params = len(params0)
    theta = [t.detach().float().clone() for t in params0]
    m = [torch.zeros_like(t) for t in theta]
    v = [torch.zeros_like(t) for t in theta]
    c_frz = [torch.zeros(()) for _ in theta]
    comp = _compressor(theta, p, nodes, block_size, shards, exact_numel)
    frozen: Dict[str, list] = {}
    history = []
    for step, g_step in enumerate(grads, start=1):
        bc1 = 1 - b1 ** step if bias_correction else 1.0
        if freeze_step is None or step <= freeze_step:
            bc2 = 1 - b2 ** step if bias_correction else 1.0
            for i in range(n_params):
                g = _mean([g_step[r][i].float() for r in range(p)])
                m[i].lerp_(g, 1 - b1)
                v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
                u = (m[i] / bc1) / _denom(v[i], bc2, eps)
                if weight_decay != 0:
                    u.add_(theta[i], alpha=weight_decay)
                c = _lamb_coeff(theta[i], u, min_coeff, max_coeff)
                if c != 1:
                    c_frz[i] = coeff_beta * c_frz[i] + (1 - coeff_beta) * c
                theta[i].add_(u * c, alpha=-lr)
            history.append([t.clone() for t in theta])
            continue
        if not frozen:  # the freeze: everything below is taken from the state after step freeze_step
            rms = [torch.linalg.vector_norm(mi) / math.sqrt(mi.numel()) for mi in m]
            mean_rms = torch.stack(rms).mean()
            bc = (1 - b1 ** freeze_step, 1 - b2 ** freeze_step) if bias_correction else (1.0, 1.0)
            frozen = {
                "bounds": _bounds(max_update, betas, m, v, *bc, eps),
                "keep": _keep(v, mask_threshold),
                "v_fresh": [vi.clone() for vi in v],
                "k": [mean_rms / r if r > 0 else torch.ones(()) for r in rms],
                "f_last": [torch.ones(()) for _ in theta],
                "c": [c if c != 0 else torch.ones(()) for c in c_frz],
                # each rank's own momentum, kept in bf16 (updated in fp32, rounded once)
                "local": [[mi.to(torch.bfloat16) for mi in m] for _ in range(p)],
            }
        k, keep, v_fresh = frozen["k"], frozen["keep"], frozen["v_fresh"]
        bc2 = 1 - b2 ** freeze_step if bias_correction else 1.0
        local = [_cat([torch.lerp(m[i], g_step[r][i].float(), 1 - b1) * k[i] for i in range(n_params)])
                 for r in range(p)]
        exact = _cat([torch.lerp(m[i], _mean([g_step[r][i].float() for r in range(p)]), 1 - b1) * k[i]
                      for i in range(n_params)]) if exact_numel else None
        cap = None
        if capped_decode and block_size is not None:
            cap = decode_caps(v, frozen["bounds"], bc1, [bc2] * n_params, eps)
            if cap is not None:
                cap = _cat([ci * k[i] for i, ci in enumerate(_split(cap, theta))])
        new_m = [torch.where(keep[i], mi / k[i], 0.0) for i, mi in enumerate(_split(comp(local, exact, cap), theta))]
        own = frozen["local"]
        for r in range(p):
            for i in range(n_params):
                a = own[r][i].float()  # a + w (g - a), rounded per op (no FMA), then to bf16
                own[r][i] = ((g_step[r][i].float() - a) * (1 - b1) + a).to(torch.bfloat16)
        estimate = trust_ratio != "frozen" and norm_samples > 0 and p > 1
        for i in range(n_params):
            g_tilde = (new_m[i] - b1 * m[i]) / (1 - b1)
            m[i] = new_m[i]
            v_fresh[i].mul_(b2).addcmul_(g_tilde, g_tilde, value=1 - b2)
            d = _denom(v[i], bc2, eps, True)  # the compression stage's root: IEEE's
            d_fresh = _denom(v_fresh[i], bc2, eps, True)
            f = torch.amax(d / d_fresh)
            u0 = (m[i] / bc1) / d
            if frozen["bounds"][i] is not None:
                u0.clamp_(-frozen["bounds"][i], frozen["bounds"][i])
            u = u0.clone()
            if weight_decay != 0:
                u.add_(theta[i], alpha=weight_decay)
            c_live = _lamb_coeff(theta[i], u, min_coeff, max_coeff)
            if estimate and theta[i].numel() > exact_numel:  # exactly averaged: the decoded norm is clean
                wd, parts = 0.0, 0.0
                mine = [m[i], v[i], theta[i], keep[i]] + [own[r][i] for r in range(p)]
                for piece in zip(*[_pieces(t, shards) for t in mine]):
                    w, q = _clean_sq(piece[0], list(piece[4:]), piece[1], bc1, bc2, eps, frozen["bounds"][i],
                                     piece[2], piece[3], weight_decay, norm_samples, 1009 * step + i,
                                     _covered(piece[0].numel(), pass_budget, shards))
                    wd, parts = wd + w, parts + q
                sq = _aligned_sq(wd, parts) if trust_ratio == "aligned" else wd + parts[0]
                un = torch.linalg.vector_norm(u).double()
                est = torch.sqrt(torch.maximum(sq, 0.01 * un.square()))
                if norm_step_bound is not None:
                    est = torch.maximum(est, un / max(1.0, norm_step_bound / lr))
                pn, est = torch.linalg.vector_norm(theta[i]), est.float()
                c_live = (pn / est).clamp(min_coeff, max_coeff) if pn > 0 and est > 0 else torch.ones(())
            if trust_ratio in ("live", "aligned"):
                theta[i].add_(u * c_live, alpha=-lr)
                continue
            if weight_decay != 0:
                u0n, un = torch.linalg.vector_norm(u0), torch.linalg.vector_norm(u)
                r = (u0n / un).clamp(max=1.0) if un > 0 else torch.ones(())
                f = f * r + (1 - r)
            f = f.clamp(factor_min, factor_max)
            last = frozen["f_last"][i]
            f = torch.clamp(f, min=last * (1 - factor_threshold), max=last * (1 + factor_threshold))
            frozen["f_last"][i] = f
            c = frozen["c"][i] * f
            if trust_ratio == "max":
                c = torch.maximum(c, c_live)
            theta[i].add_(u * c, alpha=-lr)
        history.append([t.clone() for t in theta])
    return history


def _lars_adapts(t: Tensor, exclude) -> bool:
    if exclude is None:
        return t.dim() > 1
    if isinstance(exclude, bool):
        return not exclude
    return not exclude(t)


def simulate_lars(params0, grads, *, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                  trust_coefficient: float = 0.001, eps: float = 1e-8, exclude_from_adaptation=None):
    """LARS (`lbcomm.Lars`) on the averaged gradients. Returns the parameters after every step."""
    return _lars(params0, grads, lr=lr, momentum=momentum, weight_decay=weight_decay,
                 trust_coefficient=trust_coefficient, eps=eps, exclude=exclude_from_adaptation)


def _lars(params0, grads, *, lr, momentum, weight_decay, trust_coefficient, eps, exclude):
    p = len(grads[0])
    theta = [t.detach().float().clone() for t in params0]
    m = [torch.zeros_like(t) for t in theta]
    history = []
    for g_step in grads:
        for i in range(len(theta)):
            m[i].lerp_(_mean([g_step[r][i].float() for r in range(p)]), 1 - momentum)
        for i in range(len(theta)):
            if not _lars_adapts(params0[i], exclude):
                theta[i].add_(m[i], alpha=-lr)
                continue
            u = m[i].add(theta[i], alpha=weight_decay) if weight_decay != 0 else m[i].clone()
            pn, un = torch.linalg.vector_norm(theta[i]), torch.linalg.vector_norm(u)
            c = trust_coefficient * pn / (un + eps) if pn > 0 and un > 0 else torch.ones(())
            theta[i].add_(u * c, alpha=-lr)
        history.append([t.clone() for t in theta])
    return history
