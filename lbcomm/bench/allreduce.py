"""Allreduce timing on every rank: fp32, fp16 and 1-bit compressed, side by side.

`measure(sizes, methods, iters, warmup, block_size)` runs inside an initialized process
group and returns one row per (size, method) with the median, p10 and p90 of the
per-iteration time of the slowest rank. Every method produces the MEAN over ranks, so
fp32 and fp16 include their division by p and their casts.
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


def _op(method: str, x: torch.Tensor, p: int, block_size: Optional[int], group=None):
    """A zero-argument callable doing one allreduce-to-mean of x, and its bytes sent per rank."""
    if method == "fp32":
        buf = torch.empty_like(x)

        def run():
            buf.copy_(x)
            dist.all_reduce(buf, group=group)
            buf.div_(p)

        return run, 2 * (p - 1) / p * 4 * x.numel()
    if method == "fp16":
        buf = torch.empty_like(x, dtype=torch.float16)
        out = torch.empty_like(x)

        def run():
            buf.copy_(x)
            dist.all_reduce(buf, group=group)
            out.copy_(buf).div_(p)

        return run, 2 * (p - 1) / p * 2 * x.numel()
    if method == "onebit":
        state = CompressionState(x.numel(), group=group, device=x.device, block_size=block_size)
        out = torch.empty_like(x)
        return (lambda: compressed_allreduce(x, state, out=out)), state.bytes_per_call()
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def measure(sizes: Sequence[int], methods: Sequence[str] = METHODS, iters: int = 20, warmup: int = 3,
            block_size: Optional[int] = DEFAULT_BLOCK_SIZE, device: str = "cpu", group=None,
            progress=None) -> List[Dict]:
    """Time each method on each size (elements); rows carry the slowest rank's times."""
    p = dist.get_world_size(group)
    rows = []
    for n in sizes:
        g = torch.Generator().manual_seed(dist.get_rank(group))
        x = torch.randn(n, generator=g).to(device)
        for method in methods:
            run, wire = _op(method, x, p, block_size, group)
            for _ in range(warmup):
                run()
            times = []
            for _ in range(iters):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                run()
                if device != "cpu":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                if progress is not None:
                    progress()
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
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
    hdr = (f"{'size':>10} {'method':>7} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'algbw GB/s':>10} "
           f"{'busbw GB/s':>10} {'wire MB/rank':>12} {'vs fp32':>8}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        sp = f"{r['speedup_vs_fp32']:.2f}x" if r.get("speedup_vs_fp32") else "-"
        lines.append(f"{r['bytes']:>10} {r['method']:>7} {r['median_s'] * 1e3:>10.2f} {r['p10_s'] * 1e3:>8.2f} "
                     f"{r['p90_s'] * 1e3:>8.2f} {r['algbw_gbps']:>10.3f} {r['busbw_gbps']:>10.3f} "
                     f"{r['wire_bytes'] / 1e6:>12.2f} {sp:>8}")
    return "\n".join(lines)
