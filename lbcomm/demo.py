"""Demo: 4 local ranks over gloo, fp32 allreduce vs the 1-bit compressed allreduce.

    python -m lbcomm.demo [--world-size 4] [--numel 8M] [--steps 20]

Each rank holds a different tensor; both methods compute the mean over ranks. Printed: the
median time of each, the bytes each rank sends, the error of one compressed call, and the
error of the running sum over many calls, which error feedback keeps shrinking (the
compression error does not accumulate: it is carried into the next call).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lbcomm
from lbcomm.cli.units import parse_count
from lbcomm.comm import get_transport
from lbcomm.common import ring_allreduce_bytes


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _rank(rank: int, p: int, numel: int, steps: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=p,
                            timeout=datetime.timedelta(seconds=300))
    transport = get_transport(None, backend="torch")
    state = lbcomm.CompressionState(numel, transport=transport)
    out = torch.empty(numel)
    t_fp32, t_1bit, cum_err = [], [], []
    sum_exact = torch.zeros(numel, dtype=torch.float64)
    sum_1bit = torch.zeros(numel, dtype=torch.float64)
    base = torch.randn(numel, generator=torch.Generator().manual_seed(12345))
    for t in range(steps):
        g = torch.Generator().manual_seed(1000 * t + rank)
        # like gradients: a slowly varying signal shared by the ranks plus per-rank noise
        shared = base + 0.3 * torch.randn(numel, generator=torch.Generator().manual_seed(t))
        x = shared + 0.5 * torch.randn(numel, generator=g)
        exact = x.clone()
        transport.barrier()
        t0 = time.perf_counter()
        transport.all_reduce(exact, op="mean")
        t_fp32.append(time.perf_counter() - t0)
        transport.barrier()
        t0 = time.perf_counter()
        lbcomm.compressed_allreduce(x, state, out=out)
        t_1bit.append(time.perf_counter() - t0)
        if t == 0:
            first_err = _rel(out, exact)
        sum_exact += exact
        sum_1bit += out
        cum_err.append(_rel(sum_1bit, sum_exact))
    same = torch.tensor([float(out.sum()), float(out.norm())], dtype=torch.float64)
    gathered = torch.empty(p, 2, dtype=torch.float64)
    transport.all_gather(gathered.view(torch.uint8), same.view(torch.uint8))
    if rank == 0:
        fp32_bytes = ring_allreduce_bytes(4 * numel, p)
        f, c = statistics.median(t_fp32), statistics.median(t_1bit)
        print(f"lbcomm demo: {p} ranks over gloo (loopback), {numel:,} fp32 elements, {steps} calls, "
              f"block_size={state.block_size}, kernels={'fused C++' if lbcomm.ops.HAS_EXTENSION else 'reference'}")
        print(f"  fp32 allreduce      median {f * 1e3:8.2f} ms   sends {fp32_bytes / 1e6:8.2f} MB/rank")
        print(f"  1-bit compressed    median {c * 1e3:8.2f} ms   sends {state.bytes_per_call() / 1e6:8.2f} MB/rank "
              f"({fp32_bytes / state.bytes_per_call():.1f}x less)")
        print(f"  time ratio fp32 / 1-bit: {f / c:.2f}x (loopback: no network bottleneck, see the README for "
              f"emulated 1 Gbit/s figures)")
        print(f"  relative error of one compressed call:            {first_err:.3f}")
        mid = min(5, steps)
        print(f"  relative error of the sum over 1, {mid}, {steps} calls:      "
              f"{cum_err[0]:.3f}, {cum_err[mid - 1]:.3f}, {cum_err[-1]:.4f}  (error feedback)")
        print(f"  result identical on all ranks: {all(torch.equal(gathered[0], g) for g in gathered)}")
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--numel", default="8M")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(args.world_size, parse_count(args.numel), args.steps, os.path.join(d, "init")),
                 nprocs=args.world_size)


if __name__ == "__main__":
    main()
