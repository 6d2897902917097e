"""What every transport shares: argument checks, bucketing and the mean of an allreduce."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ..common import completed_future

__all__ = ["REDUCE_OPS", "check_all_reduce", "buckets", "finish_all_reduce", "completed_future"]

REDUCE_OPS = ("sum", "mean", "max", "min")


def check_all_reduce(tensor: Tensor, op: str, bucket_bytes: Optional[int]) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"all_reduce: expected a tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("all_reduce: the tensor must be contiguous (it is reduced in place)")
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce: invalid op {op!r} (use one of {REDUCE_OPS})")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                     or bucket_bytes <= 0):
        raise ValueError(f"all_reduce: invalid bucket_bytes {bucket_bytes!r} (use None or a positive int)")


def buckets(flat: Tensor, bucket_bytes: Optional[int]) -> List[Tensor]:
    """`flat` cut into views of at most bucket_bytes each (one view when None)."""
    if bucket_bytes is None or flat.numel() == 0:
        return [flat]
    cap = max(1, bucket_bytes // flat.element_size())
    return [flat[s:s + cap] for s in range(0, flat.numel(), cap)]


def finish_all_reduce(tensor: Tensor, op: str, world_size: int, futures: List[torch.futures.Future],
                      async_op: bool):
    """Wait for (or chain onto) the bucket futures; divide by the world size for a mean."""

    def done(_=None) -> Tensor:
        for f in futures:
            f.value()  # raises the collective's error, if any
        if op == "mean":
            tensor.div_(world_size)
        return tensor

    if not async_op:
        for f in futures:
            f.wait()
        done()
        return None
    if len(futures) == 1:
        return futures[0].then(done)
    return torch.futures.collect_all(futures).then(done)
