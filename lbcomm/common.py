"""Small definitions shared by the algorithm, the optimizers, the hooks and the bench."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["FLOAT_DTYPES", "NONFINITE_POLICIES", "completed_future", "new_future", "ring_allreduce_bytes"]

# Tensors the compressed allreduce takes: fp16/bf16 are upcast into the fp32 error domain.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# What a call does when an input holds NaN/Inf (DESIGN.md §1, "Non-finite input").
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
