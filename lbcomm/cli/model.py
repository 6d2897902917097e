"""Alpha-beta cost model of the allreduce: latency + bytes / bandwidth + measured compute.

For p ranks, each on a link of B bits/s per direction, and a tensor of n fp32 elements::

    T_fp32(n, p)   = 2 (p-1) alpha_fp32   + 2 (p-1)/p * 4n / B_eff      + K_fp32(n, p)
    T_onebit(n, p) = 2 (p-1) alpha_onebit + bytes_per_call(n, p) / B_eff + K_onebit(n, p)

* 2 (p-1) alpha: a ring allreduce takes 2 (p-1) steps; the 1-bit one does an all-to-all
  and an all-gather, p-1 messages each. alpha is per method (gloo's ring allreduce and its
  all-to-all / all-gather have different fixed costs).
* B_eff = B * 1448/1514: the TCP payload of a full Ethernet frame (MTU 1500); tbf and real
  switches count whole frames.
* bytes_per_call: `CompressionState.bytes_per_call()`, the exact bytes a rank sends
  (sign bits, block scales, headers; see `lbcomm.wire`); 2 (p-1)/p * 4n for the fp32 ring.
* K: one rank's local compute for one call, measured on this machine with one thread per
  rank. K_onebit runs the real `compressed_allreduce` (the lbcomm.ops kernels, copies,
  checks, Python) on a loop-back transport that pretends p ranks sent this rank's data, so
  only the network is missing; K_fp32 is torch's copy, (p-1)/p of an add (the ring's
  reductions) and the division by p.
  For the measured points, K is timed in p processes at once (the p emulated ranks share
  this machine's cores and memory bandwidth); for the predictions, in one process (a real
  cluster: one rank per node).

The check: alpha (per method) is calibrated on the smallest measured size, where the
other terms are small; every other measured point is predicted and printed next to the
measurement. The predictions for larger clusters use ``--predict-alpha`` (default 50 us,
a typical TCP small-message latency between nodes; the latency of emulated network
namespaces on one machine is far higher and no guide to a real network).

Nothing here parses arguments or prints: the ``model`` and ``advise`` commands
(lbcomm/cli/commands.py) drive it, lbcomm/cli/advise.py builds step-time predictions on it.
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, Optional

import torch

from ..comm import LoopTransport
from ..common import ring_allreduce_bytes
from .allreduce import hier_intra_compute, ring_compute
from .procs import wait_all

__all__ = ["PAYLOAD_FRACTION", "onebit_compute_s", "fp32_compute_s", "fp16_compute_s", "powersgd_compute_s",
           "compute_times", "predict", "wire_bytes", "calibrate_alpha"]

PAYLOAD_FRACTION = 1448 / 1514  # TCP payload / Ethernet frame at MTU 1500


def _median_time(fn, reps: int = 5, min_time: float = 0.3, device: str = "cpu") -> float:
    def timed():
        fn()
        if device != "cpu":
            torch.cuda.synchronize()

    timed()
    times, start = [], time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_time and len(times) < 50):
        t0 = time.perf_counter()
        timed()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _state(n: int, p: int, block_size: Optional[int], device: str = "cpu"):
    from ..compressed import CompressionState

    # pieces=1: the model is of the unpipelined call (pipelining: lbcomm.compressed)
    return CompressionState(n, transport=LoopTransport(p), block_size=block_size, device=device, pieces=1)


def wire_bytes(method: str, n: int, p: int, block_size: Optional[int] = 2048) -> int:
    """Bytes one rank sends per allreduce of n fp32 elements."""
    if method == "fp32":
        return int(ring_allreduce_bytes(4 * n, p))
    if method == "fp16":
        return int(ring_allreduce_bytes(2 * n, p))
    return _state(n, p, block_size).bytes_per_call()


def onebit_compute_s(n: int, p: int, block_size: Optional[int] = 2048, device: str = "cpu") -> float:
    """Seconds of local compute of one compressed allreduce (no network)."""
    from ..compressed import compressed_allreduce

    state = _state(n, p, block_size, device)
    x = torch.randn(n, device=device)
    out = torch.empty(n, device=device)
    return _median_time(lambda: compressed_allreduce(x, state, out=out), device=device)


def _ring_compute_s(n: int, p: int, dtype: torch.dtype, device: str) -> float:
    """Seconds of local compute of one ring allreduce-to-mean in `dtype` (`allreduce.ring_compute`)."""
    run = ring_compute(torch.randn(n, device=device), p, dtype)
    return _median_time(run, device=device)


def fp32_compute_s(n: int, p: int, device: str = "cpu") -> float:
    """Seconds of local compute of one fp32 ring allreduce-to-mean: copy in, (p-1)/p adds, divide."""
    return _ring_compute_s(n, p, torch.float32, device)


def fp16_compute_s(n: int, p: int, device: str = "cpu") -> float:
    """The same in fp16: cast in, (p-1)/p half adds, cast back and divide."""
    return _ring_compute_s(n, p, torch.float16, device)


def hier_intra_compute_s(n: int, g: int, device: str = "cpu") -> float:
    """Seconds of local compute of the hierarchical call's stages inside a node of g ranks
    (`allreduce.hier_intra_compute`: finiteness check, copies, the slice's fp32 mean)."""
    return _median_time(hier_intra_compute(torch.randn(n, device=device), g), device=device)


def _compute_s(method: str, n: int, p: int, block_size: Optional[int], device: str = "cpu") -> float:
    if method == "hier_intra":  # p: ranks per node
        return hier_intra_compute_s(n, p, device)
    if method == "onebit":
        return onebit_compute_s(n, p, block_size, device)
    if method == "fp16":
        return fp16_compute_s(n, p, device)
    return fp32_compute_s(n, p, device)


def _compute_worker(items, block_size, barrier, queue) -> None:
    torch.set_num_threads(1)
    out = {}
    for method, n, p in items:
        barrier.wait()  # every process times the same item at the same time
        out[(method, n, p)] = _compute_s(method, n, p, block_size)
    queue.put(out)


class _Exit:
    """A multiprocessing.Process seen through Popen's poll()."""

    def __init__(self, proc):
        self.proc = proc

    def poll(self):
        return self.proc.exitcode


def compute_times(items, block_size: Optional[int], processes: int = 1, device: str = "cpu") -> Dict:
    """(method, n, p) -> seconds of local compute per call, timed in `processes` processes at
    once (the slowest process counts), with one thread each."""
    items = list(dict.fromkeys(items))
    if processes <= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return {(m, n, p): _compute_s(m, n, p, block_size, device) for m, n, p in items}
        finally:
            torch.set_num_threads(threads)
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_compute_worker, args=(items, block_size, barrier, queue), daemon=True)
             for _ in range(processes)]
    for pr in procs:
        pr.start()
    try:
        # The results are a few numbers each: they fit in the queue's pipe, so a worker
        # exits as soon as it has put them.
        waited = wait_all([_Exit(pr) for pr in procs], timeout=900, interval=0.2)
        if not waited.ok:
            raise RuntimeError(f"timing processes failed (exit codes {waited.codes}); see their traceback above")
        results = [queue.get(timeout=60) for _ in procs]
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.kill()
            pr.join()
    return {k: max(r[k] for r in results) for k in items}


def predict(method: str, n: int, p: int, bandwidth_bps: float, alpha_s: float, compute_s: float,
            block_size: Optional[int] = 2048) -> float:
    """Predicted seconds of one allreduce (see the module docstring)."""
    beff = bandwidth_bps / 8 * PAYLOAD_FRACTION
    return 2 * (p - 1) * alpha_s + wire_bytes(method, n, p, block_size) / beff + compute_s


def calibrate_alpha(method: str, n: int, p: int, bandwidth_bps: float, measured_s: float, compute_s: float,
                    block_size: Optional[int] = 2048) -> float:
    """The latency per message that makes `predict` reproduce a measured time (never negative)."""
    rest = predict(method, n, p, bandwidth_bps, 0.0, compute_s, block_size=block_size)
    return max(0.0, (measured_s - rest) / (2 * (p - 1)))


def powersgd_compute_s(width: int, rank: int, device: str = "cpu") -> float:
    """Seconds of local compute of PowerSGD on one width x width matrix: error feedback,
    P = M Q, orthogonalize P, Q = M^T P, the approximation P Q^T and the new error."""
    m = torch.randn(width, width, device=device)
    q = torch.randn(width, rank, device=device)
    err = torch.zeros(width, width, device=device)

    def run():
        g = m + err
        p, _ = torch.linalg.qr(g @ q)
        q.copy_(g.t() @ p)
        torch.sub(g, p @ q.t(), out=err)

    return _median_time(run, device=device)
