"""The methods of `lbcomm-bench race`, one rank's side: how each one takes a training step.

Every method wraps a fresh `TinyLM` built from the same seed (identical initial weights on
every rank and for every method) and takes one step on this rank's share of the global
batch; what differs is what crosses the network and when:

================  ======================================================================
``ddp``           DDP's bucketed fp32 allreduce of the gradients + AdamW
``bf16``          DDP + torch's ``bf16_compress_hook`` + AdamW
``powersgd``      DDP + torch's ``powerSGD_hook`` (rank 4, fp32 for the first ``warmup``
                  steps, error feedback) + AdamW; one DDP bucket on CPU (see train.py)
``onebit_hook``   DDP + ``lbcomm.onebit_hook`` (fp32 for ``warmup`` steps, then 1-bit
                  gradients) + AdamW
``onebit_adam``   ``lbcomm.OneBitAdam`` (its own communication: fp32 gradients until
                  ``freeze_step``, then one 1-bit allreduce of the momentum per step)
``zeroone_adam``  ``lbcomm.ZeroOneAdam`` (0/1 Adam, ``var_freeze_step`` = ``freeze_step``)
``diloco``        torchft's ``DiLoCo``: AdamW inner steps, every H steps the fp32
                  pseudo-gradient averaged and applied by Nesterov SGD (lr
                  ``--outer-lr``, 0.7 by default; momentum ``--outer-momentum``, 0.9);
                  a torchft ``Manager`` per rank (one replica group per process) and
                  a ``LighthouseServer`` in rank 0's process
``onebit_local``  ``lbcomm.OneBitLocalUpdates``: AdamW inner steps, every H steps the 1-bit
                  compressed outer momentum, the same outer Nesterov SGD (``--local-overlap``:
                  each sync applied that many steps later, evaluated at θ_start)
================  ======================================================================

The local-update methods (``diloco``, ``onebit_local``) hold one model only right after a
sync; `Method.synced` tells the race loop when it may evaluate.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import socket
from typing import Callable, Optional

import torch

from ..config import DEFAULT_BLOCK_SIZE

__all__ = ["FAMILIES", "LOCAL_FAMILIES", "Method", "unavailable"]

FAMILIES = ("ddp", "bf16", "powersgd", "onebit_hook", "onebit_adam", "zeroone_adam", "diloco", "onebit_local")
LOCAL_FAMILIES = ("diloco", "onebit_local")  # local updates with an outer step every H inner steps


def unavailable(family: str) -> Optional[str]:
    """Why `family` cannot run with the packages installed here, or None."""
    if family == "diloco" and importlib.util.find_spec("torchft") is None:
        return "diloco needs torchft (an optional dependency): `pip install torchft` (0.2.0)"
    return None


def _my_addr() -> str:
    """This rank's address as the other ranks reach it (the emulated cluster's, or loopback)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))  # no packet is sent: it only picks the route's source address
        return s.getsockname()[0]


class Method:
    """One method on this rank: `step(tokens, lr)` trains, `module` is the model to
    evaluate, `synced(step)` says whether the ranks hold one model after `step` steps."""

    def __init__(self, family: str, model: torch.nn.Module, *, lr: float, warmup: int, freeze_step: int,
                 sync_every: Optional[int], transport, device: torch.device, outer_lr: float,
                 outer_momentum: float, overlap: int = 0, block_size: int = DEFAULT_BLOCK_SIZE):
        self.family, self.module, self.sync_every = family, model, sync_every
        self._outer: Optional[Callable[[], object]] = None
        self._just_synced = False
        self._close: Callable[[], None] = lambda: None
        why = unavailable(family)
        if why:
            raise RuntimeError(why)
        fused = dict(fused=True) if device.type in ("cpu", "cuda") else {}
        if family in LOCAL_FAMILIES and not sync_every:
            raise ValueError(f"{family} needs sync_every (H)")
        if family == "onebit_adam":
            from ..optim import OneBitAdam

            self.model, self.opt = model, OneBitAdam(model.parameters(), lr=lr, freeze_step=freeze_step)
        elif family == "zeroone_adam":
            from ..optim import ZeroOneAdam

            self.model, self.opt = model, ZeroOneAdam(model.parameters(), lr=lr, var_freeze_step=freeze_step)
        elif family == "onebit_local":
            import lbcomm

            self.model, self.opt = model, torch.optim.AdamW(model.parameters(), lr=lr, **fused)
            self._local = lbcomm.OneBitLocalUpdates(model.parameters(), self.opt, sync_every, outer_lr=outer_lr,
                                                    outer_momentum=outer_momentum, overlap=overlap,
                                                    comm=lbcomm.CommConfig(block_size=block_size))
            self._outer = self._local.step
        elif family == "diloco":
            self.model, self.opt = model, torch.optim.AdamW(model.parameters(), lr=lr, **fused)
            self._close = _diloco(self, transport, sync_every, outer_lr, outer_momentum)
        elif family in ("ddp", "bf16", "powersgd", "onebit_hook"):
            self.model, self.opt = _ddp(family, model, lr, warmup, device, fused)
        else:
            raise ValueError(f"unknown race method {family!r}; choose from {FAMILIES}")

    def step(self, tokens: torch.Tensor, lr: float) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(tokens)
        loss.backward()
        self.opt.step()  # diloco: its post-step hook syncs every H steps
        if self._outer is not None:
            self._just_synced = bool(self._outer())  # OneBitLocalUpdates.step(): True on syncs
        return float(loss.detach())

    def synced(self, step: int) -> bool:
        if self.family == "onebit_local":
            return self._just_synced
        return self.family != "diloco" or step % self.sync_every == 0

    def evaluated(self):
        """Where to measure the validation loss: with overlap the ranks' weights differ
        even after a sync, so onebit_local is measured at its θ_start (identical on every
        rank)."""
        if self.family == "onebit_local" and self._local.overlap:
            return self._local.at_anchor()
        return contextlib.nullcontext()

    def close(self) -> None:
        self._close()


def _ddp(family: str, model, lr: float, warmup: int, device: torch.device, fused):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    # PowerSGD's later allreduces run on gloo's threads; with several buckets the ranks can
    # issue them in different orders, so on CPU it gets one bucket (as in `train`).
    one_bucket = dict(bucket_cap_mb=1 << 16) if family == "powersgd" and device.type == "cpu" else {}
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, **one_bucket)
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr, **fused)
    if family == "bf16":
        ddp.register_comm_hook(None, _bf16_hook)
    elif family == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=max(2, warmup))
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif family == "onebit_hook":
        from ..ddp import OneBitHookState, onebit_hook

        ddp.register_comm_hook(OneBitHookState(max(2, warmup)), onebit_hook)
    return ddp, opt


def _bf16_hook(state, bucket):
    """torch's bf16_compress_hook itself; DDP refuses that function by name unless CUDA and
    NCCL run it, and gloo reduces bf16 on CPU, so it is called through this wrapper."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _diloco(method: Method, transport, sync_every: int, outer_lr: float,
            outer_momentum: float) -> Callable[[], None]:
    """torchft's DiLoCo on `method`'s model and inner optimizer: a LighthouseServer in rank
    0's process, on every rank a TCPStore and a Manager (one replica group of one process).
    Returns the function that shuts it all down."""
    from torch.distributed import TCPStore

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's coordination logs every quorum at INFO
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import DiLoCo

    rank, world = transport.rank, transport.world_size
    me = _my_addr()
    lighthouse = None
    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        # quorum_tick_ms: how often the lighthouse checks for a full quorum (default 100 ms)
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world, quorum_tick_ms=10)
        port[0] = int(lighthouse.address().rsplit(":", 1)[1])
    transport.all_reduce(port, op="max")  # rank 0's port to every rank
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = TCPStore(me, 0, is_master=True, wait_for_workers=False)
    store_alive = [store]  # the Manager's TCPStore client needs this server until close()
    model = method.module
    timeout = datetime.timedelta(seconds=120)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=lambda sd: model.load_state_dict(sd),
                      state_dict=model.state_dict, min_replica_size=world, use_async_quorum=False,
                      replica_id=f"race{rank}", store_addr=me, store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=f"http://{master}:{int(port[0])}", hostname=me, port=0,
                      timeout=timeout, quorum_timeout=timeout, init_sync=False)  # same seed: same weights
    outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum,
                            nesterov=outer_momentum > 0)
    diloco = DiLoCo(manager, [model], method.opt, outer, sync_every=sync_every, backup_device=torch.device("cpu"),
                    pin_memory=False, use_bucketization=True)
    diloco.__enter__()

    def close():
        diloco.__exit__(None, None, None)
        transport.barrier()
        manager.shutdown(wait=False)
        transport.barrier()
        if lighthouse is not None:
            lighthouse.shutdown()
        store_alive.clear()

    return close
