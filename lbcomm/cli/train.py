"""Data-parallel training-step throughput of a small transformer LM, one rank's side.

Every method trains the same model from the same initial weights on the same random
token batches (each rank its own shard); what differs is how the gradients or momenta
cross the network:

==============  ====================================================================
``none``        no communication at all (each rank trains alone): the compute floor
``ddp``         DDP's default bucketed fp32 allreduce + AdamW (fused)
``fp16``        DDP + torch's ``fp16_compress_hook`` + AdamW
``powersgd``    DDP + torch's ``powerSGD_hook`` (rank 4, error feedback) + AdamW; one DDP
                bucket on CPU (see `_Setup`: with gloo and several buckets its
                callbacks issue collectives in rank-dependent order)
``onebit_hook`` DDP + ``lbcomm.ddp.onebit_hook`` (1-bit gradients) + AdamW
``onebit_adam`` ``lbcomm.OneBitAdam`` doing its own communication (no DDP, as in its
                docstring), timed in its compression stage: one 1-bit allreduce of
                the momentum per step
==============  ====================================================================

On emulated nodes (``--nodes N --ranks-per-node G``, G > 1; a 2-D DeviceMesh ("node",
"local") of N x G ranks) there are also:

====================  ==============================================================
``onebit_hook_hier``  DDP + ``onebit_hook`` with ``Topology.from_mesh(mesh)``: each bucket
                      averaged in fp32 inside the node, 1 bit between nodes (lbcomm.topology)
``hsdp``              plain HSDP: FSDP2 ``fully_shard`` on the 2-D mesh (parameters
                      sharded inside the node, gradient shards all-reduced in fp32
                      across nodes by FSDP itself) + AdamW
``hsdp_onebit``       FSDP2 sharded inside the node (``mesh["local"]``) +
                      ``lbcomm.fsdp.onebit_hsdp`` (gradient shards averaged across nodes
                      by the 1-bit compressed allreduce) + AdamW
``hsdp_onebit_published`` the same with the published rule (``normalize=None,
                      exact_numel=0``), to measure what the defaults cost (not by default)
``fsdp_onebit_adam``  FSDP2 sharded inside the node + ``lbcomm.fsdp.onebit_optimizer``
                      (OneBitAdam on the local shards: fp32 across nodes in the warmup,
                      its momentum shard 1-bit across nodes after the freeze)
====================  ==============================================================

The FSDP methods wrap every transformer block and the root (`_shard`). Their AdamW is
torch's default (foreach) implementation on the sharded DTensor parameters; the DDP
methods use the fused one. The bytes that crossed the links between nodes are read from
each node's interface counter (LBCOMM_NODE_IFACE; the ranks of a node talk over its
loopback, which the counter does not see).

Compression starts early (PowerSGD's ``start_powerSGD_iter`` and onebit_hook's
``start_iter`` are 2, OneBitAdam's ``freeze_step`` is ``warmup - 2``: frozen after only
2 steps its variance estimate is too poor and the loss oscillates) and
every method runs ``warmup`` untimed steps first, so only the steady compressed stage is
timed. All methods are built up front and timed in interleaved rounds (a few steps of
each, in turn), so that load drift on a shared machine hits them alike. Each step is timed on every rank
between barriers; a step's time is the slowest rank's.
"""
from __future__ import annotations

import gc
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["METHODS", "FLAT_METHODS", "NODE_METHODS", "DEFAULT_NODE_METHODS", "STATS_METHODS", "TinyLM",
           "MODEL_PRESETS", "MIN_WARMUP_STEPS", "run_rank", "describe_model"]

FLAT_METHODS = ("none", "ddp", "fp16", "powersgd", "onebit_hook", "onebit_adam")
# Methods that need nodes (--ranks-per-node > 1).
NODE_METHODS = ("onebit_hook_hier", "hsdp", "hsdp_onebit", "fsdp_onebit_adam", "hsdp_onebit_published")
METHODS = FLAT_METHODS + NODE_METHODS
DEFAULT_NODE_METHODS = ("ddp", "onebit_hook", "onebit_hook_hier", "hsdp", "hsdp_onebit", "fsdp_onebit_adam")
# Not run by default: ``ddp`` and ``onebit_adam`` with lbcomm.stats' gradient statistics (the
# noise scale), to measure what the statistics cost: DDP's allreduce wrapped in
# ``lbcomm.stats.stats_hook`` (exact; ``ddp_stats_sample``: a coordinate sample), and OneBitAdam's
# ``gradient_stats`` (a coordinate sample in its compression stage); ``ddp_hook`` is DDP with
# torch's Python allreduce_hook alone, the baseline of ``ddp_stats``.
# Also not by default: the published rules of the compression stage, to measure what the
# robust defaults cost: ``onebit_hook_published`` (normalize=None, exact_numel=0)
# against ``onebit_hook`` (normalize="warmup", exact_numel=4096), ``onebit_adam_published``
# (max_update=None, exact_numel=0, rescale_variance=False) against ``onebit_adam``
# (max_update=1.0, exact_numel=4096, rescale_variance=True).
STATS_METHODS = ("ddp_hook", "ddp_stats", "ddp_stats_sample", "onebit_adam_stats",
                 "onebit_hook_published", "onebit_adam_published")
# OneBitAdam doing its own communication (checked to be in its compression stage when timed).
ONEBIT_ADAM_METHODS = ("onebit_adam", "onebit_adam_stats", "onebit_adam_published")
COMPRESSION_START = 2  # PowerSGD's start_powerSGD_iter and onebit_hook's start_iter (DDP needs > 1)
# Untimed steps so that every method is in its compressed stage when timing starts.
MIN_WARMUP_STEPS = COMPRESSION_START + 2

# name -> (vocab, d_model, layers, heads, seq_len, batch per rank). "small" (13.8M parameters,
# 32 tokens per rank and step) is the communication-bound regime of the published clusters:
# many parameters and little compute per step, so that at 1 Gbit/s the fp32 gradient
# allreduce dominates a DDP + AdamW step even with a few ranks on one small machine.
# "tiny" is for tests.
MODEL_PRESETS: Dict[str, Dict[str, int]] = {
    "tiny": dict(vocab=512, d_model=64, layers=2, heads=2, seq_len=16, batch=2),
    "small": dict(vocab=8192, d_model=384, layers=6, heads=6, seq_len=32, batch=1),
}


class TinyLM(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm transformer blocks with a
    causal mask, a final LayerNorm and an output head tied to the token embedding."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of a [batch, seq_len] token tensor."""
        s = tokens.shape[1] - 1
        h = self.tok(tokens[:, :-1]) + self.pos[:s]
        h = self.norm(self.blocks(h, mask=self.mask[:s, :s], is_causal=True))
        logits = h @ self.tok.weight.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _shard(model: TinyLM, mesh) -> None:
    """FSDP2 on `mesh` (1-D: inside the node; 2-D: HSDP): every block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class _Setup:
    """One method: its model, optimizer and one training step. `mesh`: the 2-D
    ("node", "local") DeviceMesh of emulated nodes (the node methods need it)."""

    def __init__(self, method: str, cfg: Dict[str, int], device: torch.device, lr: float, freeze_step: int,
                 mesh=None):
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)  # identical initial weights on every rank and for every method
        model = TinyLM(cfg["vocab"], cfg["d_model"], cfg["layers"], cfg["heads"], cfg["seq_len"] + 1).to(device)
        self.method = method
        self.hook_state = None
        fused = dict(fused=True) if device.type in ("cpu", "cuda") else {}
        if method in NODE_METHODS and mesh is None:
            raise ValueError(f"{method} needs emulated nodes: --nodes N --ranks-per-node G with G > 1")
        if method in ("hsdp", "hsdp_onebit", "hsdp_onebit_published"):
            _shard(model, mesh if method == "hsdp" else mesh["local"])
            if method != "hsdp":
                from ..fsdp import onebit_hsdp

                from ..config import CommConfig

                published = dict(normalize=None, comm=CommConfig(exact_numel=0)) \
                    if method == "hsdp_onebit_published" else {}
                self.hook_state = onebit_hsdp(model, mesh, start_iter=COMPRESSION_START, **published)
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
            return
        if method == "fsdp_onebit_adam":
            from ..fsdp import onebit_optimizer
            from ..optim import OneBitAdam

            _shard(model, mesh["local"])
            self.model = model
            self.opt = onebit_optimizer(model, mesh, OneBitAdam, lr=lr, freeze_step=freeze_step)
            return
        if method == "none":
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=lr, **fused)
            return
        if method in ONEBIT_ADAM_METHODS:
            # The optimizer does all the communication itself (averaged gradients in the
            # warmup, one compressed allreduce of the momentum after it), as in its docstring;
            # DDP would only add bucket copies in the compression stage.
            from ..config import CommConfig, OneBitOptions
            from ..optim import OneBitAdam

            self.model = model
            published = (dict(comm=CommConfig(exact_numel=0), options=OneBitOptions(max_update=None, rescale_variance=False))
                         if method == "onebit_adam_published" else {})
            self.opt = OneBitAdam(model.parameters(), lr=lr, freeze_step=freeze_step, **published)
            if method == "onebit_adam_stats":
                from ..stats import GradientNoiseScale

                self.opt.gradient_stats = GradientNoiseScale(cfg["batch"], log_every=0)
            return
        # PowerSGD issues its second and third allreduce from future callbacks; with gloo those
        # run on gloo's threads, and with two or more buckets the ranks can issue them in
        # different orders (a collective mismatch or a hang). One bucket keeps it in order.
        one_bucket = dict(bucket_cap_mb=1 << 16) if method == "powersgd" and device.type == "cpu" else {}
        ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, **one_bucket)
        self.opt = torch.optim.AdamW(ddp.parameters(), lr=lr, **fused)
        if method == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            self.hook_state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                          start_powerSGD_iter=COMPRESSION_START)
            ddp.register_comm_hook(self.hook_state, powerSGD_hook.powerSGD_hook)
        elif method in ("onebit_hook", "onebit_hook_hier", "onebit_hook_published"):
            from ..ddp import OneBitHookState, onebit_hook

            from ..config import CommConfig

            topology = "flat"
            if method == "onebit_hook_hier":  # the mesh's nodes (also over loopback, where no LOCAL_WORLD_SIZE says)
                from ..topology import Topology

                topology = Topology.from_mesh(mesh)
            published = method == "onebit_hook_published"
            self.hook_state = OneBitHookState(COMPRESSION_START, **(dict(normalize=None) if published else {}),
                                              comm=CommConfig(topology=topology, exact_numel=0 if published else 4096))
            ddp.register_comm_hook(self.hook_state, onebit_hook)
        elif method == "ddp_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif method in ("ddp_stats", "ddp_stats_sample"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            from ..stats import GradientNoiseScale, StatsHookState, stats_hook

            self.hook_state = StatsHookState(GradientNoiseScale(cfg["batch"], log_every=0),
                                             default_hooks.allreduce_hook, None, exact=method == "ddp_stats")
            ddp.register_comm_hook(self.hook_state, stats_hook)
        elif method != "ddp":
            raise ValueError(f"unknown training method {method!r}; choose from {METHODS + STATS_METHODS}")
        self.model = ddp

    def step(self, tokens: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(tokens)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def check_stage(self) -> None:
        """Fail loudly if a method is not in the stage we mean to time."""
        if self.method in ONEBIT_ADAM_METHODS + ("fsdp_onebit_adam",) and not self.opt.frozen:
            raise RuntimeError(f"{self.method}: OneBitAdam is not in its compression stage; raise --warmup-steps")


def _tx_bytes(ifname: Optional[str]) -> Optional[int]:
    """Bytes sent so far on this namespace's interface (measured, headers included)."""
    if not ifname:
        return None
    try:
        with open("/proc/net/dev") as f:  # per network namespace
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == ifname:
                    return int(rest.split()[8])
    except (OSError, ValueError, IndexError):
        pass
    return None


def run_rank(params: Dict, transport, device: torch.device, progress_factory: Callable = None) -> Dict:
    """Time every method on this rank; returns the rows (slowest rank's step times) on all ranks."""
    from .allreduce import measure, quantiles

    cfg = dict(params["model"])
    methods: Sequence[str] = params["methods"]
    steps, rounds, warmup = params["steps"], params["rounds"], params["warmup_steps"]
    if warmup < MIN_WARMUP_STEPS:
        raise ValueError(f"--warmup-steps must be >= {MIN_WARMUP_STEPS} so that every method is in its "
                         "compressed stage when timing starts")
    p, rank = transport.world_size, transport.rank
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq_len"] + 1), generator=gen).to(device)
               for _ in range(8)]
    G = params.get("ranks_per_node", 1) or 1
    # Bytes sent: each rank's own interface (one namespace per rank), or with nodes each
    # node's link (LBCOMM_NODE_IFACE), read by the node's local rank 0.
    ifname = None
    if params.get("netem"):
        ifname = os.environ.get("LBCOMM_NODE_IFACE") if G > 1 else os.environ.get("GLOO_SOCKET_IFNAME")
        if G > 1 and rank % G:
            ifname = None
    mesh = None
    if G > 1:
        from torch.distributed.device_mesh import init_device_mesh

        if p % G:
            raise ValueError(f"--ranks-per-node {G} does not divide the world size {p}")
        mesh = init_device_mesh(device.type, (p // G, G), mesh_dim_names=("node", "local"))

    labels = ([f"warmup {m}" for m in methods] + [f"round {r + 1}/{rounds} {m}" for r in range(rounds) for m in methods]
              + ["fp32 allreduce alone"])
    progress = progress_factory(len(labels), 1, lambda i: labels[i]) if progress_factory else (lambda: None)
    setups: Dict[str, _Setup] = {}
    for m in methods:
        setups[m] = _Setup(m, cfg, device, params["lr"], max(COMPRESSION_START, warmup - 2), mesh)
        for i in range(warmup):
            setups[m].step(batches[i % len(batches)])
        setups[m].check_stage()
        progress()
    nparams = sum(q.numel() for q in setups[methods[0]].model.parameters())

    times: Dict[str, List[float]] = {m: [] for m in methods}
    sent: Dict[str, int] = {m: 0 for m in methods}
    losses: Dict[str, float] = {}
    k = 0
    for _ in range(rounds):
        for m in methods:
            for _ in range(steps):
                tokens = batches[k % len(batches)]
                k += 1
                transport.barrier()
                tx0 = _tx_bytes(ifname)
                t0 = time.perf_counter()
                losses[m] = setups[m].step(tokens)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                tx1 = _tx_bytes(ifname)
                times[m].append(dt)
                if tx0 is not None and tx1 is not None:
                    sent[m] += tx1 - tx0
            progress()
    profiles = {}
    if params.get("profile"):  # rank 0's operators per step, after the timed rounds (bench/train_profile.py)
        from .allreduce import _profile

        for m in methods:
            batch = iter(batches * (steps // len(batches) + 1))
            profiles[m] = _profile(lambda: setups[m].step(next(batch)), steps, transport, top=20)
    del setups
    gc.collect()

    # The regime: the fp32 allreduce of all gradients alone, in the same cluster.
    ar = measure([nparams], ["fp32"], iters=params.get("allreduce_iters", 3), warmup=1, device=str(device),
                 transport=transport)[0]
    progress()
    if hasattr(progress, "close"):
        progress.close()

    rows = []
    for m in methods:
        t = torch.tensor(times[m], dtype=torch.float64)
        transport.all_reduce(t, op="max")
        med, p10, p90 = quantiles(t.tolist())
        nb = torch.tensor([float(sent[m])], dtype=torch.float64)
        # one namespace per rank: the busiest rank; nodes: the sum over the node links
        transport.all_reduce(nb, op="sum" if G > 1 else "max")
        counted = bool(params.get("netem"))
        rows.append(dict(method=m, median_s=med, p10_s=p10, p90_s=p90,
                         samples_per_s=p * cfg["batch"] / med,
                         tokens_per_s=p * cfg["batch"] * cfg["seq_len"] / med,
                         wire_bytes_per_step=(nb.item() / len(times[m])) if counted and G == 1 else None,
                         inter_node_bytes_per_step=(nb.item() / len(times[m])) if counted and G > 1 else None,
                         final_loss=losses.get(m)))
    medians = {r["method"]: r["median_s"] for r in rows}
    for r in rows:
        for base in ("ddp", "hsdp"):
            r[f"speedup_vs_{base}"] = medians[base] / r["median_s"] if base in medians else None
    out = dict(rows=rows, params=nparams, allreduce_s=ar["median_s"], world_size=p)
    if profiles:
        out["profiles"] = profiles
    return out


def describe_model(cfg: Dict[str, int], nparams: int) -> str:
    return (f"TinyLM: vocab {cfg['vocab']}, d_model {cfg['d_model']}, {cfg['layers']} layers, {cfg['heads']} heads, "
            f"seq_len {cfg['seq_len']}, batch {cfg['batch']} per rank; {nparams / 1e6:.2f}M parameters "
            f"({4 * nparams / 2**20:.1f} MiB of fp32 gradients)")
