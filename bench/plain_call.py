"""The plain user call against the benchmark CLI's measurement, in the same processes.

A user who calls ``lbcomm.compressed_allreduce_(grad, state)`` on an existing tensor in
their own loop should see what ``lbcomm-bench allreduce`` reports for the 1-bit method.
Each rank (one thread) first runs the CLI's own timing (`lbcomm.cli.allreduce.measure`,
methods onebit and fp32), then times the plain loop the same way (barrier, call, slowest
rank's median), on the same tensor size; the ratio plain / CLI should stay near 1.

Both are also set against the testbed's limit of one call, as ``lbcomm-bench allreduce``
reports it (docs/cli.md): max(wire time of the bytes sent at the emulated link's TCP
payload rate, local compute of the call's kernels timed on the ranks). The in-place call
runs the same kernels on the same sizes and sends the same bytes as the CLI's onebit
method, so it is held to the CLI row's limit.

    python -m bench.plain_call                          # 4 ranks, 8M elements, loopback
    sudo python -m bench.plain_call --bandwidth 1gbit   # on an emulated 1 Gbit/s cluster
"""
import argparse
import json
import os
import sys
import time

import torch


def _rank(size: int, iters: int, warmup: int) -> dict:
    import torch.distributed as dist

    import lbcomm
    from lbcomm.cli.allreduce import busy_between, host_cpu_ticks, measure
    from lbcomm.comm import get_transport

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    transport = get_transport(None, backend="torch")
    full = {r["method"]: r for r in measure([size], ["onebit", "fp32"], iters=iters, warmup=warmup,
                                            transport=transport)}
    rows = {m: r["median_s"] for m, r in full.items()}
    grad = torch.randn(size, generator=torch.Generator().manual_seed(dist.get_rank()))
    state = lbcomm.CompressionState(size)
    for _ in range(warmup):
        lbcomm.compressed_allreduce_(grad, state)
    times, cpu0, host0 = [], time.process_time(), host_cpu_ticks()
    for _ in range(iters):
        transport.barrier()
        t0 = time.perf_counter()
        lbcomm.compressed_allreduce_(grad, state)
        times.append(time.perf_counter() - t0)
    cpu = torch.tensor([(time.process_time() - cpu0) / iters], dtype=torch.float64)
    busy = busy_between(host0, host_cpu_ticks())
    transport.all_reduce(cpu, op="sum")
    plain_cpu = float(cpu.item()) / transport.world_size
    slowest = torch.tensor(times, dtype=torch.float64)
    transport.all_reduce(slowest, op="max")
    plain = float(slowest.median())
    if state.bytes_per_call() != full["onebit"]["wire_bytes"]:
        raise RuntimeError("the plain call's layout differs from the CLI's onebit method: the limit would not apply")
    dist.destroy_process_group()
    return {"cli_onebit_s": rows["onebit"], "cli_fp32_s": rows["fp32"], "plain_s": plain,
            "plain_over_cli": plain / rows["onebit"], "fp32_over_plain": rows["fp32"] / plain,
            "onebit_compute_s": full["onebit"]["compute_s"], "onebit_wire_bytes": full["onebit"]["wire_bytes"],
            "fp32_compute_s": full["fp32"]["compute_s"], "fp32_wire_bytes": full["fp32"]["wire_bytes"],
            "plain_cpu_s": plain_cpu, "plain_host_busy": busy,
            "onebit_compute_cpu_s": full["onebit"]["compute_cpu_s"], "onebit_cpu_s": full["onebit"]["cpu_s"],
            "onebit_host_busy": full["onebit"]["host_busy"]}


def _limit(res: dict, method: str, bandwidth) -> tuple:
    """(wire_s or None, limit_s) of one call of `method` (see lbcomm.cli.schema.add_limits)."""
    from lbcomm.cli.model import PAYLOAD_FRACTION
    from lbcomm.cli.schema import call_limit
    from lbcomm.cli.units import parse_rate

    wire = res[f"{method}_wire_bytes"] / (parse_rate(bandwidth) / 8 * PAYLOAD_FRACTION) if bandwidth else None
    return wire, call_limit(wire, res[f"{method}_compute_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--size", type=int, default=8 << 20, help="elements (default: 8M)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bandwidth", default=None, help="tc rate of an emulated cluster (root), e.g. 1gbit")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank:
        res = _rank(a.size, a.iters, a.warmup)
        if os.environ.get("RANK") == "0":
            print(json.dumps(res))
        return
    argv = [sys.executable, "-m", "bench.plain_call", "--rank", "--size", str(a.size), "--iters", str(a.iters),
            "--warmup", str(a.warmup)]
    if a.bandwidth:
        from lbcomm.cli.netem import EmulatedCluster

        with EmulatedCluster(a.world_size, a.bandwidth) as cluster:
            outs = cluster.launch([argv] * a.world_size, timeout=900)
    else:
        import socket
        import subprocess

        with socket.socket() as sock:  # a free port for the rendezvous
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r),
                                       "WORLD_SIZE": str(a.world_size)}) for r in range(a.world_size)]
        outs = [subprocess.CompletedProcess(p.args, p.wait(timeout=900), p.stdout.read(), "") for p in procs]
        if any(o.returncode for o in outs):
            sys.exit("a rank failed")
    res = json.loads(outs[0].stdout.strip().splitlines()[-1])
    where = f"emulated {a.bandwidth}" if a.bandwidth else "loopback"
    print(f"{a.world_size} ranks, {a.size} elements, {where}, one thread per rank")
    print(f"  lbcomm-bench allreduce onebit: {1e3 * res['cli_onebit_s']:.1f} ms   fp32: {1e3 * res['cli_fp32_s']:.1f} ms")
    print(f"  plain compressed_allreduce_:   {1e3 * res['plain_s']:.1f} ms   "
          f"plain / CLI {res['plain_over_cli']:.3f}, fp32 / plain {res['fp32_over_plain']:.2f}x")
    for what, method, t in (("CLI onebit", "onebit", res["cli_onebit_s"]),
                            ("plain call", "onebit", res["plain_s"]), ("CLI fp32", "fp32", res["cli_fp32_s"])):
        wire, limit = _limit(res, method, a.bandwidth)
        wtxt = f"wire {1e3 * wire:.1f} ms" if wire is not None else "no wire part (loopback)"
        print(f"  limit {what + ':':<12} {1e3 * limit:.1f} ms = max({wtxt}, compute "
              f"{1e3 * res[method + '_compute_s']:.1f} ms); reached {limit / t:.0%}")
    # when the host's cores are saturated, the time is CPU: the kernels' and the transport's
    kern, cores = res["onebit_compute_cpu_s"], len(os.sched_getaffinity(0))
    for what, cpu, busy, t in (("CLI onebit", res["onebit_cpu_s"], res["onebit_host_busy"], res["cli_onebit_s"]),
                               ("plain call", res["plain_cpu_s"], res["plain_host_busy"], res["plain_s"])):
        btxt = "-" if busy is None else f"{busy:.0%}"
        bound = a.world_size * cpu / min(cores, a.world_size)  # the ranks' CPU on the cores they share
        print(f"  cpu {what + ':':<14} host busy {btxt}; per rank and call {1e3 * cpu:.1f} ms of CPU: kernels "
              f"{1e3 * kern:.1f} ms, the transport and the rest {1e3 * (cpu - kern):.1f} ms ({1 - kern / cpu:.0%}); "
              f"{a.world_size} ranks' CPU on {min(cores, a.world_size)} cores: {1e3 * bound:.1f} ms, reached "
              f"{bound / t:.0%}")


if __name__ == "__main__":
    main()
