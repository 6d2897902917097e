"""lbcomm: 1-bit compressed allreduce with error feedback for large-batch training.

The core (`compressed_allreduce`, docs/concepts.md), the optimizers (`lbcomm.optim`,
docs/optimizers.md) with their per-rank checkpoints, and the DDP communication hooks
(`lbcomm.ddp`, docs/hooks.md).
"""
from . import ddp, fsdp, ops, optim, reference, schedules, stats, topology, wire
from .checkpoint import load_sharded, save_sharded, shard_path
from .config import CommConfig
from .compressed import (DEFAULT_BLOCK_SIZE, CompressionState, NonFiniteError, compressed_allreduce,
                         compressed_allreduce_)
from .ddp import OneBitHookState, WarmupAverage, onebit_hook, warmup_average_hook
from .integrations import attach
from .optim import Lamb, Lars, OneBitAdam, OneBitLamb, ZeroOneAdam
from .topology import HierarchicalState, Topology, hierarchical_allreduce_

__version__ = "0.1.0"
__all__ = [
    "CommConfig",
    "CompressionState",
    "compressed_allreduce",
    "compressed_allreduce_",
    "NonFiniteError",
    "DEFAULT_BLOCK_SIZE",
    "Topology",
    "HierarchicalState",
    "hierarchical_allreduce_",
    "OneBitAdam",
    "ZeroOneAdam",
    "OneBitLamb",
    "Lamb",
    "Lars",
    "save_sharded",
    "load_sharded",
    "shard_path",
    "OneBitHookState",
    "onebit_hook",
    "WarmupAverage",
    "warmup_average_hook",
    "attach",
    "ops",
    "optim",
    "ddp",
    "fsdp",
    "topology",
    "reference",
    "schedules",
    "wire",
    "stats",
]
