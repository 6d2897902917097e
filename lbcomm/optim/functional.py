"""The update math of the lbcomm optimizers as functions over tensors: flat
fp32 slices of the state and the parameters they belong to. No communication, no state
bookkeeping (that is `base` and `onebit`); the order of operations is part of the
contract (the warmup is bitwise torch.optim.AdamW, the tests compare bitwise against
`lbcomm.testing.optim`).
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["norms", "moments_", "denominator", "ieee_sqrt", "frozen_denominator", "scaled_root", "rescaled_bc2",
           "adamw_", "frozen_adamw_", "lamb_direction", "trust_ratio", "track_coeff", "onebit_lamb_factor",
           "implied_grad_variance_", "apply_fp32", "adam_update_bound", "resolve_max_update", "max_abs_update",
           "cap_coefficients", "STAGE"]

# Elements per pass of the staged computations (4 MB of fp32: the pieces stay in cache).
STAGE = 1 << 20


def norms(tensors: List[Tensor]) -> Tensor:
    """fp32 L2 norm of each tensor, stacked (no host synchronization)."""
    return torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])


def apply_fp32(p: Tensor, fn: Callable[[Tensor], None]) -> None:
    """Run fn on p in fp32: in place for fp32 params, through an fp32 copy otherwise."""
    if p.dtype == torch.float32:
        fn(p)
    else:
        w = p.float()
        fn(w)
        p.copy_(w)


def moments_(m: Tensor, v: Tensor, g: Tensor, b1: float, b2: float) -> None:
    """m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2 (torch.optim.AdamW's operations)."""
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)


def denominator(v: Tensor, bc2: float, eps: float, out: Tensor) -> Tensor:
    """out = sqrt(v) / sqrt(bc2) + eps, i.e. sqrt(v^) + eps, with torch's sqrt: AdamW's
    denominator bit for bit (the warmup's steps)."""
    torch.sqrt(v, out=out)
    return out.div_(bc2 ** 0.5).add_(eps)


def ieee_sqrt(v: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """The correctly rounded square root of fp32 `v` (the fp64 root, rounded once; fp64 `v`:
    its own root), into `out` if given. The fused ops take IEEE's root, which this equals on
    every ISA; torch's fp32 CPU sqrt is not correctly rounded on every host."""
    r = torch.sqrt(v.double())
    return r.to(v.dtype) if out is None else out.copy_(r)


def frozen_denominator(v: Tensor, bc2: float, eps: float, out: Optional[Tensor] = None) -> Tensor:
    """`denominator` with the correctly rounded root (`ieee_sqrt`): the compression stage's,
    as the fused `kernels.frozen_adamw_` computes it."""
    return scaled_root(v, bc2 ** 0.5, eps, out)


def scaled_root(v: Tensor, denom_scale: float, eps: float, out: Optional[Tensor] = None) -> Tensor:
    """d = sqrt(v) / denom_scale + eps, the root correctly rounded (`ieee_sqrt`): the value
    every fused op computes for it, whatever the vector instructions of either side."""
    return ieee_sqrt(v, out).div_(denom_scale).add_(eps)


def cap_coefficients(bound: float, bc1: float, bc2: float, eps: float) -> Tuple[float, float]:
    """(a, b) with a sqrt(v) + b = U bc1 (sqrt(v / bc2) + eps): the capped decode's bound
    on the momentum, as a multiply and an add per coordinate."""
    return bound * bc1 / bc2 ** 0.5, bound * bc1 * eps


def rescaled_bc2(bc2: float, factors: Optional[Sequence[Optional[float]]], i: int) -> float:
    """v^'s bias correction for parameter i with rescale_variance's factor f folded in
    (v^ f = v / (bc2 / f)); factors None, or None at i: no rescale."""
    return bc2 if factors is None or factors[i] is None else bc2 / factors[i]


def adamw_(w: Tensor, m: Tensor, denom: Tensor, decay: float, step_size: float,
           bound: Optional[float] = None) -> None:
    """w <- w (1 - decay) - step_size m / denom, in torch.optim.AdamW's order of operations.

    With `bound`, each coordinate's step q = (-step_size m) / denom is clamped to
    [-bound, bound] before it is added (max_update): the same roundings as addcdiv's
    (value * m) / denom and its add, so an unclamped coordinate gets bitwise AdamW's update."""
    if decay != 0:
        w.mul_(1 - decay)
    if bound is None:
        w.addcdiv_(m, denom, value=-step_size)
    else:
        w.add_(torch.mul(m, -step_size).div_(denom).clamp_(-bound, bound))


def frozen_adamw_(w: Tensor, m: Tensor, v: Tensor, bc2: float, eps: float, decay: float, step_size: float,
                  scratch: Tensor, bound: Optional[float] = None, cap: Optional[Tuple[float, float]] = None) -> None:
    """`adamw_` with denom = `frozen_denominator`(v), computed STAGE elements at a time into
    `scratch` (at least min(STAGE, numel) fp32 elements): every element goes through the
    same operations as with a model-sized denominator, but the denominator never leaves the
    cache and needs no memory of its own. w, m, v: contiguous, of equal numel. `cap` (a, b):
    m is first capped in place (`cap_momentum_`)."""
    w, m, v = w.view(-1), m.view(-1), v.view(-1)
    n = w.numel()
    for lo in range(0, n, STAGE):
        hi = min(n, lo + STAGE)
        if cap is not None:
            cap_momentum_(m[lo:hi], v[lo:hi], cap[0], cap[1], scratch[:hi - lo])
        d = frozen_denominator(v[lo:hi], bc2, eps, out=scratch[:hi - lo])
        adamw_(w[lo:hi], m[lo:hi], d, decay, step_size, bound)


def cap_momentum_(m: Tensor, v: Tensor, a: float, b: float, scratch: Tensor) -> None:
    """m <- sign(m) min(|m|, c), c = sqrt(v) a + b (the capped decode's caps, `cap_coefficients`,
    with the caps' roundings: the correctly rounded root, then the multiply and the add, in
    `scratch`), in place where c < |m|. On a momentum decoded without caps (every value
    +-scale) this gives bitwise what the capped decode gives, min(c, scale) with the value's
    sign; a NaN cap leaves m."""
    c = ieee_sqrt(v, scratch).mul_(a).add_(b)
    torch.where(c < m.abs(), c.copysign(m), m, out=m)


def adam_update_bound(betas: Tuple[float, float]) -> float:
    """The largest |m^ / sqrt(v^)| Adam can produce for any gradient sequence (bias-corrected,
    eps = 0): (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)); 7.27 at betas (0.9, 0.999). Finite
    only when b1^2 < b2 (Cauchy-Schwarz on the two exponential averages)."""
    b1, b2 = betas
    return (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))


def resolve_max_update(value, betas: Tuple[float, float]) -> Union[None, float, str]:
    """The bound U on |m^ / (sqrt(v^) + eps)| a max_update option means: None (no bound),
    a float, or "warmup" (per parameter, recorded at the freeze). Raises ValueError for an
    invalid option."""
    if value is None or value == "warmup":
        return value
    if value == "auto":
        b1, b2 = betas
        if not b1 * b1 < b2:
            raise ValueError(f"Invalid max_update: 'auto' needs beta1**2 < beta2 (got betas {tuple(betas)}): Adam's "
                             "update has no finite bound then; pass max_update as a number (e.g. 1.0) or 'warmup'")
        return adam_update_bound(betas)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < math.inf:
        raise ValueError(f"Invalid max_update: {value!r} (use a finite number > 0, 'warmup', 'auto', or None for "
                         "the published unbounded update)")
    return float(value)


def max_abs_update(m: Tensor, v: Tensor, bc1: float, bc2: float, eps: float, scratch: Tensor) -> Tensor:
    """max_i |(m_i / bc1) / (sqrt(v_i / bc2) + eps)| as a 1-element fp32 tensor (0 when
    empty), STAGE elements at a time through `scratch` (at least min(STAGE, numel))."""
    m, v = m.reshape(-1), v.reshape(-1)
    n = m.numel()
    out = torch.zeros(1, dtype=torch.float32, device=m.device)
    for lo in range(0, n, STAGE):
        hi = min(n, lo + STAGE)
        d = denominator(v[lo:hi], bc2, eps, out=scratch[:hi - lo])
        q = torch.div(m[lo:hi], bc1).div_(d)
        out = torch.maximum(out, q.abs_().amax().reshape(1))
    return out


def lamb_direction(m: Tensor, v: Tensor, bc1: float, bc2: float, eps: float, out: Tensor) -> Tensor:
    """out = m^ / (sqrt(v^) + eps) (the warmup's; see `max_abs_update` for the same quotient)."""
    u = denominator(v, bc2, eps, out=out)
    return torch.div(m / bc1, u, out=u)


def trust_ratio(pn: Tensor, un: Tensor, min_coeff: float, max_coeff: float) -> Tensor:
    """c = clamp(||p|| / ||u||, min_coeff, max_coeff) per parameter; 1 where a norm is 0."""
    c = (pn / un).clamp(min_coeff, max_coeff)
    return torch.where((pn > 0) & (un > 0), c, torch.ones_like(c))


def track_coeff(frozen_coeff: Tensor, c: Tensor, beta: float) -> Tensor:
    """1-bit LAMB's warmup average: c_frz <- beta c_frz + (1 - beta) c where c != 1."""
    return torch.where(c != 1, beta * frozen_coeff + (1 - beta) * c, frozen_coeff)


def implied_grad_variance_(v_fresh: Tensor, m_new: Tensor, m: Tensor, b1: float, b2: float) -> None:
    """1-bit LAMB: g~ = (m_new - b1 m) / (1 - b1), the gradient the reduced momentum
    implies, v_fresh <- b2 v_fresh + (1 - b2) g~^2, then m <- m_new. g~ is formed in m
    itself (the same roundings as with a temporary), so nothing is allocated. The torch
    sequence of `kernels.implied_variance_` (one pass of an op on the CPU)."""
    m.mul_(b1)
    gt = torch.sub(m_new, m, out=m).div_(1 - b1)
    v_fresh.mul_(b2).addcmul_(gt, gt, value=1 - b2)
    m.copy_(m_new)


def onebit_lamb_factor(ratio_max: Tensor, u0n: Optional[Tensor], un: Optional[Tensor], last: Tensor,
                       factor_min: float, factor_max: float, threshold: float) -> Tensor:
    """1-bit LAMB's variance factor per parameter: f = max_i(d / d~), pulled towards 1 by
    r = min(1, ||u0|| / ||u||) when weight decay is on (u0n/un given), clamped to
    [factor_min, factor_max] and to within threshold of the last factor."""
    f = ratio_max
    if u0n is not None:
        r = torch.where(un > 0, (u0n / un).clamp(max=1.0), torch.ones_like(un))
        f = f * r + (1 - r)
    f = f.clamp(factor_min, factor_max)
    return torch.clamp(f, min=last * (1 - threshold), max=last * (1 + threshold))
