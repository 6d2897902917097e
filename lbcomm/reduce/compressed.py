"""The entry points of the flat 1-bit compressed allreduce with two-stage error feedback
(the algorithm and its error-feedback invariant are described in docs/concepts.md).

Every entry point, optimizer and hook goes through `reduce_`; the state it works on is
`lbcomm.reduce.compression.CompressionState`, the call itself (schedule, phases, wire
rows) is `lbcomm.reduce.flatcall.FlatCall`; transports only move bytes.

`compressed_allreduce_(tensor, state)` reduces in place and allocates nothing (torch's
`dist.all_reduce` convention); `compressed_allreduce(tensor, state, out=out)` writes the
result into `out`; `reduce_(state, source, sink)` is the one call under both, and also
takes callables that produce the input and consume the result range by range, so the
optimizers never materialize a model-sized copy of either.

A caller that has already agreed on finiteness with the other ranks passes
`checked=True` to `reduce_` and saves the small all_reduce (every rank must then pass it);
what a non-finite input does to the error buffers is described in
`lbcomm.reduce.compression`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor

from ..common import drive
from .compression import CompressionState
from .flatcall import FlatCall
from .inputs import Cap, Sink, Source

__all__ = ["reduce_", "compressed_allreduce_", "compressed_allreduce"]


def _run(name: str, state: CompressionState, source: Source, sink: Sink, checked: bool,
         result: Callable[[bool], Any], weights: Optional[Tensor], async_op: bool, cap: Optional[Cap] = None):
    if not isinstance(state, CompressionState):
        raise TypeError(f"{name}: state must be a CompressionState, got {type(state).__name__}")
    return drive(FlatCall(name, state, source, sink, checked, result, weights, cap).steps(), state.device, async_op)


def reduce_(state: CompressionState, source: Source, sink: Sink, *, checked: bool = False, async_op: bool = False,
            weights: Optional[Tensor] = None, cap: Optional[Cap] = None):
    """The compressed allreduce that every entry point, optimizer and hook goes through:
    the approximate MEAN of `source` over the ranks of the state's group, into `sink`.

    Args:
        state (CompressionState): this rank's error feedback for this size.
        source (Tensor or callable): a float32/float16/bfloat16 tensor of `state.numel`
            elements on `state.device` (read before the sink is written, so it may be the
            sink itself), or ``source(lo, hi, buf)`` that writes input elements [lo, hi)
            (flat indices into the unpadded input) as fp32 into the 1-D fp32 tensor `buf`
            of hi - lo elements. A callable source is called range by range (runs of whole
            blocks, each range once) through a staging buffer of about `buffers.STAGING_MIN`
            elements owned by the state, so the whole input never exists at once. With
            block_size=None (one scale for the whole tensor) the staging buffer must hold
            the whole input: it is allocated at full size in that case only.
        sink (Tensor or callable): a float32/float16/bfloat16 tensor of `state.numel`
            elements that receives the result (decoded without allocating when it is
            contiguous float32), or ``sink(lo, hi, values)`` that receives the fp32 result
            elements [lo, hi) range by range (whole blocks, bounded staging; `values` is
            reused after the callback returns). Untouched (not called) by a skipped call.
        checked (bool, optional): the caller guarantees that every rank has already
            agreed that every rank's input is finite: the call skips its own finiteness
            agreement (one small all_reduce). Every rank must pass the same value.
            Required for a callable source (default: False).
        async_op (bool, optional): return a torch.futures.Future of the result; the
            collectives are chained through callbacks without blocking. Keep one async call
            in flight per process group (on torch.distributed: later collectives are issued
            from callbacks, so two concurrent calls could interleave differently on
            different ranks; the wire headers then make every rank raise) (default: False).
        weights (Tensor, optional): float32 or bfloat16 per-coordinate weights w > 0 of
            `state.numel` elements on `state.device`, the same on every rank (bfloat16
            halves what the call reads; either is used at its exact fp32 value): the call
            compresses source / w (the error feedback lives in those units) and writes
            the decoded mean times w, both fused into the passes the call makes anyway.
            Bitwise the same as dividing the input by w in fp32 before the call and
            multiplying the result by w after it. With one rank the sink receives the
            input unchanged (default: None).
        cap (Tensor, optional): float32 per-coordinate bounds c >= 0 (inf: none) of
            `state.numel` elements on `state.device`, the same on every rank: the capped
            decode. Wherever a value is decoded (the server's mean of the ranks' values,
            the result) coordinate i decodes to +-min(scale, c_i), so no coordinate of the
            result exceeds its bound; each block's scale is the RMS over the coordinates
            whose bound is at least the block's RMS (the bounded ones would otherwise
            deflate it), and the error feedback keeps what the bound held back, within
            +-3 c_i, to deliver it in later calls. Needs a block size and no weights.
            The wire format and bytes are unchanged. Or a callable ``cap(lo, hi, buf)``
            (or a `lbcomm.reduce.inputs.ComputedCaps`) that writes the caps of elements
            [lo, hi) into the fp32 `buf`, as a callable source writes its values: the call
            asks for each range when it needs it (each possibly more than once), through a
            bounded staging buffer, so the caps never exist whole; the result is bitwise
            that of the same caps passed as a tensor. A `lbcomm.reduce.inputs.TableCaps`
            (caps that follow a per-parameter formula of a variance) the CPU kernels
            compute themselves, block by block, with no staging. 1-bit Adam passes the
            momentum whose step is max_update's bound, computed from its frozen variance
            (default: None).

    Returns:
        True when the result was written, False when the call was skipped for non-finite
        values with ``nonfinite="skip"`` (or a Future of that bool). With
        ``nonfinite="raise"`` a NonFiniteError is raised instead (on every rank). With one
        rank nothing is compressed: the sink receives the input unchanged.
    """
    return _run("reduce_", state, source, sink, checked, bool, weights, async_op, cap)


def compressed_allreduce_(tensor: Tensor, state: CompressionState, *, async_op: bool = False,
                          weights: Optional[Tensor] = None):
    """In-place approximate MEAN of `tensor` over the ranks of the state's group, in about
    1 bit per element; allocates nothing (the primary entry point, like `dist.all_reduce`).

    Args:
        tensor (Tensor): float32/float16/bfloat16, `state.numel` elements, on
            `state.device`; half precision is upcast into the fp32 error domain and the
            result cast back. Left unchanged by a call skipped for non-finite input.
        state (CompressionState): this rank's error feedback for this tensor size.
        async_op (bool, optional): return a Future (see `reduce_`) (default: False).
        weights (Tensor, optional): per-coordinate weights (see `reduce_`) (default: None).

    Returns:
        `tensor` (or a Future of it), bitwise identical on every rank; `state.last_skipped`
        says whether a ``nonfinite="skip"`` call was skipped.

    Example::

        >>> state = lbcomm.CompressionState(grad.numel())
        >>> lbcomm.compressed_allreduce_(grad, state)          # grad now holds the mean
        >>> fut = lbcomm.compressed_allreduce_(grad, state, async_op=True)
    """
    return _run("compressed_allreduce_", state, tensor, tensor, False, lambda applied: tensor, weights, async_op)


def compressed_allreduce(tensor: Tensor, state: CompressionState, *, out: Tensor, async_op: bool = False,
                         weights: Optional[Tensor] = None):
    """Approximate MEAN of `tensor` over the ranks of the state's group, into `out`.

    Args:
        tensor (Tensor): float32/float16/bfloat16, `state.numel` elements, on `state.device`.
            Not modified (unless it is `out`).
        state (CompressionState): this rank's error feedback for this tensor size.
        out (Tensor): receives the result (may be `tensor` itself); a float32 contiguous
            `out` is decoded without allocating. Left unchanged by a call skipped for
            non-finite input.
        async_op (bool, optional): return a Future of the result (see `reduce_`) (default: False).
        weights (Tensor, optional): per-coordinate weights (see `reduce_`) (default: None).

    Returns:
        `out` (or a Future of it), bitwise identical on every rank.
    """
    return _run("compressed_allreduce", state, tensor, out, False, lambda applied: out, weights, async_op)
