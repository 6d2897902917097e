"""Learning rates for large batches (docs/large-batch.md): the scaled learning rate (`scaled_lr`,
linear and square-root rules) and LEGW, linear-epoch gradual warmup (You et al., "Large
batch training for LSTM and beyond", 2019), as a torch lr_scheduler (`LEGW`).

Scaling a recipe tuned at batch B0 to batch B = k B0:

* the peak learning rate becomes ``scaled_lr(lr0, B0, B, rule)``: k lr0 ("linear", Goyal
  et al. 2017) or sqrt(k) lr0 ("sqrt", the rule LEGW pairs with);
* LEGW makes the warmup k times longer in EPOCHS. An epoch at batch k B0 has k times fewer
  steps, so in optimizer steps the warmup stays as long as the base recipe's, in the base
  recipe's own steps.

Example (base recipe: batch 256, lr 0.1, warmup 500 steps; run: batch 8192, k = 32)::

    lr = lbcomm.schedules.scaled_lr(0.1, base_batch=256, batch=8192, rule="sqrt")  # 0.566
    opt = lbcomm.Lars(model.parameters(), lr=lr)
    # 500 steps of batch 256 = 500 * 256 / 8192 = 15.6 steps of batch 8192 (the same epochs)
    sched = lbcomm.schedules.LEGW(opt, base_warmup_steps=500 * 256 / 8192, batch_scale=32,
                                  total_steps=20000, decay="cosine")   # warmup_steps = 500
"""
from __future__ import annotations

import math
from typing import List, Optional

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["scaled_lr", "LEGW", "RULES", "DECAYS"]

RULES = ("linear", "sqrt")
DECAYS = (None, "cosine", "poly")


def _scale(factor: float, rule: str) -> float:
    if rule == "linear":
        return factor
    if rule == "sqrt":
        return math.sqrt(factor)
    raise ValueError(f"Invalid rule: {rule!r} (use 'linear' or 'sqrt')")


def scaled_lr(base_lr: float, base_batch: int, batch: int, rule: str = "linear") -> float:
    """The learning rate for `batch` from one tuned at `base_batch`.

    Args:
        base_lr (float): the learning rate tuned at `base_batch` (>= 0).
        base_batch (int): the batch size it was tuned at (> 0).
        batch (int): the batch size of this run, over all ranks (> 0).
        rule (str, optional): "linear": base_lr * batch / base_batch (Goyal et al. 2017);
            "sqrt": base_lr * sqrt(batch / base_batch) (keeps the variance of the step;
            the rule LEGW is paired with) (default: "linear").

    Returns:
        The scaled learning rate (a float).
    """
    if not base_lr >= 0:
        raise ValueError(f"Invalid base_lr: {base_lr} (must be >= 0)")
    if not base_batch > 0 or not batch > 0:
        raise ValueError(f"Invalid batch sizes: base_batch={base_batch}, batch={batch} (both must be > 0)")
    return float(base_lr) * _scale(batch / base_batch, rule)


class LEGW(LRScheduler):
    r"""Linear-epoch gradual warmup (LEGW) to the optimizer's learning rate, then an
    optional decay.

    The peak is each param group's lr when the scheduler is created: scale it for the
    batch beforehand with `scaled_lr` (LEGW itself does not change the peak). The
    optimizer's k-th step (k = 1, 2, ...; ``scheduler.step()`` after each
    ``optimizer.step()``) uses

    .. math::
        \mathrm{lr}_k = \mathrm{peak} \cdot \begin{cases}
            k / W & k \le W \text{ (linear warmup, the first step already moves)} \\
            1 & k > W, \text{ no decay} \\
            \tfrac12 (1 + \cos \pi q) & k > W, \text{ decay="cosine"} \\
            (1 - q)^{\text{power}} & k > W, \text{ decay="poly"}
        \end{cases}
        \qquad q = \min\Big(1, \frac{k - W}{T - W + 1}\Big)

    with T = total_steps (the lr reaches 0 only after step T) and the warmup length
    W = ceil(base_warmup_steps * batch_scale) for rule="linear" (LEGW: the warmup's
    epochs grow linearly with the batch scale), ceil(base_warmup_steps * sqrt(batch_scale))
    for rule="sqrt".

    Units: `base_warmup_steps` is the base recipe's warmup expressed in optimizer steps of
    THIS run's batch, i.e. its warmup epochs times the steps per epoch at this batch
    (base warmup steps * base_batch / batch). With rule="linear" W is then the base
    recipe's warmup in its own (base-batch) steps: k times the epochs at k times the batch.

    The schedule is a closed form of the step count, so ``state_dict()`` /
    ``load_state_dict()`` (torch's LRScheduler ones) resume it exactly.

    Args:
        optimizer (Optimizer): the wrapped optimizer (e.g. `lbcomm.Lars`).
        base_warmup_steps (float): the base recipe's warmup, in steps of this run's batch (>= 0).
        batch_scale (float): k = batch / base_batch (> 0).
        total_steps (int, optional): T, the last step of the decay; required with a decay
            (default: None).
        rule (str, optional): how the warmup grows with k: "linear" (LEGW) or "sqrt"
            (default: "linear").
        decay (str, optional): None (constant after warmup), "cosine" or "poly" (default: None).
        power (float, optional): exponent of the "poly" decay (default: 2.0).
        last_epoch (int, optional): as in torch's schedulers (default: -1).

    Attributes:
        warmup_steps (int): W.
    """

    def __init__(self, optimizer: Optimizer, base_warmup_steps: float, batch_scale: float,
                 total_steps: Optional[int] = None, rule: str = "linear", decay: Optional[str] = None, *,
                 power: float = 2.0, last_epoch: int = -1) -> None:
        if not base_warmup_steps >= 0:
            raise ValueError(f"Invalid base_warmup_steps: {base_warmup_steps} (must be >= 0)")
        if not batch_scale > 0:
            raise ValueError(f"Invalid batch_scale: {batch_scale} (must be > 0: the run's batch / the base batch)")
        if decay not in DECAYS:
            raise ValueError(f"Invalid decay: {decay!r} (use one of {DECAYS})")
        if not power > 0:
            raise ValueError(f"Invalid power: {power} (must be > 0)")
        warmup = int(math.ceil(base_warmup_steps * _scale(batch_scale, rule) - 1e-9))
        if total_steps is not None:
            if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < warmup:
                raise ValueError(f"Invalid total_steps: {total_steps!r} (must be an int >= the warmup's {warmup} "
                                 "steps)")
        elif decay is not None:
            raise ValueError(f"LEGW: decay={decay!r} needs total_steps (the step at which the decay ends)")
        self.base_warmup_steps = base_warmup_steps
        self.batch_scale = batch_scale
        self.rule = rule
        self.decay = decay
        self.power = power
        self.total_steps = total_steps
        self.warmup_steps = warmup
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """The multiplier of the peak lr used by the optimizer's `step`-th step (1-based)."""
        W = self.warmup_steps
        if step <= W:
            return step / W
        if self.decay is None:
            return 1.0
        q = min(1.0, (step - W) / (self.total_steps - W + 1))
        if self.decay == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * q))
        return (1.0 - q) ** self.power

    def get_lr(self) -> List[float]:
        # last_epoch = how many times step() ran = the number of optimizer steps done, so
        # the lr set now is that of optimizer step last_epoch + 1.
        f = self.factor(self.last_epoch + 1)
        return [base * f for base in self.base_lrs]

    def _get_closed_form_lr(self) -> List[float]:
        return self.get_lr()
