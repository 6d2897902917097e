"""lbcomm: 1-bit compressed communication with error feedback for large-batch training.

What a user calls is exported here: the 1-bit optimizers and their full-precision twins
(docs/optimizers.md), the DDP and FSDP2/HSDP hooks (`lbcomm.hooks`; docs/hooks.md), the
settings `CommConfig` (communication) and `OneBitOptions` (the 1-bit optimizers' math), the reducers and the compressed allreduce itself
(docs/concepts.md), per-rank checkpoints (docs/checkpoints.md) and `attach` for
frameworks (docs/integrations.md). Everything else lives in its module: `lbcomm.reduce`
(the reduction engine: the compressed allreduce, flat and hierarchical, and the reducers),
`lbcomm.comm` (transports), `lbcomm.stats` and `lbcomm.schedules` (large-batch tools),
`lbcomm.errors`, `lbcomm.reference` (the pure-torch kernel fallback); the test oracles are
in `lbcomm.testing`, which `import lbcomm` does not load.
The map of the packages is docs/architecture.md.
"""
from . import ddp, fsdp, hooks, optim, reduce, schedules, stats, topology
from .checkpoint import load_sharded, save_sharded
from .config import CommConfig, OneBitOptions
from .dct_mp import DCTBoundary
from .ddp import (DCTHookState, OneBitHookState, WarmupAverage, dct_hook, local_gradients_hook, onebit_hook,
                  warmup_average_hook)
from .errors import NonFiniteError
from .fsdp import OneBitHSDPState, onebit_hsdp
from .integrations import attach
from .local import OneBitLocalUpdates
from .optim import DecentLaM, DmSGD, Lamb, Lars, OneBitAdam, OneBitLamb, ZeroOneAdam
from .reduce.compressed import compressed_allreduce, compressed_allreduce_
from .reduce.compression import CompressionState
from .reduce.hierarchical import HierarchicalState
from .reduce.reducer import Reducer, make_reducer
from .reduce.topology import Topology

__version__ = "0.2.0"
# What a user reads at a glance (20 names). The hooks are grouped in `lbcomm.hooks`; they,
# `NonFiniteError` (`lbcomm.errors`), `HierarchicalState` (`lbcomm.reduce.hierarchical`; made
# for the user by `make_reducer`) and the other 0.2 names stay attributes of `lbcomm`.
__all__ = [
    # optimizers
    "OneBitAdam",
    "OneBitLamb",
    "ZeroOneAdam",
    "Lamb",
    "Lars",
    "DecentLaM",
    "DmSGD",
    # local updates (DiLoCo-style) with 1-bit outer pseudo-gradients
    "OneBitLocalUpdates",
    # settings: communication, and the 1-bit optimizers' compression-stage math
    "CommConfig",
    "OneBitOptions",
    # the DDP and FSDP2/HSDP hooks with their states
    "hooks",
    # reducers and the compressed allreduce
    "Reducer",
    "make_reducer",
    "CompressionState",
    "Topology",
    "compressed_allreduce_",
    "compressed_allreduce",
    # checkpoints and frameworks
    "save_sharded",
    "load_sharded",
    "attach",
]
