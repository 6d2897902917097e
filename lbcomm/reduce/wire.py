"""Layout math and the wire format of the compressed allreduce, in one place.

Shared by the kernels' wrappers (`lbcomm.ops`), the algorithm (`lbcomm.reduce.flatcall`,
`lbcomm.reduce.buffers`), the plain-torch kernels (`lbcomm.reference`) and the oracles
(`lbcomm.testing`):

* the padded layout: a tensor of `numel` elements on p ranks is p chunks of
  `chunk_size(numel, p)` elements (a multiple of ALIGN), each cut into `num_blocks` scale
  blocks of `block_size` elements (the last may be shorter; None: one scale per chunk);
* the piece plan: each chunk cut into runs of whole blocks (`piece_spans`) so that a call
  can be pipelined, and ranges of whole blocks for bounded staging (`block_ranges`);
* a wire row (`RowLayout`): one chunk's piece as sign bytes, then its fp32 block scales,
  then a HEADER_BYTES header (`encode_header`) that every receiving rank compares
  (`check_headers`), so that ranks that call out of step all raise the same error.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "ALIGN",
    "HEADER_BYTES",
    "chunk_size",
    "padded_numel",
    "num_blocks",
    "check_block_size",
    "piece_spans",
    "block_ranges",
    "RowLayout",
    "row_layout",
    "encode_header",
    "describe_header",
    "check_headers",
    "agreement_vector",
    "AGREEMENT_BYTES",
    "read_agreement",
]

ALIGN = 32  # chunk sizes and block sizes are multiples of this (one 32-bit word of bits)
HEADER_BYTES = 24  # int32: numel low 31 bits, numel high bits, call count, block size (0: none), piece, pieces


def chunk_size(numel: int, world_size: int) -> int:
    """Elements per rank's chunk: numel padded up to a multiple of ALIGN * world_size, over p."""
    per = ALIGN * world_size
    return ((numel + per - 1) // per) * ALIGN


def padded_numel(numel: int, world_size: int) -> int:
    """numel padded so that every rank's chunk is a whole number of ALIGN-element words."""
    return chunk_size(numel, world_size) * world_size


def num_blocks(m: int, block_size: Optional[int]) -> int:
    """Scale slots per chunk of m elements (one when block_size is None)."""
    return (m + block_size - 1) // block_size if block_size else 1


def check_block_size(block_size: Optional[int]) -> None:
    """Raise a ValueError unless block_size is None or a positive multiple of ALIGN."""
    if block_size is None:
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 or block_size % ALIGN:
        raise ValueError(f"Invalid block_size: {block_size!r} (use None or a positive multiple of {ALIGN})")


def piece_spans(chunk: int, block_size: Optional[int], count: int) -> List[Tuple[int, int]]:
    """[lo, hi) element spans of a chunk cut into `count` runs of whole blocks (fewer when
    the chunk has fewer blocks); one span without block scales or for count <= 1."""
    if block_size is None or chunk <= block_size or count <= 1:
        return [(0, chunk)]
    per = -(-chunk // count)
    step = -(-per // block_size) * block_size  # chunk / count, rounded up to whole blocks
    return [(lo, min(lo + step, chunk)) for lo in range(0, chunk, step)]


def block_ranges(lo: int, hi: int, block_size: Optional[int], cap: int) -> List[Tuple[int, int]]:
    """[lo, hi) cut into consecutive ranges of at most `cap` elements that start on block
    boundaries relative to lo (whole ALIGN words without block scales). lo must start a block."""
    unit = block_size or ALIGN
    step = max(unit, cap // unit * unit)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


class RowLayout(NamedTuple):
    """Byte layout of one wire row: a chunk's piece of `length` elements."""

    sign_bytes: int  # the packed sign bits: bytes [0, sign_bytes)
    scales_end: int  # the fp32 block scales: bytes [sign_bytes, scales_end)
    row_bytes: int  # the header: bytes [scales_end, row_bytes)


def row_layout(length: int, block_size: Optional[int]) -> RowLayout:
    """The wire row of a piece of `length` elements (a multiple of 8)."""
    sign_bytes = length // 8
    scales_end = sign_bytes + 4 * num_blocks(length, block_size)
    return RowLayout(sign_bytes, scales_end, scales_end + HEADER_BYTES)


def encode_header(numel: int, calls: int, block_size: Optional[int], piece: int, pieces: int) -> Tensor:
    """The HEADER_BYTES of a row as int32 [6] (view it as uint8 to write it)."""
    return torch.tensor([numel & 0x7FFFFFFF, numel >> 31, calls & 0x7FFFFFFF, block_size or 0, piece, pieces],
                        dtype=torch.int32)


def describe_header(rank: int, header: Tensor) -> str:
    h = [int(v) for v in header]
    return f"rank {rank}: numel={h[0] + (h[1] << 31)} call={h[2]} block_size={h[3] or None} piece={h[4]}/{h[5]}"


def check_headers(rows: Tensor, expected: Tensor, consequence: str) -> None:
    """Compare the header at the end of every row of uint8 `rows` [p, row_bytes] (one row
    per sending rank) with `expected` (from encode_header); raise a ValueError that lists
    every rank's header and ends with `consequence` when any differs."""
    heads = rows[:, -HEADER_BYTES:].contiguous().view(torch.int32).cpu()
    if not bool((heads == expected).all()):
        desc = ", ".join(describe_header(r, h) for r, h in enumerate(heads))
        raise ValueError(f"compressed_allreduce: ranks called with different tensors or are out of step ({desc}); "
                         f"{consequence}")


# Bytes of one agreement vector: float64 (flag, header, -header).
AGREEMENT_BYTES = 8 * (1 + 2 * HEADER_BYTES // 4)


def agreement_vector(header: Tensor, flag: bool) -> Tensor:
    """float64 [1 + 2 h]: (flag, header, -header). Reduced with "max" over the ranks it
    holds whether any rank raised its flag, and each header field's maximum and (negated)
    minimum, so that every rank learns whether all headers agree from one small allreduce."""
    h = header.to(torch.float64)
    return torch.cat([torch.tensor([1.0 if flag else 0.0], dtype=torch.float64), h, -h])


def read_agreement(reduced: Tensor, consequence: str) -> bool:
    """From an agreement_vector reduced with "max": whether any rank raised its flag.
    Raises a ValueError naming the fields that differ, ending with `consequence`."""
    v = reduced.cpu()
    k = (v.numel() - 1) // 2
    high, low = v[1:1 + k], -v[1 + k:]
    if not bool((high == low).all()):
        names = ("numel low bits", "numel high bits", "call", "block_size", "piece", "pieces")
        desc = ", ".join(f"{names[i]} from {int(low[i])} to {int(high[i])}" for i in range(k) if high[i] != low[i])
        raise ValueError(f"compressed_allreduce: ranks called with different tensors or are out of step ({desc}); "
                         f"{consequence}")
    return bool(v[0] > 0)
