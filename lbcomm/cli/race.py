"""`lbcomm-bench race`, one rank's side: wall-clock time to a target validation loss.

A byte-level `TinyLM` (vocabulary 256) learns the Python standard library's source: its
``.py`` files sorted by path, every 10th file held out for validation (held out by file,
as bench/convergence.py does). Every method (racemethods.py) starts from the same weights
and sees the same samples: step k of rank r takes the same sequences for every method.

``ddp`` (DDP + AdamW) runs first, for ``steps`` steps; its validation loss after them is
the target (unless a target is given). Every other method then trains until it reaches
the target and its clock has passed DDP's time (so that its loss at DDP's wall-clock time
is known), or until its clock reaches the cap.

The clock counts every training step — warmups, syncs, quorums, compression stages — as
the slowest rank's time; it is paused for the validation loss, measured every
``eval_every`` steps (local-update methods: at the first sync at or after that step, when
the ranks hold one model), on a fixed held-out set split over the ranks. Bytes per rank
are read from each rank's interface counter over the clocked time only (the busiest
rank's), as `train` does.
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Dict, List, Optional

import torch

from .racemethods import Method
from .train import TinyLM, _tx_bytes

__all__ = ["load_corpus", "Data", "run_rank", "lr_at", "VOCAB"]

VOCAB = 256  # bytes


def load_corpus(train_bytes: int, val_bytes: int):
    """The standard library's .py files (tests and site-packages left out), sorted by path;
    every 10th file is held out for validation. Returns two uint8 tensors."""
    root = os.path.dirname(os.__file__)
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__", "test", "tests", "idle_test"))
        files += [os.path.join(d, f) for f in sorted(names) if f.endswith(".py")]
    parts: Dict[bool, List[bytes]] = {True: [], False: []}
    have = {True: 0, False: 0}
    for i, path in enumerate(files):
        held_out = i % 10 == 0
        if have[held_out] >= (val_bytes if held_out else train_bytes):
            continue
        with open(path, "rb") as f:
            data = f.read()
        parts[held_out].append(data)
        have[held_out] += len(data)
    if have[False] < train_bytes or have[True] < val_bytes:
        raise RuntimeError(f"the standard library under {root} holds too little source ({have[False]} training and "
                           f"{have[True]} held-out bytes) for the race")
    return tuple(torch.frombuffer(bytearray(b"".join(parts[k])), dtype=torch.uint8).long() for k in (False, True))


class Data:
    """Global batches by step number: step k's batch is drawn from a generator seeded with
    k, so every method sees the same sequences; rank r takes its share."""

    def __init__(self, cfg: Dict, rank: int, world: int, seed: int, val_seqs: int, corpus=None):
        # corpus: load_corpus's result, when the caller holds it already
        self.train, val = corpus if corpus is not None else load_corpus(cfg["train_bytes"], cfg["val_bytes"])
        self.length, self.batch, self.rank, self.world, self.seed = cfg["seq_len"] + 1, cfg["batch"], rank, world, seed
        g = torch.Generator().manual_seed(10**6 + seed)
        starts = torch.randint(0, val.numel() - self.length, (val_seqs,), generator=g)
        mine = starts[rank::world]  # this rank's share of the held-out set
        self.val = torch.stack([val[s:s + self.length] for s in mine.tolist()])
        self.val_total = val_seqs

    def batch_at(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.train.numel() - self.length, (self.world * self.batch,), generator=g)
        mine = starts[self.rank * self.batch:(self.rank + 1) * self.batch]
        return torch.stack([self.train[s:s + self.length] for s in mine.tolist()])


def lr_at(step: int, lr: float, warmup: int, schedule: str = "constant", total: int = 0) -> float:
    """Linear warmup over `warmup` steps, then constant, or ("cosine") a cosine decay to a
    tenth of `lr` at step `total` (ddp's budget) that stays there for methods that race on
    past it. The same for every method at the same step."""
    if schedule == "constant" or step < warmup:
        return lr * min(1.0, (step + 1) / max(1, warmup))
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Data, transport, chunk: int = 64) -> float:
    """Mean loss over the whole held-out set (each rank its share, summed over the ranks)."""
    total = torch.zeros(2, dtype=torch.float64)
    for i in range(0, data.val.shape[0], chunk):
        part = data.val[i:i + chunk]
        total[0] += float(model(part)) * part.shape[0]
        total[1] += part.shape[0]
    transport.all_reduce(total, op="sum")
    return float(total[0] / total[1])


def _model(cfg: Dict) -> TinyLM:
    torch.manual_seed(0)  # identical initial weights on every rank and for every method
    return TinyLM(VOCAB, cfg["d_model"], cfg["layers"], cfg["heads"], cfg["seq_len"] + 1)


def _slowest(transport, *values: float) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64)
    transport.all_reduce(t, op="max")
    return t.tolist()


def race_one(run: Dict, params: Dict, data: Data, transport, device, ddp_time: Optional[float],
             target: Optional[float], ifname: Optional[str], say) -> Dict:
    """Train one method (run: label, family, sync_every) until it stops; its curve of
    (step, clocked seconds, validation loss, bytes per rank)."""
    cfg = params["model"]
    model = _model(cfg).to(device)
    method = Method(run["family"], model, lr=params["lr"], outer_lr=params["outer_lr"],
                    outer_momentum=params["outer_momentum"], overlap=params.get("local_overlap", 0),
                    block_size=params["local_block_size"], warmup=params["warmup"],
                    freeze_step=params["freeze_step"], sync_every=run.get("sync_every"), transport=transport,
                    device=device)
    every, budget = params["eval_every"], params["steps"]
    is_baseline = target is None
    cap = params["time_cap_s"] if is_baseline else min(params["time_cap_s"], params["cap_factor"] * (ddp_time or
                                                                                                   math.inf))
    max_steps = budget if is_baseline else params["max_steps"]
    clock, sent, step = 0.0, 0.0, 0
    curve = [dict(step=0, time_s=0.0, val_loss=evaluate(model, data, transport), bytes_per_rank=0.0)]
    reached = None
    counted = ifname is not None
    try:
        while True:
            goal = min(max_steps, (step // every + 1) * every)
            transport.barrier()
            tx0, t0 = _tx_bytes(ifname), time.perf_counter()
            while True:
                method.step(data.batch_at(step), lr_at(step, params["lr"], params["warmup"],
                                                       params.get("schedule", "constant"), params["steps"]))
                step += 1
                if step >= max_steps or (step >= goal and method.synced(step)):
                    break
            dt, tx1 = time.perf_counter() - t0, _tx_bytes(ifname)
            dt, nb = _slowest(transport, dt, float(tx1 - tx0) if counted else 0.0)
            clock, sent = clock + dt, sent + nb
            with method.evaluated():
                loss = evaluate(method.module, data, transport)
            curve.append(dict(step=step, time_s=clock, val_loss=loss, bytes_per_rank=sent if counted else None))
            say(f"{run['label']}: step {step}, {clock:.1f} s, val loss {loss:.4f}")
            if not math.isfinite(loss):
                break
            if target is not None and reached is None and loss <= target:
                reached = curve[-1]
            if is_baseline:
                if step >= budget:
                    break
                continue
            if step >= max_steps or clock >= cap or (reached is not None and clock >= (ddp_time or 0.0)):
                break
    finally:
        method.close()
    return dict(label=run["label"], family=run["family"], sync_every=run.get("sync_every"), curve=curve,
                reached=reached, cap_s=cap if math.isfinite(cap) else None)


def _compute_floor(params: Dict, data: Data, device, transport) -> float:
    """Seconds per step of AdamW without any communication, all ranks at once (so that they
    share this machine's cores as in the race): the compute floor of a step."""
    model = _model(params["model"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"])
    times = []
    for k in range(params["floor_steps"] + 2):
        transport.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(data.batch_at(k)).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    times = sorted(times[2:])
    return _slowest(transport, times[len(times) // 2])[0]


def run_rank(params: Dict, transport, device: torch.device) -> Dict:
    """Race every method of params["runs"] (ddp first unless a target is given); the
    curves, on every rank."""
    rank, world = transport.rank, transport.world_size
    show = params.get("progress", True) and rank == 0

    def say(text: str) -> None:
        if show:
            print(f"# race {text}", file=sys.stderr, flush=True)

    data = Data(params["model"], rank, world, params["seed"], params["val_seqs"])
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") if params.get("netem") else None
    nparams = sum(p.numel() for p in _model(params["model"]).parameters())
    floor = _compute_floor(params, data, device, transport)
    say(f"compute floor {floor * 1e3:.0f} ms per step ({nparams / 1e6:.2f}M parameters)")
    target, ddp_time = params.get("target_loss"), None
    results = []
    for run in params["runs"]:
        res = race_one(run, params, data, transport, device, ddp_time, target, ifname, say)
        if target is None:  # the baseline: its loss after its step budget is the target
            last = res["curve"][-1]
            target, ddp_time = last["val_loss"], last["time_s"]
            res["reached"] = last
            say(f"target: validation loss {target:.4f} (ddp after {last['step']} steps, {ddp_time:.1f} s)")
        results.append(res)
    return dict(results=results, target_loss=target, ddp_time_s=ddp_time, params=nparams, compute_step_s=floor,
                val_seqs=data.val_total, train_tokens=int(data.train.numel()))
