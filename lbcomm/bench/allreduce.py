"""Allreduce timing on every rank: fp32, fp16 and 1-bit compressed, side by side.

`measure(sizes, methods, iters, warmup, block_size)` runs inside an initialized process
group and returns one row per (size, method) with the median, p10 and p90 of the
per-iteration time of the slowest rank. Every method produces the MEAN over ranks, so
fp32 and fp16 include their division by p and their casts.

The collectives come from a `comm` object: `TorchComm` (a torch.distributed group, the
default) or `MPIComm` (an mpi4py communicator: fp32/fp16 through MPI_Allreduce, onebit
through lbcomm's MPI transport).
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..compressed import DEFAULT_BLOCK_SIZE, CompressionState, compressed_allreduce

METHODS = ("fp32", "fp16", "onebit")


def _quantiles(v: Sequence[float]):
    s = sorted(v)
    q = lambda f: s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]  # noqa: E731
    return statistics.median(s), q(0.1), q(0.9)


class TorchComm:
    """The collectives `measure` needs, on a torch.distributed group (None: the world)."""

    def __init__(self, group=None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def sum_(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)

    def max_(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def compression_state(self, numel: int, device, block_size: Optional[int], pieces=None) -> CompressionState:
        return CompressionState(numel, group=self.group, device=device, block_size=block_size, backend="torch",
                                pieces=pieces)


class MPIComm:
    """The same over an mpi4py communicator (None: COMM_WORLD), for CPU tensors."""

    def __init__(self, comm=None):
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        world = comm if comm is not None else MPI.COMM_WORLD
        self._world = world
        self.world_size = world.Get_size()
        self.rank = world.Get_rank()

    def barrier(self) -> None:
        self._world.Barrier()

    def _allreduce(self, t: torch.Tensor, op) -> None:
        if t.device.type != "cpu":
            raise ValueError(f"MPIComm: the benchmark's MPI path takes CPU tensors, got {t.device}")
        self._world.Allreduce(self._mpi.IN_PLACE, t.numpy(), op=op)

    def sum_(self, t: torch.Tensor) -> None:
        self._allreduce(t, self._mpi.SUM)

    def max_(self, t: torch.Tensor) -> None:
        self._allreduce(t, self._mpi.MAX)

    def compression_state(self, numel: int, device, block_size: Optional[int], pieces=None) -> CompressionState:
        return CompressionState(numel, group=self.comm, device=device, block_size=block_size, backend="mpi",
                                pieces=pieces)


def _op(method: str, x: torch.Tensor, comm, block_size: Optional[int], pieces: Optional[int] = None):
    """A zero-argument callable doing one allreduce-to-mean of x, and its bytes sent per rank."""
    p = comm.world_size
    if method == "fp32":
        buf = torch.empty_like(x)

        def run():
            buf.copy_(x)
            comm.sum_(buf)
            buf.div_(p)

        return run, 2 * (p - 1) / p * 4 * x.numel()
    if method == "fp16":
        buf = torch.empty_like(x, dtype=torch.float16)
        out = torch.empty_like(x)

        def run():
            buf.copy_(x)
            comm.sum_(buf)
            out.copy_(buf).div_(p)

        return run, 2 * (p - 1) / p * 2 * x.numel()
    if method == "onebit":
        state = comm.compression_state(x.numel(), x.device, block_size, pieces)
        out = torch.empty_like(x)
        return (lambda: compressed_allreduce(x, state, out=out)), state.bytes_per_call()
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def measure(sizes: Sequence[int], methods: Sequence[str] = METHODS, iters: int = 20, warmup: int = 3,
            block_size: Optional[int] = DEFAULT_BLOCK_SIZE, device: str = "cpu", group=None,
            progress=None, comm=None, pieces: Optional[int] = None) -> List[Dict]:
    """Time each method on each size (elements); rows carry the slowest rank's times.

    `progress`, if given, is called once per timed iteration; `comm` (default:
    `TorchComm(group)`) provides the collectives."""
    if comm is None:
        comm = TorchComm(group)
    p = comm.world_size
    rows = []
    for n in sizes:
        g = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(n, generator=g).to(device)
        for method in methods:
            run, wire = _op(method, x, comm, block_size, pieces)
            for _ in range(warmup):
                run()
            times = []
            for _ in range(iters):
                comm.barrier()
                t0 = time.perf_counter()
                run()
                if device != "cpu":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                if progress is not None:
                    progress()
            slowest = torch.tensor(times, dtype=torch.float64)
            comm.max_(slowest)
            med, p10, p90 = _quantiles(slowest.tolist())
            nbytes = 4 * n
            rows.append(dict(size=n, bytes=nbytes, method=method, world_size=p, median_s=med, p10_s=p10, p90_s=p90,
                             algbw_gbps=nbytes / med / 1e9, busbw_gbps=2 * (p - 1) / p * nbytes / med / 1e9,
                             wire_bytes=int(wire)))
    base = {r["size"]: r["median_s"] for r in rows if r["method"] == "fp32"}
    for r in rows:
        r["speedup_vs_fp32"] = base[r["size"]] / r["median_s"] if r["size"] in base else None
    return rows


def format_table(rows: List[Dict]) -> str:
    """nccl-tests-like table: size in bytes and fp32 elements, times in ms, bandwidths in GB/s."""
    hdr = (f"{'bytes':>10} {'elements':>9} {'method':>7} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} "
           f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'wire B/rank':>11} {'vs fp32':>8}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        sp = f"{r['speedup_vs_fp32']:.2f}x" if r.get("speedup_vs_fp32") else "-"
        lines.append(f"{r['bytes']:>10} {r['size']:>9} {r['method']:>7} {r['median_s'] * 1e3:>10.2f} "
                     f"{r['p10_s'] * 1e3:>8.2f} {r['p90_s'] * 1e3:>8.2f} {r['algbw_gbps']:>10.3f} "
                     f"{r['busbw_gbps']:>10.3f} {int(r['wire_bytes']):>11} {sp:>8}")
    return "\n".join(lines)
