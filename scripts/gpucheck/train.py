"""The training job of 4 ranks (DDP + onebit_hook, DDP + OneBitAdam, OneBitAdam alone): loss
falls, replicas identical, no host sync inside the hook calls; and its verification."""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional

from .base import ROOT
from .ranks import RankContext


def _make_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                               torch.nn.Tanh(), torch.nn.Linear(256, 1))


def _teacher(device):
    import torch

    g = torch.Generator().manual_seed(12345)
    return torch.randn(32, 1, generator=g).to(device) / 4


def _batch(step: int, rank: int, device, teacher):
    import torch

    g = torch.Generator().manual_seed(1_000 * step + rank)
    x = torch.randn(64, 32, generator=g).to(device)
    return x, torch.tanh(x @ teacher) + 0.5 * torch.sin(x[:, :1])


def _lbcomm_site() -> str:
    """The innermost lbcomm frame of the calling stack, as "lbcomm/file.py:line" (or "?")."""
    import traceback

    for fr in reversed(traceback.extract_stack()):
        rel = os.path.relpath(fr.filename, ROOT)
        if rel.startswith("lbcomm" + os.sep):
            return f"{rel}:{fr.lineno}"
    return "?"


class SyncCounter:
    """Counts the synchronizing CUDA operations torch's sync debug mode reports, by where they
    happen: inside a hook call (marked by `region`), or by thread name elsewhere."""

    def __init__(self):
        import threading

        self._local = threading.local()
        self._lock = threading.Lock()
        self.counts: Dict[str, int] = {}
        self.sites: Dict[str, Dict[str, int]] = {}  # where -> {"lbcomm/file.py:line": count}

    def install(self, debug_mode: bool = True) -> None:
        """Route torch's sync warnings here (process-wide); debug_mode=False leaves torch's
        sync debug mode alone (for tests without a GPU)."""
        import warnings

        prev = self._prev = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" in str(message):
                import threading

                where = getattr(self._local, "where", None) or threading.current_thread().name
                site = _lbcomm_site()
                with self._lock:
                    self.counts[where] = self.counts.get(where, 0) + 1
                    sites = self.sites.setdefault(where, {})
                    sites[site] = sites.get(site, 0) + 1
                return
            prev(message, category, filename, lineno, file, line)

        warnings.simplefilter("always")
        warnings.showwarning = show
        if debug_mode:
            import torch

            torch.cuda.set_sync_debug_mode("warn")

    def uninstall(self) -> None:
        import warnings

        warnings.showwarning = self._prev

    def region(self, where: str):
        import contextlib

        @contextlib.contextmanager
        def cm():
            old = getattr(self._local, "where", None)
            self._local.where = where
            try:
                yield
            finally:
                self._local.where = old

        return cm()

    def reset(self) -> None:
        """Forget every count and site so far."""
        with self._lock:
            self.counts.clear()
            self.sites.clear()

    def take(self, where: str) -> int:
        with self._lock:
            self.sites.pop(where, None)
            return self.counts.pop(where, 0)


def _counted_hook(hook, counter: Optional[SyncCounter], stats: Dict[str, Any]):
    """`hook` with its calls counted; with a counter, the first call also runs a positive
    control (a known synchronizing op) so that a detector that sees nothing is caught."""

    def counted(state, bucket):
        stats["calls"] += 1
        if counter is None:
            return hook(state, bucket)
        with counter.region("hook"):
            if not stats["control_done"]:
                stats["control_done"] = True
                float(bucket.buffer().sum())  # the positive control
                stats["control_syncs"] = counter.take("hook")
            return hook(state, bucket)

    return counted


def _train_variant(ctx: RankContext, variant: str, params, counter: Optional[SyncCounter]):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lbcomm

    dev = ctx.device
    torch.manual_seed(0)
    model = _make_model().to(dev)
    teacher = _teacher(dev)
    hook_stats = {"calls": 0, "control_done": False, "control_syncs": None}
    hook_state = None
    if variant == "ddp_onebit_hook_adamw":
        net = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=0.1)
        hook_state = lbcomm.OneBitHookState(4)
        net.register_comm_hook(hook_state, _counted_hook(lbcomm.onebit_hook, counter, hook_stats))
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.0)
    elif variant == "ddp_onebit_adam":
        net = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=0.1)
        opt = lbcomm.OneBitAdam(net.parameters(), lr=3e-3, freeze_step=6, weight_decay=0.0)
        net.register_comm_hook(lbcomm.WarmupAverage(opt), _counted_hook(lbcomm.warmup_average_hook, counter, hook_stats))
    elif variant == "onebit_adam":
        net = model
        opt = lbcomm.OneBitAdam(net.parameters(), lr=3e-3, freeze_step=6, weight_decay=0.0)
    else:
        raise ValueError(f"unknown training variant {variant!r}")
    if counter is not None:
        counter.reset()
    losses, t0 = [], time.perf_counter()
    for step in range(params["steps"]):
        x, y = _batch(step, ctx.rank, dev, teacher)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if counter is not None:
            with counter.region("optimizer step"):
                opt.step()
        else:
            opt.step()
        losses.append(float(loss))
    seconds = time.perf_counter() - t0
    out = {"losses": losses, "seconds": seconds, "hook_calls": hook_stats["calls"],
           "params": torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])}
    if hook_state is not None:
        stats = hook_state.compression_stats()
        out["compressed_calls"] = stats["compressed_calls"]
        out["compression_ratio"] = stats["compression_ratio"]
    comp = getattr(opt, "compression_state", None)
    if comp is not None:
        out["compressed_calls"] = comp.calls
    if counter is not None:
        out["control_syncs"] = hook_stats["control_syncs"]
        out["hook_sync_sites"] = counter.sites.pop("hook", {})
        out["hook_syncs"] = counter.take("hook")
        out["optimizer_step_syncs"] = counter.take("optimizer step")
        out["other_syncs"] = dict(counter.counts)
        counter.reset()
    del net, opt, hook_state
    return out


def job_train(ctx: RankContext, params):
    counter = None
    if ctx.device.type == "cuda":
        counter = SyncCounter()
        counter.install()
    return {v: _train_variant(ctx, v, params, counter) for v in params["variants"]}


def verify_train(results, params):
    """Per variant: loss falls, replicas bitwise identical, compression happened, and on CUDA
    no synchronizing op inside a hook call (with the detector's positive control seen)."""
    import torch

    fig, problems = {}, []
    cuda = params.get("device", "cuda") == "cuda"
    for v in params["variants"]:
        runs = [res[v] for res in results]
        losses = torch.tensor([r["losses"] for r in runs]).mean(0)
        first, last = float(losses[:3].mean()), float(losses[-3:].mean())
        same = all(torch.equal(r["params"], runs[0]["params"]) for r in runs[1:])
        calls = [r.get("compressed_calls", 0) for r in runs]
        f = {"loss_first3": first, "loss_last3": last, "replicas_identical": same, "compressed_calls": calls[0],
             "ms_per_step": 1e3 * max(r["seconds"] for r in runs) / params["steps"]}
        if not (torch.isfinite(losses).all() and last < 0.8 * first):
            problems.append(f"{v}: loss did not fall ({first:.4g} -> {last:.4g})")
        if not same:
            problems.append(f"{v}: replicas differ after {params['steps']} steps")
        if not all(c and c > 0 for c in calls):
            problems.append(f"{v}: nothing was compressed (compressed calls per rank {calls})")
        if cuda and v.startswith("ddp"):
            f["hook_calls"] = runs[0]["hook_calls"]
            f["hook_syncs"] = [r["hook_syncs"] for r in runs]
            f["control_syncs"] = [r["control_syncs"] for r in runs]
            f["hook_sync_sites"] = [r["hook_sync_sites"] for r in runs]
            f["worker_syncs_per_step"] = max(r["other_syncs"].get("lbcomm-onebit-hook", 0) for r in runs) / params["steps"]
            if not all(c for c in f["control_syncs"]):
                problems.append(f"{v}: the sync detector missed its positive control ({f['control_syncs']}); the "
                                "sync count cannot be trusted")
            if any(f["hook_syncs"]):
                problems.append(f"{v}: {f['hook_syncs']} synchronizing CUDA ops inside hook calls")
        if cuda:
            f["optimizer_step_syncs_per_step"] = max(r["optimizer_step_syncs"] for r in runs) / params["steps"]
        fig[v] = f
    fig["problems"] = problems
    fig["summary"] = "; ".join(
        f"{v}: loss {fig[v]['loss_first3']:.3g}->{fig[v]['loss_last3']:.3g}, "
        f"{'identical' if fig[v]['replicas_identical'] else 'DIFFERENT'}"
        + (f", hook syncs {sum(fig[v]['hook_syncs'])}" if 'hook_syncs' in fig[v] else "")
        for v in params["variants"])
    return not problems, fig
