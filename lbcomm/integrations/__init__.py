"""Wiring lbcomm into training frameworks.

* `attach(model, optimizer_or_hook_state)`: registers the right DDP communication hook
  (for a lbcomm optimizer, a `OneBitHookState` or `DCTHookState`, or a
  `OneBitLocalUpdates`) on the DistributedDataParallel inside accelerate's, Lightning's,
  transformers' or torch.compile's wrappers (no framework needed).
* `lbcomm.integrations.transformers.LbcommCallback` (needs ``transformers``),
  `lbcomm.integrations.lightning.LbcommCallback` (needs ``lightning``): attach at the
  start of training, keep every rank's lbcomm state in the framework's checkpoints and
  restore it on resume.
* `lbcomm.integrations.dcp.RankLocal`: every rank's lbcomm state as its own item of a
  torch.distributed.checkpoint; `LoadPlanner` checks that a load restores all of it and
  resumes it at another world size.

The framework modules are imported only when used; lbcomm never requires the frameworks.
"""
from .attach import attach, find_ddp, unwrap_optimizer

__all__ = ["attach", "find_ddp", "unwrap_optimizer", "RankLocal", "LoadPlanner", "MissingRankLocalError"]


def __getattr__(name):
    # torch.distributed.checkpoint takes seconds to import: only for those who use it
    if name in ("RankLocal", "LoadPlanner", "MissingRankLocalError"):
        from . import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
