"""Drop-in torch.optim optimizers that communicate 1 bit per element (docs/optimizers.md).

`OneBitAdam` and `OneBitLamb` run AdamW / LAMB on averaged gradients during a warmup,
then freeze the variance and reduce the momentum with one compressed allreduce per
step; `Lamb` and `Lars` are the full-precision baselines. One module per idea:

* `flat`: the flat layout of the state (`FlatLayout`, `Segment`);
* `functional`: the update math over flat slices (AdamW, LAMB, 1-bit LAMB's factor);
* `base`: `BaseOptimizer`, validation, the step skeleton, warmup averaging, checkpoints;
* `onebit`: `OneBitOptimizer`, the freeze, the mask and the compressed momentum;
* `adam`, `lamb`, `lars`, `zeroone`: the optimizers; `reference`: the plain-torch simulation (test oracle).
"""
import warnings

from .adam import OneBitAdam
from .base import BaseOptimizer
from .lamb import Lamb, OneBitLamb
from .lars import Lars
from .onebit import OneBitOptimizer
from .zeroone import ZeroOneAdam

__all__ = ["OneBitAdam", "OneBitLamb", "Lamb", "Lars", "ZeroOneAdam", "BaseOptimizer", "OneBitOptimizer"]


def __getattr__(name):
    if name == "FlatOptimizer":  # the pre-0.2 base class, split into BaseOptimizer and OneBitOptimizer
        warnings.warn("lbcomm.optim.FlatOptimizer is deprecated: use lbcomm.optim.BaseOptimizer (validation, flat "
                      "state, step skeleton) or lbcomm.optim.OneBitOptimizer (the 1-bit machinery)",
                      DeprecationWarning, stacklevel=2)
        return OneBitOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
