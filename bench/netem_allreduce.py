"""Allreduce bus bandwidth on the emulated low-bandwidth cluster (DESIGN.md §5).

Creates an :class:`~lbcomm.bench.netem.EmulatedCluster` (one network namespace per rank,
veths on a bridge, tbf on both ends of every veth), runs one process per rank with
``ip netns exec`` and gloo bound to the rank's interface, and times ``all_reduce``::

    sudo python bench/netem_allreduce.py                      # 4 ranks, 1gbit, 32 MB fp32
    sudo python bench/netem_allreduce.py --bandwidth 10gbit --world-size 2

Reported: time per allreduce (slowest rank), algbw = bytes / time and
busbw = 2 (p - 1) / p * bytes / time (the per-link traffic of a ring allreduce), in Gbit/s,
and busbw as a fraction of the link rate. Methods are listed in ``METHODS``: each runs in
the same cluster, side by side, so their ratios are comparable (DESIGN.md §5).

Needs root. Only depends on torch and lbcomm.bench.netem (stdlib only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def _load_netem():
    """lbcomm.bench.netem, or the file itself if the lbcomm package does not import."""
    try:
        from lbcomm.bench import netem
    except ImportError:
        import importlib.util

        path = _ROOT / "lbcomm" / "bench" / "netem.py"
        spec = importlib.util.spec_from_file_location("lbcomm_bench_netem", path)
        netem = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = netem
        spec.loader.exec_module(netem)
    return netem


# --------------------------------------------------------------------------- worker side


def _allreduce_fp32(tensor):
    import torch.distributed as dist

    dist.all_reduce(tensor)


# name -> function(tensor) that allreduces the fp32 tensor in place (sum over ranks)
METHODS = {"fp32": _allreduce_fp32}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # p processes share the machine's cores
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in args.methods:
        fn = METHODS[name]
        x = torch.full((args.numel,), float(rank + 1), dtype=torch.float32)
        fn(x)  # first warmup doubles as a correctness check
        expected = world * (world + 1) / 2
        if not torch.allclose(x, torch.full_like(x, expected), rtol=1e-2):
            raise RuntimeError(f"rank {rank}: {name} allreduce gave {x[:4].tolist()}, expected {expected}")
        for _ in range(args.warmup - 1):
            x.fill_(1.0)
            fn(x)
        times = []
        for _ in range(args.iters):
            x.fill_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
        # The slowest rank defines the collective's time.
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results[name] = t.tolist()
    if rank == 0:
        print(json.dumps({"world_size": world, "numel": args.numel, "times": results}), flush=True)
    dist.destroy_process_group()


# --------------------------------------------------------------------------- launcher side


def _report(out: dict, rate_bits: int, bandwidth: str) -> None:
    p, nbytes = out["world_size"], out["numel"] * 4
    print(f"allreduce of {nbytes / 2**20:.0f} MiB fp32 ({out['numel']} elements), {p} ranks, "
          f"links {bandwidth} per direction (gloo over veth + tbf)")
    print(f"{'method':>8} {'median ms':>10} {'min ms':>8} {'algbw Gbit/s':>13} {'busbw Gbit/s':>13} "
          f"{'busbw/link':>11}")
    for name, times in out["times"].items():
        times = sorted(times)
        median = times[len(times) // 2]
        algbw = nbytes * 8 / median / 1e9
        busbw = 2 * (p - 1) / p * algbw
        print(f"{name:>8} {median * 1e3:10.1f} {times[0] * 1e3:8.1f} {algbw:13.3f} {busbw:13.3f} "
              f"{busbw * 1e9 / rate_bits:11.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--bandwidth", default="1gbit", help="per-link rate, tc syntax (default: 1gbit)")
    parser.add_argument("--latency", default="50ms", help="tbf latency (queue bound) (default: 50ms)")
    parser.add_argument("--burst", default="256kb", help="tbf burst (default: 256kb)")
    parser.add_argument("--numel", type=int, default=8 * 2**20, help="fp32 elements (default: 8M = 32 MiB)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are killed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.iters < 1 or args.numel < 1:
        parser.error("--warmup, --iters and --numel must be >= 1")

    if args.worker:
        worker(args)
        return 0

    netem = _load_netem()
    ok, reason = netem.available()
    if not ok:
        print(f"error: cannot build the emulated cluster: {reason}", file=sys.stderr)
        return 2
    try:
        cluster = netem.EmulatedCluster(
            args.world_size, args.bandwidth, latency=args.latency, burst=args.burst
        )
    except ValueError as exc:
        parser.error(str(exc))

    worker_argv = [sys.executable, str(Path(__file__).resolve()), "--worker",
                   "--numel", str(args.numel), "--warmup", str(args.warmup),
                   "--iters", str(args.iters), "--methods", *args.methods]
    # Workers import this file as a script; make `lbcomm` importable for future methods.
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        with cluster:
            results = cluster.launch([worker_argv] * args.world_size, env=env, timeout=args.timeout)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _report(json.loads(results[0].stdout.strip().splitlines()[-1]), cluster.rate_bits, cluster.bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
