"""The communication hooks in one place, as torch groups its ``ddp_comm_hooks``: each hook
with the state it takes (docs/hooks.md, docs/topology.md, docs/dct.md).

DDP (``ddp_model.register_comm_hook(state, hook)``):

* `onebit_hook` with `OneBitHookState`: the 1-bit compressed allreduce with error feedback
  for any optimizer;
* `warmup_average_hook` with `WarmupAverage`: the full-precision warmup of a 1-bit optimizer
  (it takes the communication over at the freeze);
* `local_gradients_hook` (no state): no communication, for `OneBitLocalUpdates` under DDP;
* `dct_hook` with `DCTHookState`: the thresholded sparse exchange.

FSDP2/HSDP: `onebit_hsdp` with `OneBitHSDPState`, the 1-bit all-reduce across nodes. Model
parallelism: `DCTBoundary`, the thresholded exchange across a two-rank boundary.

The same names are attributes of `lbcomm` itself, as in 0.2.
"""
from .dct_mp import DCTBoundary
from .ddp import (DCTHookState, OneBitHookState, WarmupAverage, dct_hook, local_gradients_hook, onebit_hook,
                  warmup_average_hook)
from .fsdp import OneBitHSDPState, onebit_hsdp

__all__ = ["onebit_hook", "OneBitHookState", "warmup_average_hook", "WarmupAverage", "local_gradients_hook",
           "dct_hook", "DCTHookState", "onebit_hsdp", "OneBitHSDPState", "DCTBoundary"]
