"""The 0.2 path of the flat compressed allreduce. The code lives in `lbcomm.reduce`: the
state in `lbcomm.reduce.compression`, the entry points in `lbcomm.reduce.compressed`, its
buffers in `lbcomm.reduce.buffers`; this module re-exports them."""
from .common import NonFiniteError
from .reduce.buffers import STAGING_MIN
from .reduce.compressed import compressed_allreduce, compressed_allreduce_, reduce_
from .reduce.compression import MAX_PIECES, PIECE_MIN, CompressionState
from .reduce.flatcall import FlatCall
from .reduce.inputs import Cap, Sink, Source
from .reduce.wire import AGREEMENT_BYTES, ALIGN, check_block_size, chunk_size, piece_spans, row_layout

__all__ = ["CompressionState", "compressed_allreduce_", "compressed_allreduce", "reduce_", "NonFiniteError",
           "PIECE_MIN", "MAX_PIECES", "STAGING_MIN", "FlatCall", "Cap", "Sink", "Source", "AGREEMENT_BYTES", "ALIGN",
           "check_block_size", "chunk_size", "piece_spans", "row_layout"]
