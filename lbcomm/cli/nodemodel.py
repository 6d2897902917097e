"""Cost model of one gradient reduction on N nodes x G ranks per node: the inter-node link
and the intra-node link separately (nodes: docs/topology.md; the emulated links:
`lbcomm.cli.netem`).

Per call, n fp32 elements (one gradient of n parameters), p = N G ranks. Each node has one
link of B_x bytes/s per direction to the others (latency alpha_x per message); each rank
has B_i bytes/s per direction to the ranks of its node (latency alpha_i). b(m, q) is the
exact number of bytes a rank sends in the flat 1-bit call of m elements over q ranks
(`onebit_bytes`: sign bits, block scales, headers, the finiteness agreement), r(m, q)
one row of it (the 1-bit form of one rank's chunk of m/q elements). K is the
local compute of the call (kernels), see below. Per method::

    fp32         flat ring allreduce over the p ranks (DDP):
                 2 (p-1) alpha_x + 2 (p-1)/p 4n / B_x + K
                 (ranks in node order: each node link carries one rank's ring traffic)
    onebit       flat 1-bit call over the p ranks: 2 (p-1) alpha_x + node bytes / B_x + K,
                 node bytes = (G (p-G) + (p-1)) r(n, p) + the agreement's ring: its
                 all-to-all sends a row r (one rank's chunk) directly to each of p-1
                 peers, p-G of them on other nodes, from each of the node's G ranks; its
                 all-gather is a ring (gloo and NCCL), which crosses each node's link
                 once: p-1 rows. (Inside the node the ranks exchange fewer bytes over
                 the faster link, at the same time: not counted.)
    hier         hierarchical call (lbcomm.topology): fp32 reduce-scatter and all-gather
                 inside the node, 1 bit across nodes on each rank's slice of n/G:
                 2 [(G-1) alpha_i + (G-1)/G 4n / B_i] + 2 (N-1) alpha_x + G b(n/G, N) / B_x + K
    hsdp_fp32    HSDP's gradient reduction: fp32 reduce-scatter inside the node, then the
                 ring allreduce of the shard (n/G) across nodes:
                 (G-1) alpha_i + (G-1)/G 4n / B_i + 2 (N-1) alpha_x + 2 (N-1)/N 4n / B_x + K
    hsdp_bf16    the same with 2-byte gradients (reduce_dtype=bfloat16)
    hsdp_onebit  fp32 reduce-scatter inside the node, the 1-bit call on the shard across
                 nodes (lbcomm.fsdp.onebit_hsdp):
                 (G-1) alpha_i + (G-1)/G 4n / B_i + 2 (N-1) alpha_x + G b(n/G, N) / B_x + K

The HSDP rows leave the result sharded; FSDP's all-gather of the parameters in the next
forward pass (intra-node, (G-1)/G of the parameters) is the same for the three HSDP rows
and not counted. Communication inside and between nodes is not overlapped in the
hierarchical call (its stages run in turn), and no method's communication is overlapped
with compute.

K, the local compute. On the emulated nodes (CPU ranks sharing this machine's cores) the
intra-node stages are shared-memory copies and sums, i.e. local compute too: there, the
latency and a per-element compute time kappa per method are fitted on two measured sizes
(T = latency + inter-node bytes / B_x + kappa n; `fit_emulated`), and every other size
is predicted. For GPU predictions K is estimated from memory traffic over the memory
bandwidth (`gpu_kernel_s`): the 1-bit call on m elements over q ranks reads and writes
about (16.375 + 8.125/q) m bytes (worker compression: input, error in and out, sign bits;
server: q rows of bits, its error in and out; decode: bits in, fp32 out), and the
hierarchical call adds its own passes inside the node, (16 + 8 (G-1)/G + 12/G) n bytes
(`HIER_INTRA_TRAFFIC`: the input's finiteness check, the copy of the slices that leave,
the mean of G slices of n/G and its division, the copy of all n results into place); fp32/bf16
reductions run inside NCCL's collectives, which the links bound, so K = 0 for them. These
are estimates, not measurements.
"""
from __future__ import annotations

from typing import Dict, Optional

from ..common import ring_allreduce_bytes
from ..wire import AGREEMENT_BYTES, chunk_size, row_layout

__all__ = ["NODE_METHODS", "Links", "onebit_bytes", "node_cost", "gpu_kernel_s", "ONEBIT_TRAFFIC",
           "HIER_INTRA_TRAFFIC", "fit_emulated"]

NODE_METHODS = ("fp32", "onebit", "hier", "hsdp_fp32", "hsdp_bf16", "hsdp_onebit")


def ONEBIT_TRAFFIC(q: int) -> float:  # noqa: N802 - a constant of q
    """Bytes of memory traffic per element of the 1-bit call over q ranks (see the module docs)."""
    return 16.375 + 8.125 / q


def HIER_INTRA_TRAFFIC(g: int) -> float:  # noqa: N802 - a constant of g
    """Bytes of memory traffic per element of the hierarchical call's own passes inside a
    node of g ranks (see the module docs)."""
    return 16 + 8 * (g - 1) / g + 12 / g


class Links:
    """The two links of the model: `inter_Bps` (bytes/s per node and direction, payload),
    `intra_Bps` (bytes/s per rank and direction inside a node), and their latencies per
    message `alpha_x`, `alpha_i` (seconds)."""

    __slots__ = ("inter_Bps", "intra_Bps", "alpha_x", "alpha_i")

    def __init__(self, inter_Bps: float, intra_Bps: float, alpha_x: float, alpha_i: float):
        for name, v in (("inter_Bps", inter_Bps), ("intra_Bps", intra_Bps)):
            if not v > 0:
                raise ValueError(f"Links: {name} must be > 0, got {v!r}")
        for name, v in (("alpha_x", alpha_x), ("alpha_i", alpha_i)):
            if not v >= 0:
                raise ValueError(f"Links: {name} must be >= 0, got {v!r}")
        self.inter_Bps, self.intra_Bps, self.alpha_x, self.alpha_i = inter_Bps, intra_Bps, alpha_x, alpha_i

    def __repr__(self) -> str:
        return (f"Links(inter_Bps={self.inter_Bps:.4g}, intra_Bps={self.intra_Bps:.4g}, alpha_x={self.alpha_x:.3g}, "
                f"alpha_i={self.alpha_i:.3g})")


def onebit_bytes(m: int, q: int, block_size: Optional[int] = 2048) -> int:
    """Bytes one rank sends in the flat 1-bit call of m elements over q ranks, unpipelined
    (as `CompressionState(m, ..., pieces=1).bytes_per_call()`, without allocating)."""
    if q <= 1 or m <= 0:
        return 0
    row = row_layout(chunk_size(m, q), block_size).row_bytes
    return 2 * (q - 1) * row + int(ring_allreduce_bytes(AGREEMENT_BYTES, q))


def gpu_kernel_s(method: str, n: int, nodes: int, ranks_per_node: int, mem_Bps: float) -> float:
    """Estimated kernel time per call on a GPU with `mem_Bps` bytes/s of memory bandwidth
    (a prediction from memory traffic, see the module docs)."""
    N, G = nodes, ranks_per_node
    if method == "onebit":
        return ONEBIT_TRAFFIC(N * G) * n / mem_Bps
    if method == "hier":
        return (ONEBIT_TRAFFIC(N) * (n / G) + HIER_INTRA_TRAFFIC(G) * n) / mem_Bps
    if method == "hsdp_onebit":  # FSDP's reduce-scatter runs inside the collective
        return ONEBIT_TRAFFIC(N) * (n / G) / mem_Bps
    if method in ("fp32", "hsdp_fp32", "hsdp_bf16"):
        return 0.0
    raise ValueError(f"unknown method {method!r}; choose from {NODE_METHODS}")


def node_cost(method: str, n: int, nodes: int, ranks_per_node: int, links: Links, kernel_s: float = 0.0,
              block_size: Optional[int] = 2048) -> Dict[str, float]:
    """Predicted seconds of one reduction of n fp32 elements (see the module docs), by term:
    latency_s, inter_s (the node link), intra_s (inside the node), kernel_s and total_s, and
    node_bytes (bytes each node's link sends per call)."""
    N, G = nodes, ranks_per_node
    if N < 1 or G < 1:
        raise ValueError(f"node_cost: nodes and ranks_per_node must be >= 1, got {N} x {G}")
    p = N * G
    bx, bi, ax, ai = links.inter_Bps, links.intra_Bps, links.alpha_x, links.alpha_i
    rs_bytes = (G - 1) / G * 4 * n  # fp32 reduce-scatter (or all-gather) inside the node, per rank
    if method == "fp32":
        node_bytes = ring_allreduce_bytes(4 * n, p) if N > 1 else 0.0
        latency, inter, intra = 2 * (p - 1) * ax, node_bytes / bx, 0.0
        if N == 1:
            intra = ring_allreduce_bytes(4 * n, p) / bi
    elif method == "onebit":
        row = row_layout(chunk_size(n, p), block_size).row_bytes
        node_bytes = (G * (p - G) + (p - 1)) * row + ring_allreduce_bytes(AGREEMENT_BYTES, p) if N > 1 else 0.0
        latency, inter, intra = 2 * (p - 1) * ax, node_bytes / bx, 0.0
    elif method == "hier":
        node_bytes = G * onebit_bytes(chunk_size(n, G), N, block_size)
        latency = 2 * (G - 1) * ai + 2 * (N - 1) * ax
        inter, intra = node_bytes / bx, 2 * rs_bytes / bi
    elif method in ("hsdp_fp32", "hsdp_bf16", "hsdp_onebit"):
        width = 2 if method == "hsdp_bf16" else 4
        rs = (G - 1) / G * width * n
        if method == "hsdp_onebit":
            node_bytes = G * onebit_bytes(chunk_size(n, G), N, block_size)
        else:
            node_bytes = ring_allreduce_bytes(width * n, N)  # G ranks x 2 (N-1)/N x width n / G
        latency = (G - 1) * ai + 2 * (N - 1) * ax
        inter, intra = node_bytes / bx, rs / bi
    else:
        raise ValueError(f"unknown method {method!r}; choose from {NODE_METHODS}")
    total = latency + inter + intra + kernel_s
    return dict(latency_s=latency, inter_s=inter, intra_s=intra, kernel_s=kernel_s, total_s=total,
                node_bytes=float(node_bytes))


def fit_emulated(method: str, points, nodes: int, ranks_per_node: int, inter_Bps: float,
                 block_size: Optional[int] = 2048) -> Dict[str, float]:
    """alpha (latency per message) and kappa (seconds of local compute per element, the
    intra-node stages included) of `method` from two measured (elements, seconds) `points`
    on emulated nodes: T(n) = latency(alpha) + node_bytes(n) / inter_Bps + kappa n, the
    intra-node link folded into kappa (shared memory is local compute). Both are clamped
    at >= 0. Predict with ``node_cost(..., Links(inter_Bps, inf, alpha, alpha), kappa * n)``."""
    (n0, t0), (n1, t1) = points
    if n0 == n1:
        raise ValueError("fit_emulated: needs two different sizes")
    free = Links(inter_Bps, float("inf"), 0.0, 0.0)
    unit = Links(inter_Bps, float("inf"), 1.0, 1.0)
    y0 = t0 - node_cost(method, n0, nodes, ranks_per_node, free, 0.0, block_size)["total_s"]
    y1 = t1 - node_cost(method, n1, nodes, ranks_per_node, free, 0.0, block_size)["total_s"]
    c = node_cost(method, n0, nodes, ranks_per_node, unit, 0.0, block_size)["latency_s"]  # messages per call
    kappa = max(0.0, (y1 - y0) / (n1 - n0))
    alpha = max(0.0, (y0 - kappa * n0) / c) if c else 0.0
    return dict(alpha_s=alpha, kappa_s=kappa)
