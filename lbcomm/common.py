"""Small definitions shared by the reduction engine (`lbcomm.reduce`), the optimizers, the
hooks and the bench: float dtypes and non-finite policies, futures and `drive` (the runner
of every call's schedule), byte counts and the compressor statistics."""
from __future__ import annotations

from typing import Any, Dict, Generator, Optional

import torch
from .errors import NonFiniteError

__all__ = ["STATS_KEYS", "compressor_stats", "error_ratio", "FLOAT_DTYPES", "NONFINITE_POLICIES", "NonFiniteError",
           "completed_future", "new_future", "drive", "ring_allreduce_bytes"]

# Tensors the compressed allreduce takes: fp16/bf16 are upcast into the fp32 error domain.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# What a call does when an input holds NaN/Inf: raise on every rank, or skip the call
# (see `lbcomm.reduce.compression.CompressionState` and docs/concepts.md).
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


def drive(steps: Generator[torch.futures.Future, None, Any], device: Optional[torch.device], async_op: bool):
    """Run a call's schedule, a generator that yields every future the call must wait for
    and returns the call's result: blocking (wait on each future in turn), or from the
    futures' callbacks (returns a Future of the result, the calling thread never waits).
    Either way the collectives start in the same order. Errors before the first
    collective raise here; later ones fail the returned future."""
    if not async_op:
        try:
            fut = next(steps)
            while True:
                fut.wait()
                fut = steps.send(None)
        except StopIteration as done:
            return done.value
        finally:
            steps.close()  # a failed wait: leave the schedule (its finally blocks release the state)
    result = new_future(device)
    try:
        first = next(steps)
    except StopIteration as done:
        result.set_result(done.value)
        return result

    def advance(_=None) -> None:
        try:
            fut = next(steps)
        except StopIteration as done:
            result.set_result(done.value)
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
            steps.close()
            result.set_exception(exc)
            return
        fut.add_done_callback(advance)

    first.add_done_callback(advance)
    return result


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
        log.warning(msg + "; that is most of this model: pass comm=lbcomm.CommConfig(exact_numel=0) (or a smaller "
                    "value) to compress them", *args)
    else:
        log.info(msg, *args)


#: The keys of every lbcomm compressor's ``compression_stats()`` (reducers, hook states,
#: optimizers): calls that compressed, calls skipped for NaN/Inf, the bytes this rank sent,
#: the norm of its error feedback, and that norm over the norm of what it last sent
#: (`error_ratio`, so that the error has a scale).
STATS_KEYS = ("compressed_calls", "skipped_calls", "bytes_sent", "error_norm", "error_ratio")


def error_ratio(error_norm: float, sent_norm: float) -> float:
    """``error_norm`` relative to the norm of what was last sent (0.0 when nothing was sent
    yet). The error of one 1-bit compression with RMS block scales is at most sqrt(2) times
    its input, so a ratio at or above about 1 means the error feedback carries as much as
    the wire does (most of the signal waits in the errors)."""
    return error_norm / sent_norm if sent_norm > 0 else 0.0


def compressor_stats(reducer, checked: bool = False) -> Dict[str, Any]:
    """The `STATS_KEYS` of one reducer as plain numbers (all zero for None, a reducer not
    made yet): ``bytes_sent`` counts its compressed calls at `bytes_per_call` (a skipped
    call sends only the small finiteness agreement; `checked`: the caller agrees on
    finiteness itself and its calls send no agreement, see `bytes_per_call`);
    ``error_ratio`` is ``error_norm`` over the reducer's ``last_sent_norm`` (see `error_ratio`)."""
    if reducer is None:
        return {"compressed_calls": 0, "skipped_calls": 0, "bytes_sent": 0, "error_norm": 0.0, "error_ratio": 0.0}
    done = reducer.calls - reducer.skipped
    err = float(reducer.worker_error.double().square().sum() + reducer.server_error.double().square().sum()) ** 0.5
    return {"compressed_calls": done, "skipped_calls": reducer.skipped,
            "bytes_sent": done * reducer.bytes_per_call(checked), "error_norm": err,
            "error_ratio": error_ratio(err, reducer.last_sent_norm)}
