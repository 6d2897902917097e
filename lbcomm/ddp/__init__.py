"""DDP communication hooks (docs/hooks.md), torch's contract: ``hook(state, bucket) -> Future[Tensor]``.

* `warmup_average_hook` with a `WarmupAverage` (`warmup.py`): for the 1-bit optimizers.
  During the optimizer's warmup the bucket is averaged in the chosen dtype by torch's
  public default hooks and the optimizer is told that its gradients arrive averaged; once
  the optimizer has frozen its variance the hook communicates nothing and the gradients
  stay local (the optimizer compresses its momentum instead).
* `onebit_hook` with a `OneBitHookState` (`onebit.py`, `state.py`): 1-bit error-feedback
  compressed allreduce of every bucket, for any optimizer; which error feedback reduces
  which bucket is in `units.py`, the thread that runs the compressed calls in `worker.py`.
* `dct_hook` with a `DCTHookState` (`dct.py`): DCT, the thresholded sparse exchange of
  every bucket with residuals (docs/dct.md), on the same units and thread.
* `local_gradients_hook` (`local_gradients.py`): no communication at all, every rank keeps
  its own gradient; for local updates (`lbcomm.OneBitLocalUpdates`) under a DDP wrapper.

`onebit_hook` together with a 1-bit optimizer would compress the same gradients twice:
the optimizer's averaged-gradients probe raises `lbcomm.errors.AveragedGradientsError`
(naming onebit_hook), and `lbcomm.attach` refuses the pair.

Example::

    >>> # xdoctest: +SKIP
    >>> model = DDP(model)
    >>> opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=1000)
    >>> model.register_comm_hook(lbcomm.ddp.WarmupAverage(opt), lbcomm.ddp.warmup_average_hook)
    >>> # or, for SGD, AdamW, ...:
    >>> state = lbcomm.OneBitHookState(start_iter=100)
    >>> model.register_comm_hook(state, lbcomm.onebit_hook)
"""
from .dct import DCTHookState, dct_hook
from .local_gradients import local_gradients_hook
from .onebit import onebit_hook
from .resume import MissingHookStateWarning
from .state import OneBitHookState
from .warmup import WarmupAverage, warmup_average_hook

__all__ = ["WarmupAverage", "warmup_average_hook", "OneBitHookState", "onebit_hook", "MissingHookStateWarning",
           "DCTHookState", "dct_hook", "local_gradients_hook"]
