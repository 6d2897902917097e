"""Kernel bandwidth against a torch copy of the same bytes, measured side by side.

For each op the minimum memory traffic is counted (worker: read x and e, write e and the
bits: 12n + n/8 bytes for fp32; 4n more with fp32 per-coordinate weights, 2n with bf16
ones, the 1-bit hook's, and 4n more with the capped decode's fp32 caps, 1-bit Adam's) and
a torch copy moving that many bytes (read + write)
is timed in the same process; the printed ratio is copy time / kernel time, so 1.0 means
the kernel runs at copy bandwidth. Target: >= 0.8. "vs mix" is the same ratio against a torch
elementwise op with the kernel's own reads and writes (see bench_size).

With --device cuda the kernels run on the GPU and the baseline is a device-to-device copy
of the same bytes; both are timed with CUDA events over back-to-back launches (the GPU
time per call, launch gaps included only where the GPU waits for them).

    python -m bench.kernels                  # 1M..64M elements, 1 thread and all threads
    python -m bench.kernels --sizes 1M,8M --threads 1 --json out.json
    python -m bench.kernels --device cuda --sizes 16M,64M,256M --world-size 4,8
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


def cuda_median_time(fn, reps: int, min_time: float = 0.005) -> float:
    """Median GPU seconds per call of fn, from CUDA events around runs of back-to-back calls
    (each run lasts about min_time, so that launch overheads overlap the kernels)."""
    fn()  # warm up: allocator, first launch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    inner = max(1, min(200, int(min_time / max(start.elapsed_time(end) / 1e3, 1e-7))))
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def median_time(fn, reps: int, min_time: float = 0.2, device: str = "cpu") -> float:
    if device == "cuda":
        return cuda_median_time(fn, reps)
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


def copy_time(nbytes: int, reps: int, device: str = "cpu") -> float:
    """A torch copy whose read + write traffic is nbytes (device to device on a GPU)."""
    n = max(1, nbytes // 8)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty(n, dtype=torch.float32, device=device)
    return median_time(lambda: dst.copy_(src), reps, device=device)


def bench_size(n: int, p: int, block, reps: int, device: str = "cpu"):
    """Rows (op, kernel s, traffic bytes, copy s, mix s) for n elements and p chunks/ranks.

    mix: a torch elementwise op that reads and writes the same float tensors as the kernel
    (the packed bits and scales aside), e.g. ``e.add_(x)`` for the worker. A copy balances
    reads and writes; on a GPU a kernel that mostly writes (unpack) or mostly reads cannot
    reach a copy's bandwidth, and the torch op of its own mix shows what can be reached."""
    m = chunk_size(n, p)
    x = torch.randn(n, device=device)
    err = torch.randn(p, m, device=device) * 0.01
    e_n = err.view(-1)[:n]
    rows = []

    def row(name, fn, traffic, mix):
        rows.append((name, median_time(fn, reps, device=device), traffic, median_time(mix, reps, device=device)))

    traffic = 12 * n + n // 8
    row("worker_compress", lambda: ops.worker_compress(x, err, block), traffic, lambda: e_n.add_(x))
    w = torch.rand(n, device=device) + 0.5  # per-coordinate weights (the 1-bit hook's normalization)
    row("worker_compress+weights", lambda: ops.worker_compress(x, err, block, weights=w), traffic + 4 * n,
        lambda: e_n.addcdiv_(x, w))
    wb = w.to(torch.bfloat16)  # what the hook's normalize="warmup" keeps
    row("worker_compress+bf16 weights", lambda: ops.worker_compress(x, err, block, weights=wb), traffic + 2 * n,
        lambda: e_n.addcdiv_(x, wb))
    # the capped decode (1-bit Adam's max_update): caps near the values, a quarter unbounded
    cap = torch.where(torch.rand(n, device=device) < 0.25, float("inf"), torch.rand(n, device=device) + 0.3)
    if block is not None:
        row("worker_compress+cap", lambda: ops.worker_compress(x, err, block, cap=cap), traffic + 4 * n,
            lambda: e_n.addcmul_(x, cap))

    # The server reduces one chunk of n elements (as if the tensor were p * n long).
    mc = chunk_size(n, 1)
    packed = torch.randint(0, 256, (p, mc // 8), dtype=torch.uint8, device=device)
    scales = torch.rand(p, num_blocks(mc, block), device=device)
    s_err = torch.randn(mc, device=device) * 0.01
    row(f"server_compress(p={p})", lambda: ops.server_compress(packed, scales, s_err, block),
        p * mc // 8 + 8 * mc + mc // 8, lambda: s_err.mul_(1.0))
    if block is not None:
        row(f"server_compress+cap(p={p})", lambda: ops.server_compress(packed, scales, s_err, block, cap=cap[:mc]),
            p * mc // 8 + 12 * mc + mc // 8, lambda: s_err.mul_(cap[:mc]))

    pk, sc = ops.worker_compress(x, err.clone(), block)
    out = torch.empty(n, device=device)  # the allreduce decodes into a caller's buffer: no page faults
    row("unpack_into", lambda: ops.unpack_into(pk, sc, block, out), n // 8 + 4 * n, lambda: out.fill_(1.0))
    row("unpack_into+weights", lambda: ops.unpack_into(pk, sc, block, out, weights=w), n // 8 + 8 * n,
        lambda: torch.mul(w, 1.0, out=out))
    row("unpack_into+bf16 weights", lambda: ops.unpack_into(pk, sc, block, out, weights=wb), n // 8 + 6 * n,
        lambda: out.copy_(wb))
    if block is not None:
        row("unpack_into+cap", lambda: ops.unpack_into(pk, sc, block, out, cap=cap), n // 8 + 8 * n,
            lambda: torch.mul(cap, 1.0, out=out))
    del x, err, e_n, packed, scales, s_err, pk, sc, out, w, wb, cap  # free the device memory before the copies
    return [(name, t, traffic, copy_time(traffic, reps, device), tm) for name, t, traffic, tm in rows]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.kernels",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,8M,64M")
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}")
    ap.add_argument("--block-size", default=str(lbcomm.config.DEFAULT_BLOCK_SIZE), help="int or 'none'")
    ap.add_argument("--world-size", default="4", help="p, or a comma list: chunks for the worker, ranks for the server")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: GPU kernels against a device-to-device copy (--threads is then ignored)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    block = None if args.block_size.lower() == "none" else int(args.block_size)
    worlds = [int(w) for w in str(args.world_size).split(",")]
    if not ops.HAS_EXTENSION:
        raise SystemExit(f"the fused kernels are not available: {ops.extension_problem()}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible to torch "
                             f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
        if not torch.ops.lbcomm.built_with_cuda():
            raise SystemExit("--device cuda: lbcomm was built without its CUDA kernels; rebuild with a CUDA torch and "
                             "nvcc: LBCOMM_CUDA=1 python setup.py build_ext --inplace")
        where = f"{torch.cuda.get_device_name()}, device-to-device copy"
    else:
        where = f"AVX2={ops.cpu_has_avx2()}"
    print(f"lbcomm kernels vs torch copy of the same bytes; block_size={block}, p={args.world_size}, "
          f"{where}, torch {torch.__version__}")
    hdr = (f"{'op':<30}{'elements':>10}{'threads':>8}{'time ms':>10}{'GB/s':>8}{'copy GB/s':>11}{'ratio':>7}"
           f"{'vs mix':>8}")
    print(hdr)
    print("-" * len(hdr))
    out = []
    thread_counts = [torch.get_num_threads()] if args.device == "cuda" else [int(t) for t in args.threads.split(",")]
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for n, p in [(parse_count(s), p) for s in args.sizes.split(",") for p in worlds]:
            for name, t, traffic, tc, tm in bench_size(n, p, block, args.reps, args.device):
                row = dict(op=name, elements=n, threads=threads, time_s=t, gbps=traffic / t / 1e9,
                           copy_gbps=traffic / tc / 1e9, ratio=tc / t, mix_s=tm, mix_ratio=tm / t,
                           device=args.device, world_size=p)
                out.append(row)
                print(f"{name:<30}{n:>10}{threads:>8}{t * 1e3:>10.3f}{row['gbps']:>8.2f}{row['copy_gbps']:>11.2f}"
                      f"{row['ratio']:>7.2f}{row['mix_ratio']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
