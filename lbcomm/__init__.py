"""lbcomm: 1-bit compressed allreduce with error feedback for large-batch training."""
from . import ops, reference
from .compressed import DEFAULT_BLOCK_SIZE, CompressionState, NonFiniteError, compressed_allreduce

__version__ = "0.1.0"
__all__ = [
    "CompressionState",
    "compressed_allreduce",
    "NonFiniteError",
    "DEFAULT_BLOCK_SIZE",
    "ops",
    "reference",
]
