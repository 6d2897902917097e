"""`local_gradients_hook`: a DDP communication hook that communicates nothing, so that
every rank keeps its own gradient. It is what local updates (`lbcomm.OneBitLocalUpdates`,
DiLoCo-style) need when a framework wraps the model in `DistributedDataParallel`: the
inner steps must see this rank's gradients, and the ranks meet only at the
synchronizations of the local updates every H steps.
"""
import torch
import torch.distributed as dist

from ..common import completed_future

__all__ = ["local_gradients_hook"]


def local_gradients_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: no communication, the bucket keeps this rank's gradients.

    Returns a completed future holding ``bucket.buffer()`` unchanged: DDP writes it back
    into the parameters' ``.grad``, so after ``backward()`` every rank holds the gradient
    of its own micro-batch, as the plain (unwrapped) module would (DDP divides by the
    world size only in its own allreduce, which a registered hook replaces). `state` is
    not read; `lbcomm.attach` registers the `OneBitLocalUpdates` there, which names
    what the hook serves.

    DDP itself still broadcasts rank 0's buffers (e.g. BatchNorm's running statistics)
    at every forward unless it was built with ``broadcast_buffers=False``.

    Example::
        >>> # xdoctest: +SKIP
        >>> local = lbcomm.OneBitLocalUpdates(model.parameters(), inner, sync_every=32)
        >>> ddp_model.register_comm_hook(local, lbcomm.ddp.local_gradients_hook)  # or lbcomm.attach(ddp_model, local)
    """
    buf = bucket.buffer()
    return completed_future(buf, buf.device)
