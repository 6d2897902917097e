"""Kernel bandwidth against a torch copy of the same bytes, measured side by side.

For each op the minimum memory traffic is counted (worker: read x and e, write e and the
bits: 12n + n/8 bytes for fp32) and a torch copy moving that many bytes (read + write)
is timed in the same process; the printed ratio is copy time / kernel time, so 1.0 means
the kernel runs at copy bandwidth. Target (issue 2): >= 0.8.

    python bench/kernels.py                  # 1M..64M elements, 1 thread and all threads
    python bench/kernels.py --sizes 1M,8M --threads 1 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import lbcomm
from lbcomm import ops
from lbcomm.cli.units import parse_count
from lbcomm.reference import chunk_size, num_blocks


def median_time(fn, reps: int, min_time: float = 0.2) -> float:
    fn()  # warm up: page faults, thread pool start
    times = []
    start = time.perf_counter()
    while len(times) < reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 10 * reps:
            break
    return statistics.median(times)


def copy_time(nbytes: int, reps: int) -> float:
    """A torch copy whose read + write traffic is nbytes."""
    n = max(1, nbytes // 8)
    src, dst = torch.ones(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
    return median_time(lambda: dst.copy_(src), reps)


def bench_size(n: int, p: int, block, reps: int):
    m = chunk_size(n, p)
    x = torch.randn(n)
    err = torch.randn(p, m) * 0.01
    rows = []

    t = median_time(lambda: ops.worker_compress(x, err, block), reps)
    traffic = 12 * n + n // 8
    rows.append(("worker_compress", t, traffic))

    # The server reduces one chunk of n elements (as if the tensor were p * n long).
    mc = chunk_size(n, 1)
    packed = torch.randint(0, 256, (p, mc // 8), dtype=torch.uint8)
    scales = torch.rand(p, num_blocks(mc, block))
    s_err = torch.randn(mc) * 0.01
    t = median_time(lambda: ops.server_compress(packed, scales, s_err, block), reps)
    traffic = p * mc // 8 + 8 * mc + mc // 8
    rows.append((f"server_compress(p={p})", t, traffic))

    pk, sc = ops.worker_compress(x, err.clone(), block)
    out = torch.empty(n)  # the allreduce decodes into a caller's buffer: no page faults
    t = median_time(lambda: ops.unpack_into(pk, sc, block, out), reps)
    rows.append(("unpack_into", t, n // 8 + 4 * n))
    return [(name, t, traffic, copy_time(traffic, reps)) for name, t, traffic in rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,8M,64M")
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}")
    ap.add_argument("--block-size", default=str(lbcomm.DEFAULT_BLOCK_SIZE), help="int or 'none'")
    ap.add_argument("--world-size", type=int, default=4, help="p: chunks for the worker, ranks for the server")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    block = None if args.block_size.lower() == "none" else int(args.block_size)
    if not ops.HAS_EXTENSION:
        raise SystemExit(f"the fused kernels are not available: {ops.extension_problem()}")
    print(f"lbcomm kernels vs torch copy of the same bytes; block_size={block}, p={args.world_size}, "
          f"AVX2={ops.cpu_has_avx2()}, torch {torch.__version__}")
    hdr = f"{'op':<24}{'elements':>10}{'threads':>8}{'time ms':>10}{'GB/s':>8}{'copy GB/s':>11}{'ratio':>7}"
    print(hdr)
    print("-" * len(hdr))
    out = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for n in [parse_count(s) for s in args.sizes.split(",")]:
            for name, t, traffic, tc in bench_size(n, args.world_size, block, args.reps):
                row = dict(op=name, elements=n, threads=threads, time_s=t, gbps=traffic / t / 1e9,
                           copy_gbps=traffic / tc / 1e9, ratio=tc / t)
                out.append(row)
                print(f"{name:<24}{n:>10}{threads:>8}{t * 1e3:>10.3f}{row['gbps']:>8.2f}{row['copy_gbps']:>11.2f}"
                      f"{row['ratio']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
