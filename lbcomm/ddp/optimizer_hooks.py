"""DDP hooks for the 1-bit optimizers: torch's public default hooks during
the optimizer's warmup, no communication at all in its compression stage.

One implementation, `_optimizer_hook`, parameterized by the dtype on the wire of the
warmup allreduce: float32 (`onebit_optimizer_hook`, torch's ``allreduce_hook``), float16
(`onebit_optimizer_fp16_hook`, ``fp16_compress_hook``) and bfloat16
(`onebit_optimizer_bf16_hook`, ``bf16_compress_hook``); `onebit_optimizer_hook_for` picks
one by dtype.
"""
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..common import completed_future

__all__ = ["onebit_optimizer_hook", "onebit_optimizer_fp16_hook", "onebit_optimizer_bf16_hook",
           "onebit_optimizer_hook_for"]

# dtype on the wire during warmup -> torch's public hook that averages the bucket in it
_WARMUP = {
    torch.float32: default_hooks.allreduce_hook,
    torch.float16: default_hooks.fp16_compress_hook,
    torch.bfloat16: default_hooks.bf16_compress_hook,
}


def _check_optimizer(optimizer, hook: str) -> None:
    if not (hasattr(optimizer, "frozen") and hasattr(optimizer, "grads_averaged")
            and hasattr(optimizer, "process_group")):
        raise TypeError(f"{hook}: the hook state must be the lbcomm optimizer (OneBitAdam, OneBitLamb or Lamb), "
                        f"registered as ddp_model.register_comm_hook(optimizer, lbcomm.ddp.{hook}); got "
                        f"{type(optimizer).__name__}. For any other optimizer use OneBitHookState with onebit_hook.")


def _optimizer_hook(dtype: torch.dtype, optimizer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The hook of the 1-bit optimizers, with the warmup allreduce in `dtype`."""
    _check_optimizer(optimizer, _HOOKS[dtype].__name__)
    buf = bucket.buffer()
    if optimizer.frozen:
        return completed_future(buf, buf.device)
    optimizer.grads_averaged = True
    optimizer.note_local_grads(bucket.parameters(), bucket.gradients())  # before they are averaged
    return _WARMUP[dtype](optimizer.process_group, bucket)


def onebit_optimizer_hook(optimizer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook for `OneBitAdam`, `OneBitLamb` and `Lamb`.

    Warmup (until the optimizer freezes its variance): the bucket is averaged over the
    optimizer's ``process_group`` at full precision (torch's ``allreduce_hook``), and
    ``optimizer.grads_averaged`` is set so that `step` does not average the gradients a
    second time. Compression stage: no communication at all; the bucket keeps this rank's
    local gradients and the optimizer reduces its momentum with one compressed allreduce
    per step.

    The optimizer's ``process_group`` must be the DDP model's group. Do not wrap this hook
    in torch's ``fp16_compress_wrapper`` (it would round the local gradients of the
    compression stage); use `onebit_optimizer_fp16_hook` or `onebit_optimizer_bf16_hook`.

    Example::
        >>> # xdoctest: +SKIP
        >>> opt = lbcomm.OneBitAdam(ddp_model.parameters(), lr=1e-3, freeze_step=1000)
        >>> ddp_model.register_comm_hook(opt, lbcomm.ddp.onebit_optimizer_hook)
    """
    return _optimizer_hook(torch.float32, optimizer, bucket)


def onebit_optimizer_fp16_hook(optimizer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """`onebit_optimizer_hook` with the warmup allreduce in fp16 (torch's ``fp16_compress_hook``:
    half the warmup traffic; the averaged gradients are rounded to fp16). The compression
    stage is unchanged: no communication."""
    return _optimizer_hook(torch.float16, optimizer, bucket)


def onebit_optimizer_bf16_hook(optimizer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """`onebit_optimizer_hook` with the warmup allreduce in bfloat16 (torch's
    ``bf16_compress_hook``: half the warmup traffic, fp32's range; the averaged gradients
    are rounded to bfloat16). The compression stage is unchanged: no communication."""
    return _optimizer_hook(torch.bfloat16, optimizer, bucket)


def onebit_optimizer_hook_for(dtype: torch.dtype) -> Callable[..., torch.futures.Future[torch.Tensor]]:
    """The 1-bit optimizer hook whose warmup allreduce sends `dtype` (torch.float32,
    torch.float16 or torch.bfloat16).

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(opt, lbcomm.ddp.onebit_optimizer_hook_for(torch.bfloat16))
    """
    if dtype not in _HOOKS:
        raise ValueError(f"Invalid dtype for the warmup allreduce: {dtype!r} (use torch.float32, torch.float16 or "
                         "torch.bfloat16)")
    return _HOOKS[dtype]


_HOOKS = {torch.float32: onebit_optimizer_hook, torch.float16: onebit_optimizer_fp16_hook,
          torch.bfloat16: onebit_optimizer_bf16_hook}
