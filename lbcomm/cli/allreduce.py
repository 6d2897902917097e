"""Allreduce timing on every rank: fp32, fp16 and 1-bit compressed, side by side.

`measure(sizes, methods, iters, warmup, block_size)` runs inside an initialized process
group and returns one row per (size, method) with the median, p10 and p90 of the
per-iteration time of the slowest rank. Every method produces the MEAN over ranks, so
fp32 and fp16 include their division by p and their casts.

Every method goes through an `lbcomm.comm` transport (torch.distributed by default, MPI
with ``get_transport(comm, "mpi")``): fp32 and fp16 through its in-place ``all_reduce``,
onebit through lbcomm's compressed allreduce on the same transport. MPI has no
half-precision reductions, so the MPI transport sums an fp16 tensor in an fp32 copy and
casts back: its fp16 rows time those casts too and send as many bytes as fp32 (their
wire_bytes say so).

``hier`` is the hierarchical call (lbcomm.topology) on nodes of `ranks_per_node`
consecutive ranks: fp32 inside a node, 1 bit between nodes; its wire_bytes are the bytes
a rank sends between nodes. On emulated nodes (`lbcomm.cli.netem` with ranks_per_node,
which names the node's link in LBCOMM_NODE_IFACE) the bytes that really crossed the
links are read from the interface counters: the sum over nodes of what each node's link
transmitted during the timed iterations, per call (the per-iteration barriers included,
a few hundred bytes).

``compute_s`` of a row: the local compute one call of the method needs, timed in the same
processes right after its timed calls (every rank at once, so the ranks share the cores
as during the calls, with the same torch threads; median of a few repetitions, slowest
rank), without any communication (`_compute_op`): for fp32 the copy into the buffer, the
(p - 1)/p of the tensor a ring reduce-scatter adds and the division by p; for fp16 the same
in half precision with its casts; for onebit the passes lbcomm's kernels make over the
data (the finiteness check of the input, worker compress of all n elements, server reduce
+ compress of this rank's n/p chunk from p inputs, decode of all n); for hier the stages
inside the node (`hier_intra_compute`: the input's finiteness check, the copy of the slices
that leave for the node's other ranks, the fp32 mean of this rank's slice, the copy of
every slice's result into place) plus onebit's passes on one slice over the nodes. The
report turns it, with the wire time at the emulated link rate, into each call's limit
(`lbcomm.cli.schema.add_limits`, docs/cli.md).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import ops
from ..common import ring_allreduce_bytes
from ..compressed import CompressionState, compressed_allreduce
from ..config import DEFAULT_BLOCK_SIZE
from ..wire import chunk_size

METHODS = ("fp32", "fp16", "onebit", "hier")
DEFAULT_METHODS = ("fp32", "fp16", "onebit")
ENV_NODE_IFACE = "LBCOMM_NODE_IFACE"



def ring_compute(x: torch.Tensor, p: int, dtype: torch.dtype):
    """The local compute of one ring allreduce-to-mean of `x` over `p` ranks in `dtype`, as
    a callable: copy (and cast) in, the reduce-scatter's (p-1)/p adds, divide (and cast
    back). The compute half of the limit, and the cost model's compute term."""
    n = x.numel()
    buf = torch.empty(n, dtype=dtype, device=x.device)
    out = torch.empty_like(x)
    k = max(1, (p - 1) * n // p)  # the ring's reduce-scatter adds (p-1) chunks of n/p
    other = torch.randn(k, generator=torch.Generator().manual_seed(1)).to(device=x.device, dtype=dtype)

    def ring():
        buf.copy_(x)
        buf[:k].add_(other)
        if dtype == torch.float32:
            buf.div_(p)
        else:
            out.copy_(buf).div_(p)

    return ring


def hier_intra_compute(x: torch.Tensor, g: int):
    """The local compute of the hierarchical call's stages inside a node of `g` ranks on
    `x`, as a callable with no communication: the finiteness check of the input, the copy
    of the (g-1)/g of it that leaves for the node's other ranks, the fp32 mean of g slices
    of n/g (g-1 adds and a division), and the copy of all n results into place. On CPU
    nodes these passes share the cores with the compression: the hierarchical call's
    compute, beside `onebit_compute` on one slice, in the limit and the cost model."""
    n = x.numel()
    m = chunk_size(n, g)
    real = min(m, n)
    send = torch.empty(n - real, device=x.device)
    # the slices the other g - 1 ranks send: separate memory, as their shared buffers are
    others = torch.randn(g - 1, real, generator=torch.Generator().manual_seed(1)).to(x.device)
    acc = torch.empty(real, device=x.device)
    out = torch.empty_like(x)

    def intra():
        bool(torch.isfinite(x.sum(dtype=torch.float32)))
        send.copy_(x[real:])
        torch.add(x[:real], others[0], out=acc)
        for j in range(1, g - 1):
            acc.add_(others[j])
        acc.div_(g)
        out.copy_(x)

    return intra


def onebit_compute(x: torch.Tensor, p: int, block_size: Optional[int]):
    """The passes lbcomm's kernels make in one compressed allreduce of `x` over `p` ranks,
    as a callable with no communication: the finiteness check, the worker compress of all
    n elements, the server reduce + compress of one n/p chunk from p rows, the decode of
    all n."""
    n = x.numel()
    m = chunk_size(n, p)
    worker_error = torch.zeros(p, m, device=x.device)
    server_error = torch.zeros(m, device=x.device)
    out = torch.empty_like(x)
    packed, scales = ops.worker_compress(x, worker_error, block_size)
    # The rows this rank's own compress wrote stand in for the p rows its chunk receives
    # and for the p server rows the decode reads: the kernels' work depends on the
    # sizes only.
    real = min(m, n)

    def onebit():
        bool(torch.isfinite(x.sum(dtype=torch.float32)))
        ops.worker_compress(x, worker_error, block_size)
        ops.server_compress(packed, scales, server_error, block_size, real)
        ops.unpack_into(packed, scales, block_size, out)

    return onebit


def quantiles(v: Sequence[float]):
    """(median, p10, p90) of the values (nearest rank)."""
    s = sorted(v)
    q = lambda f: s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]  # noqa: E731
    return statistics.median(s), q(0.1), q(0.9)


def _op(method: str, x: torch.Tensor, transport, block_size: Optional[int], pieces: Optional[int] = None,
        topology=None):
    """A zero-argument callable doing one allreduce-to-mean of x, and its bytes sent per rank."""
    p = transport.world_size
    if method == "fp32":
        buf = torch.empty_like(x)

        def run():
            buf.copy_(x)
            transport.all_reduce(buf, op="mean")

        return run, ring_allreduce_bytes(4 * x.numel(), p)
    if method == "fp16":
        buf = torch.empty_like(x, dtype=torch.float16)
        out = torch.empty_like(x)

        def run():
            buf.copy_(x)
            transport.all_reduce(buf, op="sum")
            out.copy_(buf).div_(p)

        # MPI reduces fp16 in an fp32 copy (lbcomm.comm.mpi): fp32's bytes on the wire
        return run, ring_allreduce_bytes((4 if transport.backend == "mpi" else 2) * x.numel(), p)
    if method == "onebit":
        state = CompressionState(x.numel(), device=x.device, block_size=block_size, transport=transport,
                                 pieces=pieces)
        out = torch.empty_like(x)
        return (lambda: compressed_allreduce(x, state, out=out)), state.bytes_per_call()
    if method == "hier":
        from ..topology import HierarchicalState, hierarchical_allreduce_

        state = HierarchicalState(x.numel(), topology, device=x.device, block_size=block_size, pieces=pieces)
        buf = x.clone()

        # In place on one buffer without re-copying x (onebit reads x and writes out, no
        # copy either): each call reduces the previous result; the cost does not depend on
        # the values, which stay finite.
        return (lambda: hierarchical_allreduce_(buf, state)), state.bytes_per_call()
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def _compute_op(method: str, x: torch.Tensor, p: int, block_size: Optional[int], ranks_per_node: int = 1):
    """A zero-argument callable doing the local compute of one call of `method` on x
    (module docs), with no communication."""
    if method in ("fp32", "fp16"):
        return ring_compute(x, p, torch.float32 if method == "fp32" else torch.float16)
    if method == "onebit":
        return onebit_compute(x, p, block_size)
    if method == "hier":
        g = ranks_per_node
        if g <= 1 or p <= g:  # one rank per node, or one node: the flat call
            return onebit_compute(x, p, block_size)
        intra = hier_intra_compute(x, g)
        across = onebit_compute(x[:chunk_size(x.numel(), g)], p // g, block_size)

        def hier():
            intra()
            across()

        return hier
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def _time_compute(fn, reps: int, transport, device: str) -> Tuple[float, float]:
    """(median seconds of `fn` over `reps` runs on every rank at once, the slowest rank's;
    the CPU seconds of one run, mean over the ranks)."""
    fn()
    transport.barrier()
    times, cpu0 = [], time.process_time()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    cpu = torch.tensor([(time.process_time() - cpu0) / reps], dtype=torch.float64)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    transport.all_reduce(slowest, op="max")
    transport.all_reduce(cpu, op="sum")
    return float(slowest.item()), float(cpu.item()) / transport.world_size


def host_cpu_ticks() -> Optional[Tuple[int, int]]:
    """(busy, total) clock ticks of all this host's CPUs since boot, from /proc/stat (busy:
    everything but idle and iowait, the kernel's network work included); None where there
    is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def busy_between(before: Optional[Tuple[int, int]], after: Optional[Tuple[int, int]],
                 min_ticks: Optional[int] = None) -> Optional[float]:
    """The share of the host's CPU capacity busy between two `host_cpu_ticks` readings;
    None when they span fewer than `min_ticks` ticks (default: 10 per CPU, a tenth of a
    second at the usual 100 Hz: a shorter window is off by a tick in ten)."""
    if min_ticks is None:
        min_ticks = 10 * (os.cpu_count() or 1)
    if before is None or after is None or after[1] - before[1] < max(1, min_ticks):
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _link_tx_bytes() -> Optional[int]:
    """Bytes this emulated node's link has transmitted (None when not on an emulated node)."""
    iface = os.environ.get(ENV_NODE_IFACE)
    if not iface:
        return None
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


def _profile(run, iters: int, transport, top: int = 14) -> List[Dict]:
    """`iters` calls of `run` under torch.profiler (CPU): per call, the wall time of the
    whole call and of lbcomm's own stage ranges (``lbcomm.*``: total time, children
    included) and the self CPU time of the busiest operators. Profiling slows the calls
    down a little; the timed iterations run without it."""
    from torch.profiler import ProfilerActivity, profile

    transport.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        wall = time.perf_counter() - t0
    transport.barrier()
    events = prof.key_averages()
    out = [dict(name="(call)", kind="wall", ms=1e3 * wall / iters)]
    stages = sorted((e for e in events if e.key.startswith("lbcomm.")), key=lambda e: e.key)
    out += [dict(name=e.key, kind="total", ms=e.cpu_time_total / 1e3 / iters) for e in stages]
    ops = sorted((e for e in events if not e.key.startswith("lbcomm.") and not e.key.startswith("ProfilerStep")),
                 key=lambda e: -e.self_cpu_time_total)[:top]
    out += [dict(name=e.key, kind="self", ms=e.self_cpu_time_total / 1e3 / iters) for e in ops]
    return out


def measure(sizes: Sequence[int], methods: Sequence[str] = METHODS, iters: int = 20, warmup: int = 3,
            block_size: Optional[int] = DEFAULT_BLOCK_SIZE, device: str = "cpu", group=None,
            progress=None, transport=None, pieces: Optional[int] = None,
            ranks_per_node: int = 1, profile: bool = False) -> List[Dict]:
    """Time each method on each size (elements); rows carry the slowest rank's times.

    `progress`, if given, is called once per timed iteration; `transport` (default: the
    torch.distributed transport of `group`) provides the collectives. With `profile`, each
    method runs `iters` more calls under torch.profiler after its timed ones, and its row
    gets ``profile``: this rank's CPU time per call of the busiest events (see `_profile`)."""
    if transport is None:
        from ..comm import get_transport

        transport = get_transport(group, backend="torch")
    p = transport.world_size
    topology = None
    if "hier" in methods:
        from ..topology import Topology

        topology = Topology.node_by_node(ranks_per_node)
    # one reader of the link counters per emulated node
    reader = _link_tx_bytes() is not None and transport.rank % ranks_per_node == 0
    counted = _link_tx_bytes() is not None
    rows = []
    for n in sizes:
        g = torch.Generator().manual_seed(transport.rank)
        x = torch.randn(n, generator=g).to(device)
        for method in methods:
            run, wire = _op(method, x, transport, block_size, pieces, topology)
            for _ in range(warmup):
                run()
            transport.barrier()
            tx0 = _link_tx_bytes() if reader else 0
            times, cpu0, host0 = [], time.process_time(), host_cpu_ticks()
            for _ in range(iters):
                transport.barrier()
                t0 = time.perf_counter()
                run()
                if device != "cpu":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                if progress is not None:
                    progress()
            cpu = torch.tensor([(time.process_time() - cpu0) / iters], dtype=torch.float64)
            busy = busy_between(host0, host_cpu_ticks())
            transport.barrier()  # every packet of the timed calls has arrived
            transport.all_reduce(cpu, op="sum")
            busiest = torch.tensor([-1.0 if busy is None else busy], dtype=torch.float64)
            transport.all_reduce(busiest, op="max")
            sent = torch.tensor([float(_link_tx_bytes() - tx0) if reader else 0.0], dtype=torch.float64)
            if counted:
                transport.all_reduce(sent, op="sum")
            slowest = torch.tensor(times, dtype=torch.float64)
            transport.all_reduce(slowest, op="max")
            med, p10, p90 = quantiles(slowest.tolist())
            nbytes = 4 * n
            rows.append(dict(size=n, bytes=nbytes, method=method, world_size=p, median_s=med, p10_s=p10, p90_s=p90,
                             algbw_gbps=nbytes / med / 1e9, busbw_gbps=ring_allreduce_bytes(nbytes, p) / med / 1e9,
                             wire_bytes=int(wire),
                             inter_node_bytes=int(sent.item() / iters) if counted else None))
            rows[-1]["cpu_s"] = float(cpu.item()) / p
            rows[-1]["host_busy"] = float(busiest.item()) if busiest.item() >= 0 else None
            rows[-1]["compute_s"], rows[-1]["compute_cpu_s"] = _time_compute(
                _compute_op(method, x, p, block_size, ranks_per_node), min(iters, 5), transport, device)
            if profile:
                rows[-1]["profile"] = _profile(run, iters, transport)
    base = {r["size"]: r["median_s"] for r in rows if r["method"] == "fp32"}
    for r in rows:
        r["speedup_vs_fp32"] = base[r["size"]] / r["median_s"] if r["size"] in base else None
    return rows
