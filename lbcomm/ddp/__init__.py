"""DDP communication hooks (docs/hooks.md), torch's contract: ``hook(state, bucket) -> Future[Tensor]``.

* `onebit_optimizer_hook` (and its fp16/bf16 variants, `onebit_optimizer_hook_for(dtype)`;
  `optimizer_hooks.py`): registered with a OneBit optimizer as its state. During the
  optimizer's warmup the bucket is averaged by torch's public default hooks and the
  optimizer is told that its gradients arrive averaged, so it does not reduce them again;
  once the optimizer has frozen its variance the hook communicates nothing at all and the
  gradients stay local (the optimizer compresses its momentum instead).
* `onebit_hook` with a `OneBitHookState` (`onebit.py`): 1-bit error-feedback compressed
  allreduce of every bucket, for any optimizer; which error feedback reduces which bucket
  and the thread that runs the compressed calls are in `buckets.py`.
* `claims.py`: one compressor per gradient; `onebit_hook` together with a 1-bit optimizer
  on the same parameters raises `DoubleCompressionError`; a 1-bit optimizer whose
  gradients arrive averaged by a DDP without lbcomm's hook raises `AveragedGradientsError`.

Example::

    >>> # xdoctest: +SKIP
    >>> model = DDP(model)
    >>> opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=1000)
    >>> model.register_comm_hook(opt, lbcomm.ddp.onebit_optimizer_hook)
    >>> # or, for SGD, AdamW, ...:
    >>> state = lbcomm.ddp.OneBitHookState(process_group=None, start_iter=100)
    >>> model.register_comm_hook(state, lbcomm.ddp.onebit_hook)
"""
from .claims import AveragedGradientsError, DoubleCompressionError
from .onebit import OneBitHookState, onebit_hook
from .optimizer_hooks import (onebit_optimizer_bf16_hook, onebit_optimizer_fp16_hook, onebit_optimizer_hook,
                              onebit_optimizer_hook_for)

__all__ = ["onebit_optimizer_hook", "onebit_optimizer_fp16_hook", "onebit_optimizer_bf16_hook",
           "onebit_optimizer_hook_for", "OneBitHookState", "onebit_hook", "DoubleCompressionError",
           "AveragedGradientsError"]
