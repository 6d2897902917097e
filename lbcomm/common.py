"""Small definitions shared by the algorithm, the optimizers, the hooks and the bench."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["FLOAT_DTYPES", "NONFINITE_POLICIES", "completed_future", "new_future", "ring_allreduce_bytes"]

# Tensors the compressed allreduce takes: fp16/bf16 are upcast into the fp32 error domain.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# What a call does when an input holds NaN/Inf: raise on every rank, or skip the call
# (see `lbcomm.compressed.CompressionState` and docs/concepts.md).
NONFINITE_POLICIES = ("raise", "skip")


def new_future(device: Optional[torch.device] = None) -> torch.futures.Future:
    """A Future for results on `device`; for CUDA it records the producing stream, so
    waiters on other streams synchronize with it (torch's collectives do the same)."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.futures.Future(devices=[torch.device(device)])
    return torch.futures.Future()


def completed_future(value, device: Optional[torch.device] = None) -> torch.futures.Future:
    """A Future that already holds `value`."""
    fut = new_future(device)
    fut.set_result(value)
    return fut


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring allreduce of an `nbytes` buffer: 2 (p-1)/p nbytes."""
    return 2 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def report_exact_share(log, who: str, what: str, exact: int, total: int, limit: int) -> None:
    """Log how many of `total` elements exact_numel=`limit` averages exactly instead of
    compressing: INFO, or a WARNING when that is most of the model (a small model may then
    not be compressed at all)."""
    if not exact:
        return
    share = exact / max(total, 1)
    msg = ("%s: %s of %s %s elements (%.1f %%) belong to parameters of at most exact_numel=%s elements and are "
           "averaged exactly in fp32, not compressed")
    args = (who, exact, total, what, 100 * share, limit)
    if share > 0.5:
        log.warning(msg + "; that is most of this model: pass exact_numel=0 (or a smaller value) to compress them",
                    *args)
    else:
        log.info(msg, *args)
