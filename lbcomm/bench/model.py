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
  (sign bits, block scales, headers; DESIGN.md §1); 2 (p-1)/p * 4n for the fp32 ring.
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
a typical TCP small-message latency between nodes; this VM's namespaces, at about 1 ms,
are no guide to a real network).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

__all__ = ["LoopTransport", "onebit_compute_s", "fp32_compute_s", "compute_times", "predict", "wire_bytes",
           "add_parser", "PAYLOAD_FRACTION"]

PAYLOAD_FRACTION = 1448 / 1514  # TCP payload / Ethernet frame at MTU 1500


class LoopTransport:
    """A transport for one process that acts as rank 0 of p ranks which all sent the same data."""

    backend = None

    def __init__(self, world_size: int):
        self.world_size, self.rank = world_size, 0

    @staticmethod
    def _done(async_op: bool):
        if not async_op:
            return None
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut

    def all_to_all(self, out, inp, async_op=False):
        out.copy_(inp)
        return self._done(async_op)

    def all_gather(self, out, inp, async_op=False):
        p = self.world_size
        out.view(p, -1).copy_(inp.reshape(1, -1).expand(p, -1))
        return self._done(async_op)


def _median_time(fn, reps: int = 5, min_time: float = 0.3) -> float:
    fn()
    times, start = [], time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_time and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _state(n: int, p: int, block_size: Optional[int]):
    from ..compressed import CompressionState

    # pieces=1: the model is of the unpipelined call (README, "Pipelining")
    return CompressionState(n, transport=LoopTransport(p), block_size=block_size, device="cpu", pieces=1)


def wire_bytes(method: str, n: int, p: int, block_size: Optional[int] = 2048) -> int:
    """Bytes one rank sends per allreduce of n fp32 elements."""
    if method == "fp32":
        return int(2 * (p - 1) / p * 4 * n)
    if method == "fp16":
        return int(2 * (p - 1) / p * 2 * n)
    return _state(n, p, block_size).bytes_per_call()


def onebit_compute_s(n: int, p: int, block_size: Optional[int] = 2048) -> float:
    """Seconds of local compute of one compressed allreduce (one thread, no network)."""
    from ..compressed import compressed_allreduce

    state = _state(n, p, block_size)
    x = torch.randn(n)
    out = torch.empty(n)
    return _median_time(lambda: compressed_allreduce(x, state, out=out))


def fp32_compute_s(n: int, p: int) -> float:
    """Seconds of local compute of one fp32 ring allreduce-to-mean: copy in, (p-1)/p adds, divide."""
    x, buf = torch.randn(n), torch.empty(n)
    k = max(1, (p - 1) * n // p)
    other = torch.randn(k)

    def run():
        buf.copy_(x)
        buf[:k].add_(other)
        buf.div_(p)

    return _median_time(run)


def predict(method: str, n: int, p: int, bandwidth_bps: float, alpha_s: float, compute_s: float,
            block_size: Optional[int] = 2048) -> float:
    """Predicted seconds of one allreduce (see the module docstring)."""
    beff = bandwidth_bps / 8 * PAYLOAD_FRACTION
    return 2 * (p - 1) * alpha_s + wire_bytes(method, n, p, block_size) / beff + compute_s


# ---------------------------------------------------------------------------- the subcommand


def _compute_worker(items, block_size, barrier, queue) -> None:
    torch.set_num_threads(1)
    out = {}
    for method, n, p in items:
        barrier.wait()  # every process times the same item at the same time
        out[(method, n, p)] = onebit_compute_s(n, p, block_size) if method == "onebit" else fp32_compute_s(n, p)
    queue.put(out)


def compute_times(items, block_size: Optional[int], processes: int = 1) -> Dict:
    """(method, n, p) -> seconds of local compute per call, timed in `processes` processes at
    once (the slowest process counts), with one thread each."""
    items = list(dict.fromkeys(items))
    if processes <= 1:
        torch.set_num_threads(1)
        return {(m, n, p): onebit_compute_s(n, p, block_size) if m == "onebit" else fp32_compute_s(n, p)
                for m, n, p in items}
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_compute_worker, args=(items, block_size, barrier, queue), daemon=True)
             for _ in range(processes)]
    for pr in procs:
        pr.start()
    try:
        results = []
        deadline = time.monotonic() + 900
        while len(results) < len(procs):
            try:
                results.append(queue.get(timeout=1.0))
            except Exception:  # queue.Empty: check that no worker died before answering
                dead = [pr.exitcode for pr in procs if pr.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"timing processes failed (exit codes {dead or 'none: timed out'}); "
                                       "see their traceback above") from None
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.kill()
            pr.join()
    return {k: max(r[k] for r in results) for k in items}


def _measured(args) -> List[Dict]:
    """allreduce JSON documents: loaded from --from-json, or measured now at each world size."""
    from .cli import check_allreduce_doc, run_allreduce

    docs = []
    if args.from_json:
        import json

        for path in args.from_json:
            with open(path) as f:
                doc = json.load(f)
            check_allreduce_doc(doc)
            docs.append(doc)
        return docs
    if not args.bandwidth:
        raise ValueError("the model is checked against runs in the emulated cluster: give --bandwidth (root "
                         "needed), or --from-json with allreduce results")
    for p in args.world_sizes:
        print(f"# measuring {p} ranks at {args.bandwidth} ...", file=sys.stderr)
        docs.append(run_allreduce(args, bandwidth=args.bandwidth, world_size=p, sizes=args.sizes,
                                  methods=["fp32", "onebit"]))
    return docs


def cmd_model(args) -> int:
    from . import netem
    from .cli import _host, _now, _write_json

    if args.plot:
        from .plot import require_matplotlib

        require_matplotlib()
    docs = _measured(args)
    checks: List[Dict] = []
    alphas: Dict[str, Dict[str, float]] = {}
    here_times: Dict = {}
    for doc in docs:
        c = doc["config"]
        if not c.get("bandwidth"):
            raise ValueError("--from-json: the model needs runs in the emulated cluster (config.bandwidth set)")
        bps, p = netem.parse_rate(c["bandwidth"]), c["world_size"]
        rows = doc["rows"]
        block = c.get("block_size", args.block_size)
        sizes = sorted({r["elements"] for r in rows})
        methods = [m for m in ("fp32", "onebit") if any(r["method"] == m for r in rows)]
        print(f"# timing the local compute of {p} ranks at once ...", file=sys.stderr)
        k_here = compute_times([(m, n, p) for m in methods for n in sizes], block, processes=p)
        here_times.update({f"{m} {n} {q} x{p}": v for (m, n, q), v in k_here.items()})
        alpha = {}
        for m in methods:
            r0 = next(r for r in rows if r["elements"] == sizes[0] and r["method"] == m)
            rest = predict(m, sizes[0], p, bps, 0.0, k_here[(m, sizes[0], p)], block_size=block)
            alpha[m] = max(0.0, (r0["median_s"] - rest) / (2 * (p - 1)))
        alphas[str(p)] = alpha
        for n in sizes:
            pred, meas = {}, {}
            for m in methods:
                r = next((r for r in rows if r["elements"] == n and r["method"] == m), None)
                if r is None:
                    continue
                meas[m] = r["median_s"]
                pred[m] = predict(m, n, p, bps, alpha[m], k_here[(m, n, p)], block_size=block)
                checks.append(dict(world_size=p, bandwidth=c["bandwidth"], elements=n, method=m,
                                   measured_s=meas[m], predicted_s=pred[m], compute_s=k_here[(m, n, p)],
                                   calibration=n == sizes[0]))
            if len(pred) == 2:
                checks.append(dict(world_size=p, bandwidth=c["bandwidth"], elements=n, method="speedup",
                                   measured_speedup=meas["fp32"] / meas["onebit"],
                                   predicted_speedup=pred["fp32"] / pred["onebit"], calibration=n == sizes[0]))

    # Predictions for a real cluster: one rank per node, compute timed in one process.
    n, alpha = args.predict_size, args.predict_alpha
    k_node = compute_times([(m, n, p) for p in args.predict_world_sizes for m in ("fp32", "onebit")],
                           args.block_size, processes=1)
    grid = []
    for p in args.predict_world_sizes:
        for bw in args.predict_bandwidths:
            bps = netem.parse_rate(bw)
            t32 = predict("fp32", n, p, bps, alpha, k_node[("fp32", n, p)])
            t1 = predict("onebit", n, p, bps, alpha, k_node[("onebit", n, p)], block_size=args.block_size)
            grid.append(dict(world_size=p, bandwidth=bw, elements=n, fp32_s=t32, onebit_s=t1, speedup=t32 / t1,
                             compute_fp32_s=k_node[("fp32", n, p)], compute_onebit_s=k_node[("onebit", n, p)]))

    print(f"# alpha-beta model: T = 2(p-1) alpha + bytes/(B * {PAYLOAD_FRACTION:.3f}) + K(n, p); K = local compute "
          f"per call measured here (one thread per rank)")
    if checks:
        print("# measured points: K timed with all p ranks' processes at once on this machine; alpha calibrated on "
              "the smallest size: " + "; ".join(f"{p} ranks: fp32 {a.get('fp32', 0) * 1e6:.0f} us, onebit "
                                              f"{a.get('onebit', 0) * 1e6:.0f} us" for p, a in alphas.items()))
        print(check_table(checks))
    print(f"\n# predicted for a real cluster (one rank per node, K timed in one process, alpha {alpha * 1e6:.0f} us): "
          f"onebit speedup over fp32 and onebit time, {n} elements ({4 * n / 2**20:g} MiB)")
    print(grid_table(grid, args.predict_world_sizes, args.predict_bandwidths))
    doc = {"schema": "lbcomm-bench/model", "version": 1, "created": _now(), "argv": sys.argv, "host": _host(),
           "alpha_s": alphas, "predict_alpha_s": alpha, "payload_fraction": PAYLOAD_FRACTION,
           "checks": checks, "grid": grid, "measured": docs}
    if args.json:
        _write_json(args.json, doc)
        print(f"# wrote {args.json}")
    if args.plot:
        from .plot import plot_model

        plot_model(grid, [c for c in checks if c["method"] == "speedup" and c["elements"] == n], args.plot,
                   f"alpha-beta model, {n * 4 / 2**20:g} MiB fp32: onebit speedup over fp32")
        print(f"# wrote {args.plot}")
    return 0


def check_table(checks: List[Dict]) -> str:
    hdr = (f"{'ranks':>5} {'links':>7} {'elements':>9} {'method':>8} {'measured':>10} {'model':>10} "
           f"{'model/meas':>10}")
    lines = [hdr, "-" * len(hdr)]
    for c in checks:
        if c["method"] == "speedup":
            a, b = c["measured_speedup"], c["predicted_speedup"]
            lines.append(f"{c['world_size']:>5} {c['bandwidth']:>7} {c['elements']:>9} {'speedup':>8} "
                         f"{a:>9.2f}x {b:>9.2f}x {b / a:>10.2f}{'  (calibration point)' if c['calibration'] else ''}")
        else:
            a, b = c["measured_s"] * 1e3, c["predicted_s"] * 1e3
            note = "  (calibrates alpha)" if c.get("calibration") else ""
            lines.append(f"{c['world_size']:>5} {c['bandwidth']:>7} {c['elements']:>9} {c['method']:>8} "
                         f"{a:>8.2f}ms {b:>8.2f}ms {b / a:>10.2f}{note}")
    return "\n".join(lines)


def grid_table(grid: List[Dict], world_sizes: Sequence[int], bandwidths: Sequence[str]) -> str:
    hdr = f"{'ranks':>5} " + " ".join(f"{bw:>14}" for bw in bandwidths)
    lines = [hdr + "   (speedup; onebit ms)", "-" * len(hdr)]
    for p in world_sizes:
        cells = []
        for bw in bandwidths:
            g = next(g for g in grid if g["world_size"] == p and g["bandwidth"] == bw)
            cells.append(f"{g['speedup']:>6.1f}x {g['onebit_s'] * 1e3:>6.1f}")
        lines.append(f"{p:>5} " + " ".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)


def add_parser(sub, add_common) -> None:
    from .cli import _block_size, _positive, _sizes

    md = sub.add_parser("model", help="alpha-beta cost model, checked against measured 2 and 4 rank runs",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(md, None)
    md.add_argument("--bandwidth", default="1gbit",
                    help="link rate of the emulated cluster for the measured points (default: 1gbit; needs root)")
    md.add_argument("--world-sizes", type=lambda s: [_positive(x) for x in s.split(",")], default=[2, 4],
                    help="rank counts to measure (default: 2,4)")
    md.add_argument("--sizes", type=_sizes, default=_sizes("4K,1M,8M"),
                    help="sizes to measure; the smallest calibrates alpha (default: 4K,1M,8M)")
    md.add_argument("--iters", type=_positive, default=10, help="timed iterations (default: 10)")
    md.add_argument("--warmup", type=int, default=2, help="untimed iterations (default: 2)")
    md.add_argument("--block-size", type=_block_size, default=2048, help="onebit block size (default: 2048)")
    md.add_argument("--pieces", type=_positive, default=1,
                    help="onebit pieces of the measured runs (default: 1; the model is of the unpipelined call)")
    md.add_argument("--from-json", nargs="+", metavar="FILE",
                    help="use these `allreduce --json` results instead of measuring")
    md.add_argument("--predict-alpha", type=float, default=50e-6,
                    help="latency per message of the predicted clusters, seconds (default: 50e-6)")
    md.add_argument("--predict-size", type=lambda s: _sizes(s)[0], default=8 * 2**20,
                    help="size of the predictions (default: 8M elements = 32 MiB)")
    md.add_argument("--predict-world-sizes", type=lambda s: [_positive(x) for x in s.split(",")],
                    default=[2, 4, 8, 16, 32, 64, 128, 256], help="(default: 2,4,...,256)")
    md.add_argument("--predict-bandwidths", type=lambda s: [x.strip() for x in s.split(",")],
                    default=["1gbit", "10gbit", "25gbit", "100gbit"], help="(default: 1gbit,10gbit,25gbit,100gbit)")
    md.set_defaults(func=cmd_model, methods=["fp32", "onebit"])
