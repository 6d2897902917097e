"""`onebit_hook`: 1-bit error-feedback compressed allreduce of every DDP bucket, for any
optimizer, with its `OneBitHookState` (`lbcomm.ddp.state`). Which error feedback reduces
which bucket is in `lbcomm.ddp.units`, the thread that runs the compressed calls in
`lbcomm.ddp.worker`.
"""
import functools
import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ..common import FLOAT_DTYPES, completed_future, report_exact_share, ring_allreduce_bytes
from ..exact import ExactMean
from ..reducer import make_reducer
from .normalize import Transform
from .state import OneBitHookState
from .units import Plan, Unit
from .worker import reduce_planned

__all__ = ["onebit_hook"]

_log = logging.getLogger(__name__)


def _new_reducer(state: OneBitHookState, numel: int, device: torch.device):
    """The error feedback of a new unit: the one place that builds the hook's reducers, on
    the worker's private group (or the private topology)."""
    if state.hier_topology is not None:
        return make_reducer(numel, state.comm, device=device, topology=state.hier_topology)
    return make_reducer(numel, state.comm, device=device, transport=state.worker.transport)


def _exact_mean(state: OneBitHookState) -> ExactMean:
    """How the state's units average their exact parameters (as their reducers reduce)."""
    if state.hier_topology is not None:
        return ExactMean(topology=state.hier_topology)
    return ExactMean(transport=state.worker.transport)


def _configure(state: OneBitHookState, unit: Unit, device: torch.device) -> None:
    """Apply the state's settings to `unit`: the exact parameters, whether its reducer takes
    the weights fused, and the Transform of the momentum / adaptive settings (started from
    the full-precision start's statistics, or restored), or none."""
    unit.fused = state.hier_topology is None
    if unit.exact_mean is None:
        unit.exact_mean = _exact_mean(state)
    unit.set_exact(state.comm.exact_numel, unit.exact_mean, device)
    adaptive = state.normalize == "adaptive"
    if state.momentum is None and not adaptive:
        unit.transform = None
        return
    tr = unit.transform
    transport = state.worker.transport
    if tr is None:
        stats, mom = state.grad_stats.start(unit.key, unit.shapes)
        tr = unit.transform = Transform(state.momentum, adaptive, state.normalize_beta, state.normalize_floor,
                                        transport, local=mom, ema=stats if adaptive else None)
    else:  # restored from a checkpoint: this run's settings
        tr.momentum, tr.adaptive, tr.beta, tr.floor, tr.transport = (state.momentum, adaptive, state.normalize_beta,
                                                                     state.normalize_floor, transport)
        if tr.momentum is None:
            tr.local = tr.decoded = None
        if not adaptive:
            tr.ema = None


def _reduce_bucket(state: OneBitHookState, plan: Plan, report_iter: Optional[int], buf: Tensor) -> None:
    """The compressed allreduce of one bucket, in place, on the worker thread; counts it in
    the statistics and logs them when `report_iter` is given."""
    skipped = reduce_planned(state, plan, buf)
    if skipped:
        state.skipped_calls += 1
        buf.fill_(float("nan"))  # what a plain allreduce of NaN/Inf gives, on every rank
        _log.warning("onebit_hook: a bucket held NaN or Inf on some rank at iteration %s; it is NaN on every "
                     "rank and the error feedback is unchanged", state.iter)
    if report_iter is not None:
        stats = state.compression_stats()
        _log.info("onebit_hook stats: iter %s, %s bytes sent, %s uncompressed (ratio %.2f), %s compressed calls "
                  "(%s skipped), error norm %.6g", report_iter, stats["bytes_sent"], stats["bytes_uncompressed"],
                  stats["compression_ratio"], stats["compressed_calls"], stats["skipped_calls"],
                  stats["error_norm"])


def onebit_hook(state: OneBitHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: 1-bit error-feedback compressed allreduce of every bucket.

    Before ``state.start_iter`` the bucket is averaged at full precision (torch's
    ``allreduce_hook``); from then on it is reduced by its compressed reducer on a
    background thread (in bucket order) and decoded in place into ``bucket.buffer()``; the
    returned future completes then. The result, about the mean of the ranks' gradients, is
    bitwise identical on every rank. See `OneBitHookState`.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = lbcomm.OneBitHookState(start_iter=100)
        >>> ddp_model.register_comm_hook(state, lbcomm.onebit_hook)
    """
    if not isinstance(state, OneBitHookState):
        raise TypeError(f"onebit_hook: the hook state must be a OneBitHookState, got {type(state).__name__}")
    buf = bucket.buffer()
    if buf.dtype not in FLOAT_DTYPES:
        raise TypeError(f"onebit_hook: buckets of {buf.dtype} cannot be compressed (float32, float16 or bfloat16); "
                        "use torch's allreduce_hook for this model")
    key, params = state.planner.number(bucket)  # numbered in DDP's first iteration
    state.resume.check("onebit_hook", "OneBitHookState", fresh=state.iter == 0)
    worker = state.bucket_worker()
    if worker.world_size == 1:
        state.maybe_increase_iter(bucket)
        return completed_future(buf, buf.device)
    if state.iter < state.start_iter:
        nbytes = int(ring_allreduce_bytes(buf.numel() * buf.element_size(), worker.world_size))
        state.total_bytes_sent += nbytes
        state.total_bytes_uncompressed += nbytes
        fut = allreduce_hook(state.process_group, bucket)
        if state.normalize is not None or state.momentum is not None:
            # statistics per parameter: DDP's initial and rebuilt buckets alike
            stats, numels, mu = state.grad_stats, [p.numel() for p in params], state.momentum
            fut = fut.then(lambda f: (stats.add(key, numels, f.value(), mu), f.value())[1])
        state.maybe_increase_iter(bucket)
        return fut
    new_weights = None
    if state.normalize == "warmup":
        new_weights = functools.partial(state.grad_stats.weights, floor=state.normalize_floor)
    plan = state.planner.plan(bucket, key, params, functools.partial(_new_reducer, state),
                              *([new_weights] if new_weights else []))
    for unit, _ in plan:
        _configure(state, unit, buf.device)
    fut = worker.submit(buf, functools.partial(_reduce_bucket, state, plan, state.stats_report_due(bucket)))
    if state.first_compressed(bucket):
        _report_exact(state)
    state.maybe_increase_iter(bucket)
    return fut


def _report_exact(state: OneBitHookState) -> None:
    """Say how much of the model `exact_numel` leaves uncompressed."""
    units = state.planner.units()
    report_exact_share(_log, "onebit_hook", "gradient", sum(u.exact_numel() for u in units),
                       sum(u.compression.numel for u in units), state.comm.exact_numel)
