"""The reusable buffers of one flat compressed state (`FlatBuffers`): the uint8 wire rows of
every piece (`WireBuffers`), the fp32 staging through which callable sources, sinks and
computed caps run, and the real-element counts behind each block scale. This is the
public buffer API that `lbcomm.reduce.flatcall.FlatCall` works through; a
`lbcomm.reduce.compression.CompressionState` owns one as ``state.buffers``.

Memory: about 0.3 bytes per element for the wire rows (allocated at the first call), and
a staging buffer of about STAGING_MIN elements, allocated only for callable sources or
sinks, half-precision outputs and computed caps (or lent by an owner, `share_staging`).
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .wire import ALIGN, RowLayout, row_layout

__all__ = ["FlatBuffers", "WireBuffers", "STAGING_MIN"]

# Elements of the staging buffer through which callable sources and sinks run (1 MB),
# rounded down to whole blocks (at least one block).
STAGING_MIN = 1 << 18


class WireBuffers(NamedTuple):
    """The uint8 buffers of one piece: rows sent to / received from every rank in the
    all-to-all, this rank's server row, and every rank's server row after the all-gather.
    `gathered` is `recv` itself: the piece's server compress has consumed the received
    rows before its all-gather is started."""

    send: Tensor  # [p, row_bytes]
    recv: Tensor  # [p, row_bytes]
    server_send: Tensor  # [row_bytes]
    gathered: Tensor  # [p, row_bytes], the storage of recv


class FlatBuffers:
    """The wire rows and staging buffers of one flat state (see the module docs).

    Args:
        numel (int): elements of the tensors the state reduces (unpadded).
        world_size (int), rank (int): the state's ranks and this rank.
        chunk (int): elements per rank's chunk (`lbcomm.reduce.wire.chunk_size`).
        block_size (int or None): elements per scale block.
        piece_spans (list of (int, int)): the [lo, hi) spans of a chunk's pieces.
        device (torch.device): where every buffer lives.

    Attributes:
        layouts (list of RowLayout): the wire row of every piece.
        row_bytes (int): bytes of one rank's rows of every piece (one all-to-all row each).
    """

    def __init__(self, numel: int, world_size: int, rank: int, chunk: int, block_size: Optional[int],
                 piece_spans: Sequence[Tuple[int, int]], device: torch.device):
        self.numel, self.world_size, self.rank, self.chunk = numel, world_size, rank, chunk
        self.block_size, self.piece_spans, self.device = block_size, list(piece_spans), device
        self.layouts: List[RowLayout] = [row_layout(hi - lo, block_size) for lo, hi in self.piece_spans]
        self.row_bytes = sum(r.row_bytes for r in self.layouts)
        self._wire: Optional[List[WireBuffers]] = None  # allocated on first use
        self._staging: Optional[Tensor] = None  # fp32, for callable sources/sinks, half outputs, computed caps
        self._counts: Optional[List[Tuple[Tensor, Tensor]]] = None  # real elements per block, per piece

    # ------------------------------------------------------------------ wire rows
    @property
    def allocated(self) -> bool:
        """Whether the wire rows exist (they are allocated by the first `wire` call)."""
        return self._wire is not None

    def wire(self) -> List[WireBuffers]:
        """The wire rows of every piece, allocated on first use and reused by every call."""
        if self._wire is None:
            p = self.world_size
            u8 = dict(dtype=torch.uint8, device=self.device)
            self._wire = []
            for r in self.layouts:
                recv = torch.empty(p, r.row_bytes, **u8)
                self._wire.append(WireBuffers(torch.empty(p, r.row_bytes, **u8), recv,
                                              torch.empty(r.row_bytes, **u8), recv))
        return self._wire

    def scales(self, rows: Tensor, s: int) -> Tensor:
        """The fp32 block scales of wire rows of piece s (a view of the uint8 `rows`,
        [..., row_bytes])."""
        layout = self.layouts[s]
        return rows[..., layout.sign_bytes:layout.scales_end].view(torch.float32)

    def block_counts(self, s: int) -> Tuple[Tensor, Tensor]:
        """(worker [p, nb], server [nb]): the real (not padding) elements behind each block
        scale of piece s, float64 (the weights of `CompressionState.last_sent_norm`)."""
        if self._counts is None:
            p, m, n0 = self.world_size, self.chunk, self.numel
            self._counts = []
            for lo, hi in self.piece_spans:
                step = self.block_size or max(hi - lo, 1)  # None: one scale per row
                starts = torch.arange(lo, hi, step, dtype=torch.int64)
                lengths = (starts + step).clamp(max=hi) - starts
                firsts = torch.arange(p, dtype=torch.int64)[:, None] * m + starts
                real = torch.minimum((n0 - firsts).clamp(min=0), lengths).to(torch.float64).to(self.device)
                self._counts.append((real, real[self.rank]))
        return self._counts[s]

    # ------------------------------------------------------------------ staging
    @property
    def staging_cap(self) -> int:
        """Elements per range of a callable source or sink: whole blocks (ALIGN words
        without block scales), about STAGING_MIN."""
        unit = self.block_size or ALIGN
        return max(unit, STAGING_MIN // unit * unit)

    def staging(self, n: int) -> Tensor:
        """A reused fp32 buffer of at least n elements."""
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(n, dtype=torch.float32, device=self.device)
        return self._staging

    def cap_staging(self) -> Tensor:
        """`staging_cap` fp32 elements for computed caps, beside the values' range: the
        second `staging_cap` elements of the staging buffer (computed caps need block
        scales, so no range of values is longer)."""
        n = self.staging_cap
        return self.staging(2 * n)[n:2 * n]

    def share_staging(self, buffer: Tensor) -> None:
        """Stage through `buffer` (1-D contiguous fp32 on the device) when it is at least as
        large as the current staging buffer (see `CompressionState.share_staging`)."""
        if buffer.dtype != torch.float32 or buffer.dim() != 1 or not buffer.is_contiguous() \
                or buffer.device != self.device:
            raise ValueError(f"share_staging: expected a 1-D contiguous float32 tensor on {self.device}, got "
                             f"{buffer.dtype} {tuple(buffer.shape)} on {buffer.device}")
        if self._staging is None or buffer.numel() >= self._staging.numel():
            self._staging = buffer
