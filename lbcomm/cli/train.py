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

Compression starts early (PowerSGD's ``start_powerSGD_iter`` and onebit_hook's
``start_iter`` are 2, OneBitAdam's ``freeze_step`` is ``warmup - 2``: frozen after only
2 steps its variance estimate is too poor and the loss oscillates within 10 steps) and
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

__all__ = ["METHODS", "STATS_METHODS", "TinyLM", "MODEL_PRESETS", "MIN_WARMUP_STEPS", "run_rank", "describe_model"]

METHODS = ("none", "ddp", "fp16", "powersgd", "onebit_hook", "onebit_adam")
# Not run by default: ``ddp`` and ``onebit_adam`` with lbcomm.stats' gradient statistics (the
# noise scale), to measure what the statistics cost: DDP's allreduce wrapped in
# ``lbcomm.stats.stats_hook`` (exact), and OneBitAdam's ``gradient_stats`` (a coordinate
# sample in its compression stage); ``ddp_hook`` is DDP with torch's Python allreduce_hook
# alone, the baseline of ``ddp_stats``.
STATS_METHODS = ("ddp_hook", "ddp_stats", "onebit_adam_stats")
COMPRESSION_START = 2  # PowerSGD's start_powerSGD_iter and onebit_hook's start_iter (DDP needs > 1)
# Untimed steps so that every method is in its compressed stage when timing starts.
MIN_WARMUP_STEPS = COMPRESSION_START + 2

# name -> (vocab, d_model, layers, heads, seq_len, batch per rank). "small" (13.8M parameters,
# 32 tokens per rank and step) is the communication-bound regime of the published clusters
# on a 2-core machine emulating 4 ranks: its fp32 gradient allreduce at 1 Gbit/s is about
# 80 % of a DDP + AdamW step. "tiny" is for tests.
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


class _Setup:
    """One method: its model, optimizer and one training step."""

    def __init__(self, method: str, cfg: Dict[str, int], device: torch.device, lr: float, freeze_step: int):
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)  # identical initial weights on every rank and for every method
        model = TinyLM(cfg["vocab"], cfg["d_model"], cfg["layers"], cfg["heads"], cfg["seq_len"] + 1).to(device)
        self.method = method
        self.hook_state = None
        fused = dict(fused=True) if device.type in ("cpu", "cuda") else {}
        if method == "none":
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=lr, **fused)
            return
        if method in ("onebit_adam", "onebit_adam_stats"):
            # The optimizer does all the communication itself (averaged gradients in the
            # warmup, one compressed allreduce of the momentum after it), as in its docstring;
            # DDP would only add bucket copies in the compression stage.
            from ..optim import OneBitAdam

            self.model = model
            self.opt = OneBitAdam(model.parameters(), lr=lr, freeze_step=freeze_step)
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
        elif method == "onebit_hook":
            from ..ddp import OneBitHookState, onebit_hook

            self.hook_state = OneBitHookState(process_group=None, start_iter=COMPRESSION_START)
            ddp.register_comm_hook(self.hook_state, onebit_hook)
        elif method == "ddp_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif method == "ddp_stats":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            from ..stats import GradientNoiseScale, StatsHookState, stats_hook

            self.hook_state = StatsHookState(GradientNoiseScale(cfg["batch"], log_every=0),
                                             default_hooks.allreduce_hook, None, exact=True)
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
        if self.method.startswith("onebit_adam") and not self.opt.frozen:
            raise RuntimeError("onebit_adam: OneBitAdam is not in its compression stage; raise --warmup-steps")


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
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") if params.get("netem") else None

    labels = ([f"warmup {m}" for m in methods] + [f"round {r + 1}/{rounds} {m}" for r in range(rounds) for m in methods]
              + ["fp32 allreduce alone"])
    progress = progress_factory(len(labels), 1, lambda i: labels[i]) if progress_factory else (lambda: None)
    setups: Dict[str, _Setup] = {}
    for m in methods:
        setups[m] = _Setup(m, cfg, device, params["lr"], max(COMPRESSION_START, warmup - 2))
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
        transport.all_reduce(nb, op="max")
        rows.append(dict(method=m, median_s=med, p10_s=p10, p90_s=p90,
                         samples_per_s=p * cfg["batch"] / med,
                         tokens_per_s=p * cfg["batch"] * cfg["seq_len"] / med,
                         wire_bytes_per_step=(nb.item() / len(times[m])) if ifname else None,
                         final_loss=losses.get(m)))
    base = {r["method"]: r["median_s"] for r in rows}.get("ddp")
    for r in rows:
        r["speedup_vs_ddp"] = base / r["median_s"] if base else None
    return dict(rows=rows, params=nparams, allreduce_s=ar["median_s"], world_size=p)


def describe_model(cfg: Dict[str, int], nparams: int) -> str:
    return (f"TinyLM: vocab {cfg['vocab']}, d_model {cfg['d_model']}, {cfg['layers']} layers, {cfg['heads']} heads, "
            f"seq_len {cfg['seq_len']}, batch {cfg['batch']} per rank; {nparams / 1e6:.2f}M parameters "
            f"({4 * nparams / 2**20:.1f} MiB of fp32 gradients)")
