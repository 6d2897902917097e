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

# Optimizers (DESIGN.md §3) and their per-rank checkpoints.
from . import optim
from .checkpoint import load_sharded, save_sharded, shard_path
from .optim import Lamb, OneBitAdam, OneBitLamb

__all__ += ["optim", "OneBitAdam", "OneBitLamb", "Lamb", "save_sharded", "load_sharded", "shard_path"]

# DDP communication hooks (DESIGN.md §4).
from . import ddp
from .ddp import OneBitHookState, onebit_hook, onebit_optimizer_fp16_hook, onebit_optimizer_hook

__all__ += ["ddp", "OneBitHookState", "onebit_hook", "onebit_optimizer_hook", "onebit_optimizer_fp16_hook"]
