"""Drop-in torch.optim optimizers that communicate 1 bit per element (DESIGN.md §3).

`OneBitAdam` and `OneBitLamb` run AdamW / LAMB on averaged gradients during a warmup,
then freeze the variance and reduce the momentum with one compressed allreduce per
step; `Lamb` is the full-precision baseline. The machinery they share (flat fp32 state,
bucketed warmup averaging, the freeze, the mask, checkpoints) lives in `base`.
"""
from .adam import OneBitAdam
from .base import FlatOptimizer
from .lamb import Lamb, OneBitLamb

__all__ = ["OneBitAdam", "OneBitLamb", "Lamb", "FlatOptimizer"]
