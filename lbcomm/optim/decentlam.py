"""DecentLaM and DmSGD: decentralized momentum SGD, where every rank averages its model with
its neighbours in a sparse graph (`gossip`) instead of averaging gradients over all
ranks (docs/decentlam.md). No DDP: the optimizer communicates itself, one neighbour
exchange of the flat model per step, plus one tiny allreduce (NaN/Inf agreement).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from ..common import error_ratio, ring_allreduce_bytes
from ..config import CommConfig
from ..errors import AveragedGradientsError
from . import agree
from .base import BaseOptimizer
from .flat import FlatLayout
from .gossip import GRAPHS, Gossip, check_graph

__all__ = ["DecentLaM", "DmSGD", "ALGORITHMS", "decentlam_update_", "dmsgd_momentum_"]

ALGORITHMS = ("decentlam", "dmsgd")


# ------------------------------------------------------------------ the update math (flat slices)
def dmsgd_momentum_(m: Tensor, g: Tensor, x: Tensor, beta: float, lr: float, out: Tensor) -> None:
    """DmSGD before the exchange: m <- beta m + g, out = x - lr m (the vector to mix)."""
    m.mul_(beta).add_(g)
    torch.add(x, m, alpha=-lr, out=out)


def decentlam_update_(m: Tensor, x: Tensor, z: Tensor, beta: float, lr: float, out: Tensor) -> None:
    """DecentLaM after the exchange (z = W (x - lr g)): g~ = (x - z) / lr,
    m <- beta m + g~, out = x - lr m (the new model)."""
    gt = torch.sub(x, z).div_(lr)
    m.mul_(beta).add_(gt)
    torch.add(x, m, alpha=-lr, out=out)


class DecentLaM(BaseOptimizer):
    _flat_buffers = ("momentum_buffer",)
    _param_vectors: Dict[str, float] = {}
    _default_algorithm = "decentlam"

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        graph: str = "ring",
        *,
        algorithm: Optional[str] = None,
        compress: bool = False,
        consensus_step: float = 0.5,
        comm: Optional[CommConfig] = None,
        topology: Optional[str] = None,
    ) -> None:
        name = type(self).__name__
        graph = _graph_of(name, graph, topology)
        algorithm = self._default_algorithm if algorithm is None else algorithm
        if algorithm not in ALGORITHMS:
            raise ValueError(f"{name}: unknown algorithm {algorithm!r} (use one of {ALGORITHMS})")
        if graph not in GRAPHS:
            raise ValueError(f"{name}: unknown graph {graph!r} (use one of {GRAPHS})")
        if not isinstance(compress, bool):
            raise ValueError(f"{name}: compress must be a bool, got {compress!r}")
        if compress and algorithm == "decentlam":
            raise ValueError(f"{name}: compress=True diverges with DecentLaM (its momentum takes (x - W y) / lr, so the "
                             "compression error of the mixing is divided by lr and amplified by the momentum: the "
                             "ranks' models drift apart, measured in tests/test_decentlam.py and bench/decentralized.py"
                             "). Use lbcomm.DmSGD(..., compress=True), or DecentLaM uncompressed")
        self.algorithm, self.graph, self.compress = algorithm, graph, compress
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay)
        super().__init__(params, defaults, comm)
        check_graph(graph, self.transport.world_size, name)
        for group in self.param_groups:
            self._check_combination(group)
        self.gossip = Gossip(graph, self.transport, compress, self.comm.block_size, name, consensus_step)
        self._agree_bytes = 0
        self._sent_norm: Optional[Tensor] = None  # compress: norm of the last message, decoded (0-dim)
        self._x: Optional[Tensor] = None
        self._y: Optional[Tensor] = None

    def _validate_group(self, group: Dict[str, Any]) -> None:
        lr = group["lr"]
        if isinstance(lr, Tensor):
            raise ValueError(f"Invalid learning rate: {lr} (a Tensor lr is not supported; use a float)")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if getattr(self, "algorithm", self._default_algorithm) == "decentlam" and lr == 0:
            raise ValueError("Invalid learning rate: 0 (DecentLaM divides by lr: its gradient-like quantity is "
                             "(x - W (x - lr g)) / lr); start a warmup above 0")
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"Invalid momentum value: {group['momentum']} (need 0 <= momentum < 1)")
        if not 0.0 <= group["weight_decay"]:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")

    def _check_combination(self, group: Dict[str, Any]) -> None:
        """DecentLaM's momentum acts on the consensus error too (x <- W x + beta (x - x_prev)
        without gradients), which is stable for a fixed symmetric W (the ring) but diverges
        on the one-peer exponential graph, whose W changes every step and is not symmetric
        beyond 2 ranks: refused rather than left to blow up."""
        if (self.algorithm == "decentlam" and self.graph == "exponential" and self.transport.world_size > 2
                and group["momentum"] > 0):
            raise ValueError(f"{type(self).__name__}: graph='exponential' with momentum > 0 on more than 2 ranks "
                             "is unstable for DecentLaM (its momentum also accelerates the consensus step, which "
                             "diverges when W changes every step and is not symmetric, as the one-peer exponential "
                             "graph's does). Use graph='ring' with DecentLaM, or lbcomm.DmSGD (or momentum=0) on "
                             "the exponential graph")

    def _buffer_names(self) -> tuple:
        return self._flat_buffers + self.gossip.buffer_names()

    # ------------------------------------------------------------------ agreement
    def _check_replicas(self, slots: Tensor, stage: str) -> bool:
        same = agree.replicas_identical(slots)
        if same:
            p, name = self.transport.world_size, type(self).__name__
            raise AveragedGradientsError(
                f"{name}: at step {self._global_step + 1} the gradients are identical on all {p} ranks: something "
                f"(a DistributedDataParallel wrapper, or a DDP communication hook) has already averaged them over "
                f"the ranks. {name} is decentralized: each rank keeps its own model and averages it with its "
                f"neighbours itself, from its local gradients. Do not wrap the model in DistributedDataParallel "
                f"(call the plain module). If every rank really computes the same gradients (the same batch on "
                f"every rank), pass {name}(..., comm=lbcomm.CommConfig(detect_averaged_grads=False)).")
        return same is not None

    def _agree(self, L: FlatLayout, g: Tensor) -> bool:
        """One small allreduce: whether any rank's gradients hold NaN/Inf, with the
        averaged-gradients checksums riding along until that check is decided."""
        tr = self.transport
        probe = self._probe_warmup and self._detecting()
        vec = torch.zeros(1 + (2 * tr.world_size if probe else 0), dtype=torch.float32, device=g.device)
        vec[0] = 0.0 if bool(torch.isfinite(g).all()) else 1.0
        if probe:
            vec[1:] = agree.replica_slots([g], tr.rank, tr.world_size, g.device)
        tr.all_reduce(vec, op="sum")
        self._agree_bytes += int(round(ring_allreduce_bytes(4 * vec.numel(), tr.world_size)))
        if probe and float(vec[0]) == 0.0:
            self._probe_warmup = not self._check_replicas(vec[1:], "decentralized")
        return float(vec[0]) == 0.0

    # ------------------------------------------------------------------ step
    def _flat_of(self, L: FlatLayout, name: str) -> Tensor:
        buf = getattr(self, name)
        if buf is None or buf.numel() != L.total or buf.device != self._device(L):
            buf = torch.empty(L.total, dtype=torch.float32, device=self._device(L))
            setattr(self, name, buf)
        return buf

    def _take_step(self, L: FlatLayout) -> bool:
        if self.algorithm == "decentlam":
            for group in self.param_groups:
                self._validate_group(group)  # an lr set to 0 by a scheduler
                self._check_combination(group)
        # local gradients (zero where a parameter has none) and parameters, flat fp32
        g, x, y = self._flat_of(L, "_grad_buf"), self._flat_of(L, "_x"), self._flat_of(L, "_y")
        for i in range(len(L.params)):
            grad = L.grad(i)
            if grad is not None and grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if grad is None:
                L.view(g, i).zero_()
            else:
                L.view(g, i).copy_(grad)
            L.view(x, i).copy_(L.tensor(i))
        if not self._agree(L, g):
            return self._nonfinite("the gradients")
        m = self._flat["momentum_buffer"]
        ranges = self._ranges(L)
        for group, sl in ranges:
            if group["weight_decay"] != 0:
                g[sl].add_(x[sl], alpha=group["weight_decay"])
            if self.algorithm == "dmsgd":  # m <- beta m + g; y = x - lr m
                dmsgd_momentum_(m[sl], g[sl], x[sl], group["momentum"], group["lr"], out=y[sl])
            else:  # y = x - lr g
                torch.add(x[sl], g[sl], alpha=-group["lr"], out=y[sl])
        estimates = {n: self._flat[n] for n in self.gossip.buffer_names()}
        if self.compress:  # the message is y - x^ with RMS block scales: decoded, it has that difference's norm
            out = self.gossip.neighbours(self._global_step).out_channel
            self._sent_norm = torch.dist(y, estimates[f"sent_estimate_{out}"])
        z = self.gossip.exchange(y, self._global_step, estimates)()  # z = W y
        if self.algorithm == "decentlam":
            for group, sl in ranges:
                decentlam_update_(m[sl], x[sl], z[sl], group["momentum"], group["lr"], out=y[sl])
            new = y
        else:
            new = z  # x <- W (x - lr m)
        for i in range(len(L.params)):
            L.tensor(i).copy_(L.view(new, i))
        return True

    def _ranges(self, L: FlatLayout) -> List[tuple]:
        return [(self.param_groups[gi], slice(lo, hi)) for gi, _, _, lo, hi in L.group_ranges]

    # ------------------------------------------------------------------ stats and checkpoints
    def compression_stats(self) -> Dict[str, Any]:
        """This rank's communication so far (`lbcomm.common.STATS_KEYS`): neighbour
        exchanges (compressed or not), steps skipped for NaN/Inf, the bytes sent (the
        exchanges and the agreement allreduce), the norm of what the compressed estimate
        still misses and ``error_ratio``, that norm over the norm of the last message sent,
        decoded (0 without compression, and before the first compressed exchange of this
        process)."""
        gs = self.gossip
        sent = 0.0 if self._sent_norm is None else float(self._sent_norm)
        return {"compressed_calls": gs.calls, "skipped_calls": self.skipped_steps,
                "bytes_sent": gs.bytes_sent + self._agree_bytes, "error_norm": gs.error_norm,
                "error_ratio": error_ratio(gs.error_norm, sent)}

    def bytes_per_step(self) -> int:
        """Bytes this rank sends per step for the current layout: its neighbour messages
        (and not the small agreement allreduce)."""
        L = self._layout if self._layout is not None else self._prepare()
        return len(self.gossip.neighbours(self._global_step).sends) * self.gossip.message_bytes(L.total)

    def _extra_state(self) -> Dict[str, Any]:
        extra = super()._extra_state()
        tr = self.transport
        # "topology": the graph (the key of 0.2's checkpoints)
        extra["decentralized"] = {"algorithm": self.algorithm, "topology": self.graph, "compress": self.compress,
                                  "world_size": tr.world_size, "rank": tr.rank, "probe": self._probe_warmup}
        return extra

    def _load_extra_state(self, saved, extra: Dict[str, Any]) -> None:
        name, tr = type(self).__name__, self.transport
        d = extra.get("decentralized")
        if d is None:
            raise ValueError(f"{name}.load_state_dict: the state dict was not saved by a decentralized optimizer; load "
                             "it into the optimizer class that saved it")
        mine = {"algorithm": self.algorithm, "topology": self.graph, "compress": self.compress,
                "world_size": tr.world_size, "rank": tr.rank}
        wrong = {k: (d[k], v) for k, v in mine.items() if d[k] != v}
        if wrong:
            desc = ", ".join(f"{k} {a!r} saved, {b!r} now" for k, (a, b) in wrong.items())
            raise ValueError(f"{name}.load_state_dict: the state belongs to another setup ({desc}); each rank's "
                             "momentum (and compressed estimates) belong to its place in the graph: resume with "
                             "the same world size, rank, graph and options")
        super()._load_extra_state(saved, extra)
        self._probe_warmup = bool(d["probe"])
        self._sent_norm = None  # the last message belongs to the estimates just replaced


class DmSGD(DecentLaM):
    """Decentralized momentum SGD (DmSGD), the baseline of `DecentLaM`:
    m <- beta m + g, x <- W (x - lr m). Same arguments as `DecentLaM` but `algorithm`."""

    _default_algorithm = "dmsgd"

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, graph: str = "ring",
                 *, compress: bool = False, consensus_step: float = 0.5, comm: Optional[CommConfig] = None,
                 topology: Optional[str] = None) -> None:
        super().__init__(params, lr, momentum, weight_decay, _graph_of(type(self).__name__, graph, topology),
                         algorithm="dmsgd", compress=compress, consensus_step=consensus_step, comm=comm)


def _graph_of(who: str, graph: str, topology: Optional[str]) -> str:
    """The gossip graph: `graph`, or 0.2's name for it, ``topology=`` (a FutureWarning: it
    is not `CommConfig.topology`, the node layout)."""
    if topology is None:
        return graph
    if graph != "ring":
        raise TypeError(f"{who}: pass the gossip graph as graph= only (topology= is its 0.2 name)")
    warnings.warn(f"{who}(topology={topology!r}) is graph={topology!r} now (topology is CommConfig's node layout)",
                  FutureWarning, stacklevel=3)
    return topology


DecentLaM.__doc__ = r"""Implements DecentLaM (decentralized large-batch momentum SGD, Yuan et
    al. 2021) and, with ``algorithm="dmsgd"`` (or `lbcomm.DmSGD`), its baseline DmSGD.

    Each rank i keeps its own model x_i and momentum m_i and averages with its neighbours only:
    W is the graph's doubly stochastic mixing matrix (``"ring"``: the two neighbours, weight
    1/3 each; ``"exponential"``: the one-peer exponential graph, one peer per step, weight 1/2,
    the peer changing every step, see `lbcomm.optim.gossip`; DecentLaM with momentum refuses
    it beyond 2 ranks, where it diverges), applied to the flat model with
    one point-to-point exchange per step. With g_i the local gradient (plus weight decay
    lambda x_i, as torch.optim.SGD adds it):

    .. math::
       \begin{aligned}
            &\textbf{DmSGD}: \quad m_i \leftarrow \beta m_i + g_i, \qquad
                x_i \leftarrow \textstyle\sum_j w_{ij} (x_j - \gamma m_j)                       \\
            &\textbf{DecentLaM}: \quad \tilde g_i \leftarrow \tfrac{1}{\gamma}\big(x_i -
                \textstyle\sum_j w_{ij} (x_j - \gamma g_j)\big), \quad
                m_i \leftarrow \beta m_i + \tilde g_i, \quad x_i \leftarrow x_i - \gamma m_i
       \end{aligned}

    DmSGD applies the momentum before the mixing, so the rank-to-rank inconsistency of the
    gradients is amplified by the momentum (a bias of order gamma / (1 - beta) that grows with
    the batch's lr). DecentLaM feeds the momentum with g~ = W g + (I - W) x / gamma, the
    gradient the mixed model implies: at beta = 0 both are decentralized SGD
    (x <- W (x - gamma g)), and DecentLaM's fixed point does not carry DmSGD's momentum bias.

    Per step: one neighbour exchange of the flat fp32 model (ring: 2 messages per rank;
    exponential: 1), and one allreduce of a few floats in which every rank reports NaN/Inf in
    its gradients (then every rank skips the step or raises, ``comm.nonfinite``) and, until
    decided, a checksum of its gradients: identical gradients on every rank mean a DDP has
    averaged them, which raises `lbcomm.errors.AveragedGradientsError` (do not wrap the model
    in DistributedDataParallel).

    ``compress=True`` (experimental, DmSGD only: with DecentLaM it diverges, refused): the
    exchanged vectors are sent as 1-bit signs with one
    RMS scale per ``comm.block_size`` elements, error feedback through an estimate per link
    that both ends keep, mixed in with the step ``consensus_step`` (CHOCO-SGD's scheme, see
    `lbcomm.optim.gossip`; one model-sized buffer per channel: 3 for the ring, 2 log2(n) for
    the exponential graph). W is then in effect (1 - c) I + c W.

    A parameter without a gradient at a step takes a zero gradient (it keeps being mixed, its
    momentum keeps decaying), unlike torch.optim.SGD, which leaves it alone. fp16/bf16
    parameters are updated through fp32 copies (the momentum is fp32).

    Args:
        params (iterable): parameters or named parameters, or param group dicts
        lr (float): learning rate gamma (> 0 for DecentLaM, which divides by it)
        momentum (float, optional): beta (default: 0.9)
        weight_decay (float, optional): L2 penalty added to the gradient (default: 0)
        graph (str, optional): the gossip graph, ``"ring"`` or ``"exponential"`` (0.2 named
            it ``topology``, still accepted with a FutureWarning) (default: "ring")
        algorithm (str, optional): ``"decentlam"`` or ``"dmsgd"`` (default: "decentlam")
        compress (bool, optional): 1-bit compression of the exchanged vectors, DmSGD only
            (default: False)
        consensus_step (float, optional): with compress, the share c in (0, 1] of the
            neighbours' compressed estimates mixed in per step; 1 diverges (default: 0.5)
        comm (lbcomm.CommConfig, optional): ``process_group`` / ``backend`` (the ranks that
            form the graph), ``block_size`` (compression), ``nonfinite`` and
            ``detect_averaged_grads`` (default: CommConfig())

    Example::

        >>> # xdoctest: +SKIP
        >>> optimizer = lbcomm.DecentLaM(model.parameters(), lr=0.1, momentum=0.9, graph="ring")
        >>> loss_fn(model(local_batch), target).backward()   # the plain model, no DDP
        >>> optimizer.step()
    """
