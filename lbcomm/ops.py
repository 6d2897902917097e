"""Typed wrappers of the lbcomm kernels (torch.ops.lbcomm.*), the low-level public API.

Each wrapper runs the fused C++/CUDA kernel when the extension provides one for the
tensor's device, and otherwise the plain-torch reference (lbcomm.reference) after a
one-time warning that names the fix. Shapes and the bit layout are described in
`lbcomm.reduce.wire` and csrc/kernels.h.
"""
from __future__ import annotations

import logging
import warnings
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import reference as _ref
from .reduce.inputs import ComputedCaps, TableCaps
from .reduce.wire import num_blocks

__all__ = ["worker_compress", "server_compress", "unpack", "unpack_into", "HAS_EXTENSION", "extension_problem", "cpu_has_avx2"]

ABI_VERSION = 9  # must match abi_version() in csrc/ops.cpp
_log = logging.getLogger(__name__)
Cap = Union[Tensor, ComputedCaps]
_FIX = "rebuild it with `pip install --no-build-isolation -e .` in the lbcomm checkout"


def _load() -> Optional[str]:
    try:
        from . import _C  # noqa: F401  (importing runs the TORCH_LIBRARY registrations)
    except ImportError as exc:
        return f"the lbcomm C++ extension could not be loaded ({exc}); {_FIX}"
    try:
        version = torch.ops.lbcomm.abi_version()
    except (AttributeError, RuntimeError):
        version = None
    if version != ABI_VERSION:
        return f"the lbcomm C++ extension is stale (ABI {version}, expected {ABI_VERSION}); {_FIX}"
    return None


_PROBLEM = _load()
HAS_EXTENSION = _PROBLEM is None
_warned = set()


def extension_problem() -> Optional[str]:
    """Why the fused kernels are unavailable, or None when they are loaded."""
    return _PROBLEM


def _fallback(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"lbcomm: {reason}; using the slow pure-torch reference kernels", RuntimeWarning, stacklevel=3)


def _use_kernel(device: torch.device) -> bool:
    if not HAS_EXTENSION:
        _fallback(_PROBLEM)
        return False
    if device.type == "cpu" or (device.type == "cuda" and _has_cuda_kernels()):
        return True
    _fallback(f"lbcomm was built without kernels for {device.type} tensors ({_FIX} where nvcc and a CUDA torch are installed)")
    return False


def _has_cuda_kernels() -> bool:
    return HAS_EXTENSION and bool(torch.ops.lbcomm.built_with_cuda())


def kernel_computes_caps(cap, device: torch.device) -> bool:
    """Whether the ops' kernels compute these caps themselves: `TableCaps` with the variance
    on the CPU, where the CPU kernels run. Other computed caps are filled into a tensor
    first (by the op, or range by range by a reduction that stages them)."""
    return isinstance(cap, TableCaps) and cap.in_kernel() and _use_kernel(device)


def _caps(cap, kernel: bool, numel: int, device: torch.device) -> dict:
    """The ops' cap arguments: a tensor as it is; caps the kernels compute themselves
    (`kernel_computes_caps`); other computed caps filled into a new tensor."""
    if kernel and kernel_computes_caps(cap, device):
        return cap.kernel_args()
    if isinstance(cap, ComputedCaps):
        if cap.numel != numel:
            raise ValueError(f"lbcomm: the computed caps cover {cap.numel} elements, the call {numel}")
        return {"cap": cap.fill(0, numel, torch.empty(numel, dtype=torch.float32, device=device))}
    return {"cap": cap}


def cpu_has_avx2() -> bool:
    """Whether the CPU kernels run their AVX2 bodies (False with LBCOMM_DISABLE_AVX2=1)."""
    return HAS_EXTENSION and bool(torch.ops.lbcomm.cpu_has_avx2())


def worker_compress(
    x: Tensor, error: Tensor, block_size: Optional[int], error_out: Optional[Tensor] = None,
    weights: Optional[Tensor] = None, cap: Optional[Cap] = None,
) -> Tuple[Tensor, Tensor]:
    """Phase 0: y = x + error (x / weights + error with weights), one RMS scale per block,
    sign bits packed LSB first.

    Args:
        x (Tensor): float32/float16/bfloat16, numel <= error.numel().
        error (Tensor): float32 [p, m] (or [m]), m a multiple of 32; updated in place
            unless error_out is given.
        block_size (int or None): elements per scale block (multiple of 32); None gives one
            scale for the whole tensor.
        error_out (Tensor, optional): receives the new error instead of `error`.
        weights (Tensor, optional): float32 or bfloat16 per-coordinate weights, x.numel()
            elements: x is divided by their fp32 values (x.float() / weights.float(), the
            quotient rounded once) inside the kernel, so the error lives in the divided units.
        cap (Tensor, optional): float32 per-coordinate caps, x.numel() elements, the same
            on every rank: the capped decode (a value decodes to +-min(scale, cap_i); the
            block scale is the RMS over the coordinates whose cap is at least the block's
            RMS; the error is clamped to +-3 cap_i). Needs a block size, no weights. Or
            `ComputedCaps` of x.numel() elements: a `TableCaps` on the CPU is computed
            inside the kernel, other computed caps are filled into a tensor first.

    Returns:
        (packed uint8 [p, m/8], scales float32 [p, nb]); 1-D shapes for a 1-D error.
    """
    kernel = _use_kernel(error.device)
    caps = _caps(cap, kernel, x.numel(), error.device)
    if kernel:
        return torch.ops.lbcomm.worker_compress(x, error, block_size, error_out, weights, **caps)
    packed, scales, new_error = _ref.worker_compress(x, error, block_size, weights, caps["cap"])
    (error if error_out is None else error_out).copy_(new_error)
    if error.dim() == 1:
        return packed.reshape(-1), scales.reshape(-1)
    return packed, scales


def server_compress(
    packed: Tensor,
    scales: Tensor,
    error: Tensor,
    block_size: Optional[int],
    numel: Optional[int] = None,
    error_out: Optional[Tensor] = None,
    cap: Optional[Cap] = None,
) -> Tuple[Tensor, Tensor]:
    """Phase 2 for one chunk: average p ranks' packed signs and scales, add the server
    error, re-compress. packed uint8 [p, m/8], scales float32 [p, nb], error float32 [m];
    numel is the count of real (non-pad) elements in the chunk; cap (float32, numel
    elements, optional; or computed caps, see `worker_compress`): the capped decode, on the
    decode of every rank's values and on the re-compression. Returns (packed [m/8], scales [nb])."""
    kernel = _use_kernel(error.device)
    caps = _caps(cap, kernel, error.numel() if numel is None else numel, error.device)
    if kernel:
        return torch.ops.lbcomm.server_compress(packed, scales, error, block_size, numel, error_out, **caps)
    out_packed, out_scales, new_error = _ref.server_compress(packed, scales, error, block_size, numel, caps["cap"])
    (error if error_out is None else error_out).copy_(new_error)
    return out_packed, out_scales


def unpack(packed: Tensor, scales: Tensor, numel: int, block_size: Optional[int]) -> Tensor:
    """Decode packed signs [p, m/8] with scales [p, nb] into a float32 tensor of numel."""
    if _use_kernel(packed.device):
        return torch.ops.lbcomm.unpack(packed, scales, numel, block_size)
    return _ref.unpack(packed, scales, numel, block_size)


def unpack_into(packed: Tensor, scales: Tensor, block_size: Optional[int], out: Tensor,
                weights: Optional[Tensor] = None, cap: Optional[Cap] = None) -> Tensor:
    """Decode into `out` (float32/float16/bfloat16, out.numel() elements) without allocating
    when out is contiguous float32; returns out. With `weights` (float32 or bfloat16,
    out.numel() elements) each decoded value is multiplied by its weight's fp32 value (one
    fp32 product) as it is written; with `cap` (float32, out.numel() elements) each value
    decodes to +-min(scale, cap_i) (the capped decode, see `worker_compress`; or computed caps)."""
    direct = out.dtype == torch.float32 and out.is_contiguous()
    kernel = direct and _use_kernel(packed.device)
    caps = _caps(cap, kernel, out.numel(), packed.device)
    if kernel:
        torch.ops.lbcomm.unpack_into(packed, scales, block_size, out.view(-1), weights, **caps)
    else:
        out.copy_(_ref.unpack(packed, scales, out.numel(), block_size, weights, caps["cap"]).view(out.shape))
    return out


if HAS_EXTENSION:

    @torch.library.register_fake("lbcomm::worker_compress")
    def _(x, error, block_size, error_out=None, weights=None, cap=None, cap_table=None, cap_starts=None, cap_lo=0):
        m = error.shape[-1]
        lead = tuple(error.shape[:-1])
        return error.new_empty(lead + (m // 8,), dtype=torch.uint8), error.new_empty(lead + (num_blocks(m, block_size),))

    @torch.library.register_fake("lbcomm::server_compress")
    def _(packed, scales, error, block_size, numel=None, error_out=None, cap=None, cap_table=None, cap_starts=None,
          cap_lo=0):
        m = error.shape[0]
        return error.new_empty((m // 8,), dtype=torch.uint8), error.new_empty((num_blocks(m, block_size),))

    @torch.library.register_fake("lbcomm::unpack")
    def _(packed, scales, numel, block_size):
        return scales.new_empty((numel,))

    @torch.library.register_fake("lbcomm::unpack_into")
    def _(packed, scales, block_size, out, weights=None, cap=None, cap_table=None, cap_starts=None, cap_lo=0):
        return None
