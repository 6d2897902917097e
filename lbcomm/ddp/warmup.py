"""`warmup_average_hook`: the DDP hook of the 1-bit optimizers. During the optimizer's
warmup it averages the gradients in a chosen dtype through torch's public default hooks;
once the optimizer has frozen its variance it communicates nothing (the optimizer
compresses its momentum itself).

It talks to the optimizer through its public contract only: ``optimizer.frozen``,
``optimizer.grads_averaged = True`` (this step's gradients arrive averaged, so the
optimizer does not average them again) and ``optimizer.note_local_grads(params, grads)``
(the local gradients before they are averaged: OneBitAdam's rescale_variance needs their
squared norms).
"""
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..common import completed_future
from ..config import from_comm

__all__ = ["WarmupAverage", "warmup_average_hook"]

# dtype on the wire during warmup -> torch's public hook that averages the bucket in it
_AVERAGE = {
    torch.float32: default_hooks.allreduce_hook,
    torch.float16: default_hooks.fp16_compress_hook,
    torch.bfloat16: default_hooks.bf16_compress_hook,
}


class WarmupAverage:
    """State of `warmup_average_hook`.

    Args:
        optimizer: the 1-bit optimizer (`OneBitAdam`, `OneBitLamb`, `ZeroOneAdam`) or
            `Lamb` that steps the DDP model's parameters.
        dtype (torch.dtype, optional): what the warmup's allreduce sends: torch.float32,
            torch.float16 or torch.bfloat16 (half the warmup traffic; the averaged
            gradients are rounded to it) (default: torch.float32).
        process_group (ProcessGroup, optional): the DDP model's process group, which must
            be the optimizer's (default: None, the world).
        comm (CommConfig, optional): the same as a CommConfig: its ``process_group``
            (pass the optimizer's ``comm``; then not `process_group` beside it)
            (default: None).

    Do not wrap the hook in torch's ``fp16_compress_wrapper``: it would round the local
    gradients of the compression stage; pass ``dtype`` instead.
    """

    __slots__ = ("optimizer", "dtype", "process_group")

    def __init__(self, optimizer, dtype: torch.dtype = torch.float32, *, process_group=None, comm=None):
        process_group = from_comm(comm, "WarmupAverage", process_group=(process_group, None))["process_group"]
        if not all(hasattr(optimizer, name) for name in ("frozen", "grads_averaged", "note_local_grads")):
            raise TypeError(f"WarmupAverage: expected a lbcomm 1-bit optimizer (OneBitAdam, OneBitLamb, ZeroOneAdam) "
                            f"or Lamb, got {type(optimizer).__name__}. For any other optimizer use "
                            "lbcomm.OneBitHookState with lbcomm.onebit_hook.")
        if dtype not in _AVERAGE:
            raise ValueError(f"WarmupAverage: invalid dtype for the warmup allreduce: {dtype!r} (use torch.float32, "
                             "torch.float16 or torch.bfloat16)")
        self.optimizer, self.dtype, self.process_group = optimizer, dtype, process_group

    def __repr__(self) -> str:
        return f"WarmupAverage({type(self.optimizer).__name__}, dtype={self.dtype})"


def warmup_average_hook(state: WarmupAverage, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook for the 1-bit optimizers (and `Lamb`), with a `WarmupAverage`.

    Warmup (until the optimizer freezes its variance): the optimizer is handed the local
    gradients (``note_local_grads``), then the bucket is averaged over the process group in
    ``state.dtype`` by torch's public default hook, and ``optimizer.grads_averaged`` is set
    so that its step does not average them a second time. Compression stage: no
    communication at all; the bucket keeps this rank's local gradients and the optimizer
    reduces its momentum with one compressed allreduce per step.

    Example::
        >>> # xdoctest: +SKIP
        >>> opt = lbcomm.OneBitAdam(ddp_model.parameters(), lr=1e-3, freeze_step=1000)
        >>> ddp_model.register_comm_hook(lbcomm.ddp.WarmupAverage(opt), lbcomm.ddp.warmup_average_hook)
    """
    if not isinstance(state, WarmupAverage):
        raise TypeError(f"warmup_average_hook: the hook state must be a lbcomm.ddp.WarmupAverage, got "
                        f"{type(state).__name__}; register it as ddp_model.register_comm_hook("
                        "lbcomm.ddp.WarmupAverage(optimizer), lbcomm.ddp.warmup_average_hook)")
    buf = bucket.buffer()
    opt = state.optimizer
    if opt.frozen:
        return completed_future(buf, buf.device)
    opt.grads_averaged = True
    opt.note_local_grads(bucket.parameters(), bucket.gradients())
    return _AVERAGE[state.dtype](state.process_group, bucket)
