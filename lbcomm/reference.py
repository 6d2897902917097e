"""Plain-torch implementation of every lbcomm kernel: the fallback that lbcomm.ops runs when
the C++ extension is not available (or has no kernel for a tensor's device).

Written from the algorithm (docs/concepts.md) for clarity, not speed; the fused kernels follow
the same recipe, so the tests compare them against these functions bit for bit. The
simulations of the whole algorithm for p ranks in one process (`compressed_allreduce`,
`hierarchical_allreduce`), the tests' oracle, are in `lbcomm.testing.kernels`. The
rounding steps are spelled out so that a fused kernel that follows the same recipe gives
the same bits:

* y = x + e and e' = y - copysign(scale, y) are single fp32 operations; with
  per-coordinate weights w the worker compresses y = x / w + e (the fp32 quotient rounded
  once, then the sum) and the decode writes value * w (one fp32 product);
* a block scale is sqrt(sum(y^2) / count) with the sum of squares in float64, rounded to
  fp32 once at the end;
* the server's average is acc = sum_j (+-a_j) in fp32 in rank order, then acc * (1/p) with
  1/p rounded to fp32, then + s, each a separate fp32 rounding (no fused multiply-add);
* the capped decode (per-coordinate caps c, the same on every rank) decodes a value as
  +-min(scale, c_i) (c_i < scale ? c_i : scale), takes each block's scale as the RMS over
  the coordinates with c_i >= the block's RMS (the block's RMS when there is none) and
  clamps each new error to [-3 c_i, 3 c_i] (CAP_ERROR_RATIO * c_i, one fp32 product).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .reduce.wire import ALIGN, chunk_size, num_blocks  # the layout math, re-exported for the tests and tools

CAP_ERROR_RATIO = 3.0  # capped decode: |error_i| <= CAP_ERROR_RATIO * cap_i (kCapErrorRatio in csrc/kernels.h)

__all__ = [
    "ALIGN",
    "CAP_ERROR_RATIO",
    "chunk_size",
    "num_blocks",
    "pack_signs",
    "unpack_signs",
    "worker_compress",
    "server_compress",
    "unpack",
]


def pack_signs(v: Tensor) -> Tensor:
    """Sign bits of a float tensor [..., m] (m % 8 == 0) to uint8 [..., m / 8], LSB first."""
    bits = torch.signbit(v).to(torch.uint8).reshape(*v.shape[:-1], -1, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=v.device)
    return (bits * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def unpack_signs(packed: Tensor) -> Tensor:
    """uint8 [..., k] to a bool tensor [..., 8 k]: True where the element is negative."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).bool().reshape(*packed.shape[:-1], -1)


def _block_rms(v: Tensor, real: Tensor, block_size: Optional[int]) -> Tensor:
    """RMS over real elements per block of each row of v [rows, m]; float64 sum, fp32 result.

    block_size None: one RMS over all real elements of v, repeated once per row.
    A group without real elements has scale 0.
    """
    rows, m = v.shape
    sq = torch.where(real, v.double() ** 2, torch.zeros((), dtype=torch.float64, device=v.device))
    cnt = real.to(torch.float64)
    if block_size is None:
        sums, counts = sq.sum().reshape(1, 1), cnt.sum().reshape(1, 1)
    else:
        nb = num_blocks(m, block_size)
        pad = nb * block_size - m
        sums = torch.nn.functional.pad(sq, (0, pad)).reshape(rows, nb, block_size).sum(-1)
        counts = torch.nn.functional.pad(cnt, (0, pad)).reshape(rows, nb, block_size).sum(-1)
    rms = torch.where(counts > 0, torch.sqrt(sums / counts.clamp(min=1)), torch.zeros_like(sums))
    rms = rms.to(torch.float32)
    return rms.expand(rows, 1).contiguous() if block_size is None else rms


def _expand(scales: Tensor, m: int, block_size: Optional[int]) -> Tensor:
    """Per-element scale [rows, m] from per-block scales [rows, nb]."""
    if block_size is None:
        return scales[:, :1].expand(-1, m)
    return scales.repeat_interleave(block_size, dim=1)[:, :m]


def _signed(neg: Tensor, scale: Tensor) -> Tensor:
    """Decoded value: the scale with its sign bit set where `neg`. Scales are >= +0, so
    this is +-scale; spelled this way a NaN scale decodes the same as in the kernels."""
    return torch.where(neg, -scale.abs(), scale)


def _capped(cap: Tensor, scale: Tensor) -> Tensor:
    """The capped decode's magnitude: cap where cap < scale, else the scale."""
    return torch.where(cap < scale, cap, scale)


def _padded_cap(cap: Tensor, rows: int, m: int) -> Tensor:
    """Caps of n0 real coordinates as [rows, m], +inf on the pads (never read: pads carry
    no error and no scale)."""
    flat = torch.full((rows * m,), float("inf"), dtype=torch.float32, device=cap.device)
    flat[:cap.numel()] = cap.reshape(-1).to(torch.float32)
    return flat.reshape(rows, m)


def _capped_scales(v: Tensor, real: Tensor, cap: Tensor, block_size: int) -> Tensor:
    """Per block of v [rows, m]: the RMS over the real coordinates with cap >= the block's
    RMS, or the block's RMS when there is none."""
    s1 = _block_rms(v, real, block_size)
    keep = real & (cap >= _expand(s1, v.shape[1], block_size))
    s2 = _block_rms(v, keep, block_size)
    counts = torch.nn.functional.pad(keep.to(torch.int64), (0, num_blocks(v.shape[1], block_size) * block_size
                                                            - v.shape[1]))
    any_kept = counts.reshape(v.shape[0], -1, block_size).sum(-1) > 0
    return torch.where(any_kept, s2, s1)


def _capped_sign_error(v: Tensor, scale: Tensor, real: Tensor, cap: Tensor) -> Tuple[Tensor, Tensor]:
    """_sign_error with the capped decode: the error v - copysign(min(scale, cap), v),
    clamped to [-3 cap, 3 cap]."""
    zero = torch.zeros((), dtype=torch.float32, device=v.device)
    e = v - torch.copysign(_capped(cap, scale), v)
    b = cap * torch.tensor(CAP_ERROR_RATIO, dtype=torch.float32, device=v.device)
    e = torch.where(e > b, b, torch.where(e < -b, -b, e))
    return pack_signs(v), torch.where(real, e, zero)


def _check_cap(cap: Optional[Tensor], block_size: Optional[int], weights: Optional[Tensor] = None) -> None:
    if cap is not None and (block_size is None or weights is not None):
        raise ValueError("the capped decode needs a block size and no weights")


def _real_mask(rows: int, m: int, numel: int, device) -> Tensor:
    return (torch.arange(rows * m, device=device) < numel).reshape(rows, m)


def _sign_error(v: Tensor, scale: Tensor, real: Tensor) -> Tuple[Tensor, Tensor]:
    """Pack signbit(v) and return (packed, v - copysign(scale, v)) with pad slots zeroed."""
    zero = torch.zeros((), dtype=torch.float32, device=v.device)
    new_error = torch.where(real, v - torch.copysign(scale, v), zero)
    return pack_signs(v), new_error


def worker_compress(
    x: Tensor, error: Tensor, block_size: Optional[int], weights: Optional[Tensor] = None,
    cap: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Phase 0. error is [p, m] (or flat p*m with p = 1); returns (packed [p, m/8],
    scales [p, nb], new_error [p, m]) and leaves `error` untouched. weights (x.numel()
    fp32 or bf16, optional): compress x / weights.float() instead of x. cap (x.numel()
    fp32, optional): the capped decode (module docs)."""
    _check_cap(cap, block_size, weights)
    err = error.reshape(1, -1) if error.dim() == 1 else error
    p, m = err.shape
    n0 = x.numel()
    real = _real_mask(p, m, n0, err.device)
    flat = torch.zeros(p * m, dtype=torch.float32, device=err.device)
    flat[:n0] = x.reshape(-1).to(torch.float32)
    if weights is not None:
        flat[:n0] = flat[:n0] / weights.reshape(-1).to(torch.float32)
    y = torch.where(real, flat.reshape(p, m) + err, torch.zeros((), device=err.device))
    if cap is not None:
        c = _padded_cap(cap, p, m)
        scales = _capped_scales(y, real, c, block_size)
        packed, new_error = _capped_sign_error(y, _expand(scales, m, block_size), real, c)
        return packed, scales, new_error.reshape(error.shape)
    scales = _block_rms(y, real, block_size)
    packed, new_error = _sign_error(y, _expand(scales, m, block_size), real)
    return packed, scales, new_error.reshape(error.shape)


def server_compress(
    packed: Tensor,
    scales: Tensor,
    error: Tensor,
    block_size: Optional[int],
    numel: Optional[int] = None,
    cap: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Phase 2 for one chunk: packed [p, m/8] and scales [p, nb] from every rank, server
    error [m]; returns (packed [m/8], scales [nb], new_error [m]). cap (numel fp32,
    optional): the capped decode of the chunk's real coordinates (module docs)."""
    _check_cap(cap, block_size)
    p = packed.shape[0]
    m = error.numel()
    numel = m if numel is None else numel
    neg = unpack_signs(packed)  # [p, m]
    per_elem = _expand(scales.to(torch.float32), m, block_size)
    c = None if cap is None else _padded_cap(cap, 1, m)
    if c is not None:
        per_elem = _capped(c, per_elem)
    acc = torch.zeros(m, dtype=torch.float32, device=error.device)
    for j in range(p):  # fp32, rank order: the recipe every kernel follows
        acc = acc + _signed(neg[j], per_elem[j])
    inv_p = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(p), dtype=torch.float32)
    real = _real_mask(1, m, numel, error.device)
    z = torch.where(real, (acc * inv_p.to(error.device) + error).reshape(1, m), torch.zeros((), device=error.device))
    if c is not None:
        out_scales = _capped_scales(z, real, c, block_size)
        out_packed, new_error = _capped_sign_error(z, _expand(out_scales, m, block_size), real, c)
        return out_packed[0], out_scales[0], new_error[0]
    out_scales = _block_rms(z, real, block_size)
    out_packed, new_error = _sign_error(z, _expand(out_scales, m, block_size), real)
    return out_packed[0], out_scales[0], new_error[0]


def unpack(packed: Tensor, scales: Tensor, numel: int, block_size: Optional[int],
           weights: Optional[Tensor] = None, cap: Optional[Tensor] = None) -> Tensor:
    """Decode packed [p, m/8] with scales [p, nb] into fp32 [numel], times weights
    (numel fp32 or bf16, optional, at their fp32 values); cap (numel fp32, optional): the
    capped decode."""
    _check_cap(cap, block_size, weights)
    packed2 = packed.reshape(1, -1) if packed.dim() == 1 else packed
    scales2 = scales.reshape(1, -1) if scales.dim() == 1 else scales
    m = packed2.shape[1] * 8
    per_elem = _expand(scales2.to(torch.float32), m, block_size)
    if cap is not None:
        per_elem = _capped(_padded_cap(cap, packed2.shape[0], m), per_elem)
    out = _signed(unpack_signs(packed2), per_elem).reshape(-1)[:numel]
    if weights is not None:
        return out * weights.reshape(-1).to(torch.float32)
    return out.clone()


_MOVED = {"compressed_allreduce", "hierarchical_allreduce"}  # to lbcomm.testing.kernels in 0.3


def __getattr__(name: str):
    """The simulations of the whole allreduce moved to lbcomm.testing.kernels; the old names
    still resolve (imported on first use, with a DeprecationWarning) so that `import lbcomm`
    never loads lbcomm.testing."""
    if name in _MOVED:
        import warnings

        warnings.warn(f"lbcomm.reference.{name} moved to lbcomm.testing.kernels.{name} (a test oracle, not "
                      "part of the library); import it from there", DeprecationWarning, stacklevel=2)
        from .testing import kernels

        return getattr(kernels, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
