"""The 0.2 path of the layout math and wire format. The code lives in
`lbcomm.reduce.wire`; this module re-exports it."""
from .reduce.wire import (AGREEMENT_BYTES, ALIGN, HEADER_BYTES, RowLayout, agreement_vector, block_ranges,
                          check_block_size, check_headers, chunk_size, describe_header, encode_header, num_blocks,
                          padded_numel, piece_spans, read_agreement, row_layout)

__all__ = ["ALIGN", "HEADER_BYTES", "chunk_size", "padded_numel", "num_blocks", "check_block_size", "piece_spans",
           "block_ranges", "RowLayout", "row_layout", "encode_header", "describe_header", "check_headers",
           "agreement_vector", "AGREEMENT_BYTES", "read_agreement"]
