"""Drop-in torch.optim optimizers that communicate 1 bit per element (docs/optimizers.md).

`OneBitAdam` and `OneBitLamb` run AdamW / LAMB on averaged gradients during a warmup,
then freeze the variance and reduce the momentum with one compressed allreduce per
step; `ZeroOneAdam` adds local steps; `Lamb` and `Lars` are the full-precision baselines.
Constructors take the algorithm's hyperparameters, ``comm=lbcomm.CommConfig(...)`` and,
for the 1-bit optimizers, ``options=lbcomm.OneBitOptions(...)`` (the compression stage's math).
One module per idea:

* `flat`: the flat layout of the state (`FlatLayout`, `Segment`); `flatstate`: the flat
  state as one object (`FlatState`: layout, buffers, vectors, gradient buffer, device,
  shard agreement) that every piece below takes; `state`: building it, and the
  checkpoint format with its versioning;
* `functional`, `kernels`: the update math over flat slices (AdamW, LAMB, 1-bit LAMB's factor);
* `base`: `BaseOptimizer`, the step skeleton and checkpoints; `warmup`: the warmup's
  gradient averaging; `stepstats`: the gradient noise statistics each step feeds;
* `agree`: what the ranks agree on (the averaged-gradients probe, shard verdicts, clipping);
* `onebit`: `OneBitStage`, the 1-bit component (freeze, mask, bound, compressed momentum),
  with `exact` (exactly averaged small parameters), `mask`, `bounds` (max_update),
  `freeze` (freeze_step="auto") and `onebit_report` (logs, warnings, bytes per step);
* `adam` (with `rescale`), `lamb`, `onebit_lamb` (with `lamb_norm`), `lars`, `zeroone` (with `local_steps`):
  the optimizers; `decentlam` (with `gossip`, the neighbour averaging): `DecentLaM` and
  `DmSGD`, decentralized momentum SGD; `reference`: the plain-torch simulation (test oracle).
"""
from ..config import OneBitOptions
from .adam import OneBitAdam
from .base import BaseOptimizer
from .decentlam import DecentLaM, DmSGD
from .flatstate import FlatState
from .lamb import Lamb
from .lars import Lars
from .onebit import OneBitStage
from .onebit_lamb import OneBitLamb
from .zeroone import ZeroOneAdam

__all__ = ["OneBitAdam", "OneBitLamb", "Lamb", "Lars", "ZeroOneAdam", "BaseOptimizer", "OneBitStage",
           "DecentLaM", "DmSGD", "FlatState", "OneBitOptions"]
