"""lbcomm: 1-bit compressed allreduce with error feedback for large-batch training.

The core (`compressed_allreduce`, docs/concepts.md), the optimizers (`lbcomm.optim`,
docs/optimizers.md) with their per-rank checkpoints, and the DDP communication hooks
(`lbcomm.ddp`, docs/hooks.md).
"""
from . import ddp, fsdp, ops, optim, reference, schedules, stats, topology, wire
from .checkpoint import load_sharded, save_sharded, shard_path
from .compressed import (DEFAULT_BLOCK_SIZE, CompressionState, NonFiniteError, compressed_allreduce,
                         compressed_allreduce_)
from .config import CommConfig
from .ddp import (OneBitHookState, onebit_hook, onebit_optimizer_bf16_hook, onebit_optimizer_fp16_hook,
                  onebit_optimizer_hook, onebit_optimizer_hook_for)
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
    "onebit_optimizer_hook",
    "onebit_optimizer_fp16_hook",
    "onebit_optimizer_bf16_hook",
    "onebit_optimizer_hook_for",
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
