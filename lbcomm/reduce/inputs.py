"""What a reduction takes besides its state: the source, sink and cap types of
`lbcomm.reduce.compressed.reduce_` and `HierarchicalState.reduce_`, computed caps
(`ComputedCaps`, and `TableCaps`, which the CPU kernels compute themselves), and the
argument checks both calls make (`check_tensor`, `check_weights`, `check_cap`)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from ..common import FLOAT_DTYPES

__all__ = ["Source", "Sink", "Cap", "ComputedCaps", "TableCaps", "result_caps", "check_tensor", "check_weights", "check_cap"]

Source = Union[Tensor, Callable[[int, int, Tensor], Any]]
Sink = Union[Tensor, Callable[[int, int, Tensor], Any]]


class ComputedCaps:
    """Caps of the capped decode produced on demand: ``fill(lo, hi, buf)`` writes the fp32
    caps of input elements [lo, hi) into `buf` (hi - lo elements), as a callable source
    writes its values. The call asks for each range when it needs it, through the state's
    bounded staging buffer, so the caps of the whole input never exist at once. Sliced like a
    tensor: ``caps[lo:hi]`` are the caps of elements lo..hi-1 (a call on part of the input
    takes its part).

    ``on_result=False`` keeps the caps out of the decode of the result: the compressing
    phases still decode under them, but the result holds each value uncapped (+-its block's
    scale), and the caller caps it itself, as sign(v) min(|v|, cap), which gives the same
    bits. OneBitAdam and ZeroOneAdam do so on the CPU, inside their update, which reads the
    variance anyway, sparing the decode a pass over it (`lbcomm.optim.kernels.frozen_adamw_`)."""

    __slots__ = ("fill_fn", "offset", "numel", "on_result")

    def __init__(self, fill: Callable[[int, int, Tensor], Any], numel: int, offset: int = 0, on_result: bool = True):
        self.fill_fn, self.numel, self.offset, self.on_result = fill, numel, offset, on_result

    def fill(self, lo: int, hi: int, buf: Tensor) -> Tensor:
        """The caps of elements [lo, hi) written into (and returned as) buf[:hi - lo]."""
        out = buf[:hi - lo]
        if hi > lo:
            self.fill_fn(self.offset + lo, self.offset + hi, out)
        return out

    def __getitem__(self, s: slice) -> "ComputedCaps":
        lo, hi, step = s.indices(self.numel)
        if step != 1:
            raise ValueError(f"{type(self).__name__}: only contiguous slices")
        return self._part(max(hi - lo, 0), self.offset + lo)

    def _part(self, numel: int, offset: int) -> "ComputedCaps":
        """The caps of `numel` elements from `offset`, of the same kind."""
        return ComputedCaps(self.fill_fn, numel, offset, self.on_result)


class TableCaps(ComputedCaps):
    """Computed caps that follow a per-parameter table: the cap of flat element i is
    (sqrt(v_i) a_p + b_p) s_p for the parameter p holding i (`starts`: int64 [P + 1], each
    parameter's first element and the end; `table`: float32 [P, 3], (a, b, s) per
    parameter; b = +inf: uncapped). On the CPU the compressing ops compute them unit by unit
    from `v` inside their pass (``kernel_args``), so no caps are written and read back;
    elsewhere the call fills them range by range like any `ComputedCaps` (`fill`, which
    must compute the same values)."""

    __slots__ = ("v", "starts", "table")

    def __init__(self, v: Tensor, starts: Tensor, table: Tensor, fill: Callable[[int, int, Tensor], Any],
                 numel: int, offset: int = 0, on_result: bool = True):
        super().__init__(fill, numel, offset, on_result)
        self.v, self.starts, self.table = v, starts, table

    def _part(self, numel: int, offset: int) -> "TableCaps":
        return TableCaps(self.v, self.starts, self.table, self.fill_fn, numel, offset, self.on_result)

    def in_kernel(self) -> bool:
        """Whether the compressing ops compute these caps themselves (the variance on the CPU)."""
        return self.v.device.type == "cpu"

    def kernel_args(self) -> dict:
        """The ops' arguments that compute these caps: the variance as ``cap``, the table."""
        return {"cap": self.v, "cap_table": self.table, "cap_starts": self.starts, "cap_lo": self.offset}


Cap = Union[Tensor, ComputedCaps, Callable[[int, int, Tensor], Any]]


def result_caps(cap: Union[None, Tensor, ComputedCaps]) -> Union[None, Tensor, ComputedCaps]:
    """The caps the decode of the result applies: `cap`, or None where the caller caps the
    result itself (``ComputedCaps.on_result`` False)."""
    return None if isinstance(cap, ComputedCaps) and not cap.on_result else cap


def check_tensor(name: str, t: Tensor, numel: int, device: torch.device, what: str, kind: str) -> None:
    """The checks every entry point makes of an input or output tensor: a float dtype,
    the state's size and device (`kind` names the state class in the message)."""
    if not isinstance(t, Tensor) or t.dtype not in FLOAT_DTYPES:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name}: expected a float32/float16/bfloat16 tensor, got {got} ({what})")
    if t.numel() != numel:
        raise ValueError(f"{name}: {what} has {t.numel()} elements but the state was built for {numel}; "
                         f"use one {kind} per tensor size")
    if t.device != device:
        raise ValueError(f"{name}: {what} is on {t.device} but the state's buffers are on "
                         f"{device}; build the state with device={t.device!s}")


def check_weights(name: str, weights: Optional[Tensor], numel: int, device: torch.device) -> Optional[Tensor]:
    """Per-coordinate weights (see `lbcomm.reduce.compressed.reduce_`), flat, or None."""
    if weights is None:
        return None
    if not isinstance(weights, Tensor) or weights.dtype not in (torch.float32, torch.bfloat16) \
            or weights.numel() != numel or weights.device != device:
        got = (f"{weights.dtype} {tuple(weights.shape)} on {weights.device}" if isinstance(weights, Tensor)
               else type(weights).__name__)
        raise ValueError(f"{name}: weights must be a float32 or bfloat16 tensor of {numel} elements on "
                         f"{device} (one per coordinate), got {got}")
    return weights.reshape(-1)


def check_cap(name: str, cap: Optional[Cap], numel: int, device: torch.device, block_size: Optional[int],
              weights: Optional[Tensor]) -> Union[None, Tensor, ComputedCaps]:
    """Per-coordinate caps of the capped decode (see `lbcomm.reduce.compressed.reduce_`): a flat
    tensor, a `ComputedCaps` (a callable cap(lo, hi, buf) is wrapped in one), or None."""
    if cap is None:
        return None
    if isinstance(cap, ComputedCaps) or (callable(cap) and not isinstance(cap, Tensor)):
        cap = cap if isinstance(cap, ComputedCaps) else ComputedCaps(cap, numel)
        if cap.numel != numel:
            raise ValueError(f"{name}: cap covers {cap.numel} elements, the state was built for {numel}")
    elif not isinstance(cap, Tensor) or cap.dtype != torch.float32 or cap.numel() != numel or cap.device != device:
        got = f"{cap.dtype} {tuple(cap.shape)} on {cap.device}" if isinstance(cap, Tensor) else type(cap).__name__
        raise ValueError(f"{name}: cap must be a float32 tensor of {numel} elements on {device}, or a callable "
                         f"cap(lo, hi, buf), got {got}")
    if block_size is None:
        raise ValueError(f"{name}: the capped decode needs blocks (this state has block_size=None: one scale)")
    if weights is not None:
        raise ValueError(f"{name}: cap and weights cannot be combined")
    return cap if isinstance(cap, ComputedCaps) else cap.reshape(-1)
