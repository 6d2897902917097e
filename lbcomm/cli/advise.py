"""Will 1-bit help my run? Step-time predictions of data-parallel training from the cost
model (lbcomm/cli/model.py) for a model of N parameters on `nodes` nodes of
`ranks_per_node` ranks, each node on one link of B bits/s per direction with a latency of
alpha per message, and a given compute time per step (forward + backward + optimizer).

Per method, one step = compute + communication (no overlap: the 1-bit optimizers
communicate after the backward pass; DDP overlaps part of its fp32/fp16 allreduce with it,
so those two may run faster than predicted, never slower)::

    fp32, fp16     ring allreduce of the gradients in DDP buckets of `bucket_bytes`:
                   2 (p-1) alpha per bucket + 2 (p-1)/p * bytes / B_eff + K
    powersgd       every parameter counted in width x width matrices (rank r): two ring
                   allreduces of width x r fp32 per matrix, per bucket 2 x 2 (p-1) alpha,
                   K = its matmuls and orthogonalization, timed here
    onebit_warmup  the 1-bit optimizers' warmup: the fp32 allreduce of the gradients
    onebit         the compression stage: one compressed allreduce of the momentum,
                   2 (p-1) alpha + node bytes / B_eff + K
    onebit_hier    the same on nodes of g > 1 ranks, hierarchical (fp32 reduce-scatter and
                   all-gather inside the node, 1 bit across nodes on each rank's slice of
                   n/g): 2 (N-1) alpha + g b(n/g, N) / B_eff + K(n/g, N) + K_intra(n, g)
                   + 2 (g-1)/g 4n / B_intra (0 without `intra_bandwidth_bps`: free);
                   K_intra is the call's own passes inside the node (finiteness check,
                   the copies of the slices, the fp32 mean of its slice), timed here

A ring crosses each node's link once per direction, so a node sends what one rank of the
ring sends; the 1-bit all-to-all and all-gather send each rank's bytes to every other
rank, and the `ranks_per_node` ranks of a node share its link for the (p - g)/(p - 1) of
them that leave the node. Inside a node the transfers are taken as free (unless
`intra_bandwidth_bps`), not the hierarchical call's own copies and adds. K (local compute
per call) is timed on this machine with one thread, at up to `timing_elements` elements
and scaled linearly (so are the 1-bit bytes, whose headers are a few bytes per call), then
divided by `cores_per_rank` where CPU ranks share cores (0.5: two ranks per core, each
computing at half speed).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

from ..common import ring_allreduce_bytes
from .model import PAYLOAD_FRACTION, compute_times, powersgd_compute_s, wire_bytes

__all__ = ["advise", "METHODS", "PAYS_OFF"]

# onebit_hier only on several nodes of several ranks
METHODS = ("fp32", "fp16", "powersgd", "onebit_warmup", "onebit", "onebit_hier")
PAYS_OFF = 1.10  # below this compression-stage speedup over fp32, compression "will not pay"


def advise(params: int, nodes: int, ranks_per_node: int, bandwidth_bps: float, latency_s: float,
           step_compute_s: float, *, block_size: Optional[int] = 2048, powersgd_rank: int = 4, width: int = 1024,
           bucket_bytes: int = 25 * 2**20, device: str = "cpu", timing_elements: int = 2**22,
           intra_bandwidth_bps: Optional[float] = None, cores_per_rank: float = 1.0) -> Dict:
    """Predicted step time of every method in `METHODS`, and a verdict in plain words.
    `intra_bandwidth_bps`: the link between the ranks of a node (None: free), which the
    hierarchical call's fp32 stages use. `cores_per_rank` (0 < c <= 1): the share of a
    core each rank computes on, below 1 where CPU ranks share a machine's cores."""
    if not 0 < cores_per_rank <= 1:
        raise ValueError(f"advise: cores_per_rank must be in (0, 1], got {cores_per_rank!r}")
    p, g = nodes * ranks_per_node, ranks_per_node
    hier = nodes > 1 and g > 1
    n_t = min(params, timing_elements)
    scale = params / n_t
    slice_t = math.ceil(n_t / g)
    items = [(m, n_t, p) for m in ("fp32", "fp16", "onebit")]
    items += [("onebit", slice_t, nodes), ("hier_intra", n_t, g)] if hier else []
    k = {key: t / cores_per_rank for key, t in compute_times(items, block_size, processes=1, device=device).items()}
    beff = bandwidth_bps / 8 * PAYLOAD_FRACTION
    buckets = math.ceil(4 * params / bucket_bytes)
    ring_alpha = 2 * (p - 1) * latency_s
    off_node = nodes > 1

    def ring(nbytes: float) -> float:  # bytes a node sends in a ring allreduce
        return ring_allreduce_bytes(nbytes, p) if off_node else 0.0

    matrices = params / width**2
    comm = {
        "fp32": (buckets * ring_alpha, ring(4 * params), k[("fp32", n_t, p)] * scale),
        "fp16": (buckets * ring_alpha, ring(2 * params), k[("fp16", n_t, p)] * scale),
        "powersgd": (2 * buckets * ring_alpha, ring(4 * params * 2 * powersgd_rank / width),
                     powersgd_compute_s(width, powersgd_rank, device) / cores_per_rank * matrices),
    }
    comm["onebit_warmup"] = comm["fp32"]
    onebit_rank_bytes = wire_bytes("onebit", n_t, p, block_size) * scale if p > 1 else 0.0
    onebit_node_bytes = g * onebit_rank_bytes * (p - g) / (p - 1) if p > 1 else 0.0
    comm["onebit"] = (ring_alpha, onebit_node_bytes, k[("onebit", n_t, p)] * scale)
    if hier:
        intra_s = 0.0 if intra_bandwidth_bps is None else 2 * (g - 1) / g * 4 * params / (intra_bandwidth_bps / 8)
        comm["onebit_hier"] = (2 * (nodes - 1) * latency_s,
                               g * wire_bytes("onebit", slice_t, nodes, block_size) * scale,
                               (k[("onebit", slice_t, nodes)] + k[("hier_intra", n_t, g)]) * scale + intra_s)

    rows: List[Dict] = []
    for m in (m for m in METHODS if m in comm):
        alpha, nbytes, compute = comm[m]
        c = alpha + nbytes / beff + compute
        rows.append(dict(method=m, comm_s=c, step_s=step_compute_s + c, node_bytes_per_step=float(nbytes),
                         latency_s=alpha, wire_s=nbytes / beff, compute_s=compute))
    fp32 = rows[0]["step_s"]
    for r in rows:
        r["speedup_vs_fp32"] = fp32 / r["step_s"]
    return dict(rows=rows, verdict=_verdict(rows, nodes, step_compute_s), world_size=p)


def _verdict(rows: List[Dict], nodes: int, step_compute_s: float) -> List[str]:
    by = {r["method"]: r for r in rows}
    fp32, onebit = by["fp32"], by["onebit"]
    share = fp32["comm_s"] / fp32["step_s"]
    lines = [f"communication is {share:.0%} of an fp32 step ({fp32['comm_s'] * 1e3:.1f} of "
             f"{fp32['step_s'] * 1e3:.1f} ms); no compression can make a step faster than the compute alone "
             f"({fp32['step_s'] / step_compute_s:.2f}x at most)"]
    if nodes == 1:
        lines.append("1-bit will not pay: on one node nothing crosses a network link (communication inside a "
                     "node is taken as free here; NVLink or shared memory beat compression)")
    elif onebit["speedup_vs_fp32"] < PAYS_OFF:
        why = ("the network is fast or the model small for this compute time" if share < 0.25 else
               f"compressing costs {onebit['compute_s'] * 1e3:.1f} ms per step, about what it saves on the wire")
        lines.append(f"1-bit will not pay: compression-stage steps only {onebit['speedup_vs_fp32']:.2f}x fp32's "
                     f"({why}); train with fp32 DDP")
    else:
        lines.append(f"1-bit pays: compression-stage steps {onebit['speedup_vs_fp32']:.2f}x faster than fp32 "
                     f"({onebit['step_s'] * 1e3:.1f} vs {fp32['step_s'] * 1e3:.1f} ms); the warmup steps run at "
                     f"fp32's speed")
    if "onebit_hier" in by:
        h = by["onebit_hier"]
        ratio = onebit["step_s"] / h["step_s"]
        lines.append(f"on nodes: the hierarchical call is predicted {ratio:.2f}x the flat call's speed "
                     f"({h['step_s'] * 1e3:.1f} vs {onebit['step_s'] * 1e3:.1f} ms per step); "
                     + ("keep CommConfig(topology='auto') (hierarchical under torchrun on several nodes)"
                        if ratio >= 1 else "use CommConfig(topology='flat')"))
    best = max((r for r in rows if r["method"] in ("fp16", "powersgd")), key=lambda r: r["speedup_vs_fp32"])
    if nodes > 1 and best["speedup_vs_fp32"] >= onebit["speedup_vs_fp32"]:
        lines.append(f"{best['method']} is predicted at least as fast ({best['speedup_vs_fp32']:.2f}x fp32)")
    return lines
