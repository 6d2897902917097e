"""Lightning: `LbcommCallback`, a ``lightning.pytorch.Callback`` that makes the DDP strategy
really use lbcomm and resume it exactly.

* Fit start: registers the right DDP communication hook on ``trainer.strategy.model``
  (`lbcomm.attach`): with a lbcomm optimizer returned by ``configure_optimizers`` DDP
  stops its full-precision allreduce after the freeze; with
  ``LbcommCallback(hook_state=lbcomm.OneBitHookState(...))`` (or a `lbcomm.DCTHookState`)
  every gradient bucket of an optimizer that does not communicate by itself goes through
  the 1-bit allreduce (or the thresholded sparse exchange).
* Local updates: with ``LbcommCallback(local_updates=...)`` (a function ``(pl_module,
  optimizer) -> lbcomm.OneBitLocalUpdates`` called at fit start around the optimizer
  ``configure_optimizers`` returned, or such an object) DDP communicates nothing
  (`lbcomm.ddp.local_gradients_hook`): every rank steps on its own gradient, and the
  callback calls ``local.step()`` after every optimizer step (in ``on_train_batch_end`` of
  the batches where ``trainer.global_step`` advanced: once per ``accumulate_grad_batches``
  batches, gradients still in place), which synchronizes the ranks every ``sync_every``
  steps. ``gradient_clip_val`` clips each rank's gradient by its own norm, as DiLoCo's
  inner steps do.
* Every checkpoint: Lightning writes the checkpoint dict of rank 0 only. The callback
  gathers what differs between ranks (the optimizer's compression error feedback and its
  `rank_local_buffers`, and the hook state) from every rank into that dict under
  ``"lbcomm"``, one entry per rank; the rest of the optimizer state (moments, step
  counts) is identical on all ranks and is Lightning's ``optimizer_states``. With local updates every rank's entry holds the local
  updates' state, the inner optimizer's state and the module's weights (between
  synchronizations every rank has its own). Top-k and ``last.ckpt`` handling stay
  Lightning's.
* Resume (``trainer.fit(..., ckpt_path=...)``): after Lightning has restored the optimizer
  (rank 0's state on every rank), every rank restores its own entry at train start, so the
  continuation is bitwise identical to a run that never stopped (same world size). With
  another number of ranks every rank reads all saved entries and the error feedback is
  redistributed (`lbcomm.CompressionState.redistribute`, the hook's units likewise:
  the total carried error, mean worker error + server error, is preserved); hierarchical
  error feedback restarts from zero, logged.

* Clipping: after the freeze of a lbcomm optimizer every rank holds its local gradient,
  and ``Trainer(gradient_clip_val=x)`` (by norm) would clip each by its own norm; Lightning
  offers the callback no place to change that, so with a lbcomm optimizer the callback
  refuses clipping by norm there and clips itself: ``LbcommCallback(max_grad_norm=x)``,
  ``gradient_clip_val`` unset, clips by the optimizer's `clip_grad_norm_` (one norm for
  every rank: one scalar allreduce after the freeze, none before) in
  ``on_before_optimizer_step`` and logs that shared norm as ``lbcomm_grad_norm``.
  Lightning logs no gradient norm itself; its ``lightning.pytorch.utilities.grad_norm``
  helper reads this rank's gradients (local after the freeze). With ``hook_state=`` the
  hook averages the gradients, so Lightning's own clipping is the same on every rank.

Cost: rank 0 holds every rank's error feedback while it saves (about (1 + 1/p) x the
number of parameters in fp32 per rank); with local updates every rank's weights, inner
optimizer state and local-updates state, which the checkpoint file holds too.

Requires ``lightning``; lbcomm itself does not.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Union

import torch
from lightning.pytorch.callbacks import Callback

from ..comm import gather_objects, world_info
from ..compressed import CompressionState
from ..ddp import DCTHookState, OneBitHookState
from ..local import OneBitLocalUpdates
from .attach import (LBCOMM_OPTIMIZERS, attach, check_callback_args, check_local_updates, check_not_communicating,
                     make_local_updates, refuse_norm_clipping, unwrap_optimizer)

__all__ = ["LbcommCallback"]

_log = logging.getLogger(__name__)
_FORMAT = "lbcomm-lightning"
_VERSION = 1


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _redistributed_entry(ranks, world: int, rank: int) -> Dict[str, Any]:
    """This rank's entry from the entries of every rank of another world size: the
    optimizer's error feedback redistributed (its total preserved); the hook's units and
    the local updates' error feedback are redistributed by their ``load_state_dict(sd,
    all_ranks=...)``; the weights and inner optimizer state of local updates are those of
    saved rank ``rank % saved world size``."""
    saved_world = len(ranks)
    comps = [r["compression"] for r in ranks]
    entry: Dict[str, Any] = {"compression": None, "hook": ranks[0]["hook"],
                             "hook_all_ranks": [r["hook"] for r in ranks] if ranks[0]["hook"] is not None else None}
    mine = ranks[rank % saved_world]
    entry["buffers_all_ranks"] = [r.get("buffers") for r in ranks]  # averaged on load
    if mine.get("local") is not None:
        entry.update(local=mine["local"], local_all_ranks=[r["local"] for r in ranks], model=mine["model"],
                     inner=mine["inner"])
    if world == 1:  # nothing is compressed on one rank
        _log.warning("LbcommCallback: the checkpoint was saved by %s ranks; with one rank nothing is compressed, so "
                     "the saved error feedback is dropped", saved_world)
        return {**entry, "compression": None, "hook": None, "compression_reset": True}
    if all(c is None for c in comps):
        pass
    elif any(c is None for c in comps):
        raise ValueError("LbcommCallback: some ranks of the checkpoint hold compression state and others do not; the "
                         "checkpoint is inconsistent")
    elif "worker_error" not in comps[0]:  # a HierarchicalState: its layout depends on the node shape
        _log.warning("LbcommCallback: the checkpoint was saved by %s ranks with a hierarchical momentum reduction; its "
                     "error feedback is not redistributed onto %s ranks and starts from zero", saved_world, world)
        entry["compression_reset"] = True
    else:
        entry["compression"] = CompressionState.redistribute(comps, world, rank)
    _log.info("LbcommCallback: the checkpoint was saved by %s ranks and this run has %s; the error feedback of all "
              "saved ranks is redistributed onto this world (its total is preserved)", saved_world, world)
    return entry


class LbcommCallback(Callback):
    """Attach lbcomm to Lightning's DDP and keep every rank's lbcomm state in its checkpoints.

    Args:
        hook_state (OneBitHookState or DCTHookState, optional): compress the gradients of
            an optimizer that does not communicate by itself with `lbcomm.onebit_hook` (or
            `lbcomm.dct_hook`; a 1-bit optimizer raises
            `lbcomm.errors.DoubleCompressionError`); leave it None when
            ``configure_optimizers`` returns a lbcomm optimizer (default: None).
        local_updates (callable or OneBitLocalUpdates, optional): train with local
            updates: DDP communicates nothing, ``local.step()`` follows every optimizer
            step. A function ``(pl_module, optimizer) -> OneBitLocalUpdates``, called at
            fit start with the module and the optimizer ``configure_optimizers`` returned
            (torch.distributed is initialized and the module on its device by then, which
            the local updates need when they are built), e.g.
            ``lambda module, opt: lbcomm.OneBitLocalUpdates(module.parameters(), opt,
            sync_every=32)``; or the object itself, built after torch.distributed was
            initialized, whose inner optimizer ``configure_optimizers`` returns. Not with
            ``hook_state=`` or ``max_grad_norm=`` (default: None).
        warmup_fp16 (bool, optional): average the warmup gradients of a lbcomm optimizer
            in fp16 (default: False).
        strict (bool, optional): resuming from a checkpoint without lbcomm entries raises;
            False logs a warning and continues with the other ranks' error feedback reset
            (default: True; with local updates such a checkpoint always raises). Another
            world size is not an error: the saved error feedback is redistributed onto this one.
        max_grad_norm (float, optional): clip the gradients of the lbcomm optimizer by one
            norm shared by all ranks (`lbcomm.optim.BaseOptimizer.clip_grad_norm_`) before
            every optimizer step and log it as ``lbcomm_grad_norm``; leave the Trainer's
            ``gradient_clip_val`` unset: with a lbcomm optimizer, clipping by norm there
            would clip every rank by its own norm, and is refused (default: None, no
            clipping here).

    Example::

        >>> # xdoctest: +SKIP
        >>> trainer = L.Trainer(strategy="ddp", devices=2, callbacks=[LbcommCallback()])
        >>> trainer.fit(module)        # module.configure_optimizers returns lbcomm.OneBitAdam(...)
    """

    def __init__(self, hook_state: Optional[Union[OneBitHookState, DCTHookState]] = None, *,
                 local_updates: Optional[Union[OneBitLocalUpdates, Callable[..., OneBitLocalUpdates]]] = None,
                 warmup_fp16: bool = False,
                 strict: bool = True, max_grad_norm: Optional[float] = None):
        check_callback_args("LbcommCallback", hook_state, max_grad_norm, local_updates)
        self.hook_state = hook_state
        # the local updates, or the function that builds them at fit start
        self.local_updates = local_updates if isinstance(local_updates, OneBitLocalUpdates) else None
        self._make_local = None if local_updates is None or self.local_updates is not None else local_updates
        self._steps_seen = None  # trainer.global_step when local.step() last followed an optimizer step
        self.warmup_fp16 = warmup_fp16
        self.strict = strict
        self.max_grad_norm = max_grad_norm
        self.grad_norm = None  # the last norm the optimizer's clip_grad_norm_ returned (0-dim tensor)
        self._fresh = False  # grad_norm not logged yet
        self._optimizer = None
        self._pending: Optional[Dict[str, Any]] = None

    def _lbcomm_optimizer(self, trainer):
        """The lbcomm optimizer to attach (None with a hook state or local updates), after
        every check of the settings, so that a refused setup registers nothing."""
        if self.local_updates is not None:  # every optimizer must be the inner one
            check_local_updates("LbcommCallback", self.local_updates, list(trainer.optimizers))
            return None
        if self.hook_state is not None:
            for opt in trainer.optimizers:  # a 1-bit optimizer: DoubleCompressionError
                check_not_communicating("LbcommCallback", opt, self.hook_state)
            if self.max_grad_norm is not None:
                raise ValueError("LbcommCallback: max_grad_norm clips with a lbcomm optimizer's clip_grad_norm_; with "
                                 "hook_state= the gradients are averaged by the hook, so use gradient_clip_val "
                                 "instead")
            return None
        opts = [unwrap_optimizer(o) for o in trainer.optimizers]
        ours = [o for o in opts if isinstance(o, LBCOMM_OPTIMIZERS)]
        if len(ours) > 1:
            raise ValueError("LbcommCallback: configure_optimizers returned several lbcomm optimizers; DDP takes one "
                             "communication hook, so use one lbcomm optimizer for the whole model")
        if not ours:
            names = ", ".join(type(o).__name__ for o in opts) or "none"
            raise ValueError(f"LbcommCallback: configure_optimizers returned {names}, not a lbcomm optimizer, and "
                             "neither hook_state nor local_updates was given, so nothing would be compressed. Return "
                             "lbcomm.OneBitAdam(...) / lbcomm.OneBitLamb(...), or pass "
                             "LbcommCallback(hook_state=lbcomm.OneBitHookState(...))")
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm"):
            clip = trainer.gradient_clip_val
            refuse_norm_clipping(f"Trainer(gradient_clip_val={clip})", "leave gradient_clip_val unset",
                                 f"pass LbcommCallback(max_grad_norm={clip})", type(ours[0]).__name__,
                                 self.max_grad_norm)
        return ours[0]

    def on_fit_start(self, trainer, pl_module) -> None:
        if self._make_local is not None:
            self.local_updates = make_local_updates("LbcommCallback", self._make_local, pl_module, trainer.optimizers)
        self._optimizer = self._lbcomm_optimizer(trainer)
        model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        if self._optimizer is not None:
            attach(model, self._optimizer, warmup_fp16=self.warmup_fp16)
        else:
            rank_local = self.hook_state if self.hook_state is not None else self.local_updates
            attach(model, rank_local, optimizer=list(trainer.optimizers), warmup_fp16=self.warmup_fp16)

    # ------------------------------------------------------------------ gradient norm
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.max_grad_norm is not None:
            self.grad_norm = self._optimizer.clip_grad_norm_(self.max_grad_norm)
            self._fresh = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Lightning has no callback hook after the optimizer step; global_step counts the
        # optimizer steps, so it advances on the batches that stepped (the last of every
        # accumulate_grad_batches). The gradients are zeroed only before the next backward,
        # and the checkpoint callbacks run after this one: they save the state after it.
        if self.local_updates is not None and trainer.global_step != self._steps_seen:
            self._steps_seen = trainer.global_step
            self.local_updates.step()
        if self._fresh:  # an optimizer step clipped by the shared norm
            self._fresh = False
            pl_module.log("lbcomm_grad_norm", float(self.grad_norm), on_step=True, on_epoch=False)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.local_updates is not None:
            self.local_updates.flush()  # a synchronization still in flight (overlap) is applied

    # ------------------------------------------------------------------ checkpoints
    def _local_state(self, pl_module) -> Dict[str, Any]:
        comp = None if self._optimizer is None else self._optimizer.compression_state
        state = {
            "compression": None if comp is None else comp.state_dict(),
            # the optimizer's other rank-local state (OneBitLamb's momentum of this rank's gradients)
            "buffers": None if self._optimizer is None else {n: t.clone() for n, t in
                                                             self._optimizer.rank_local_buffers().items()},
            "hook": None if self.hook_state is None else self.hook_state.state_dict(),
        }
        if self.local_updates is not None:  # each rank's own between synchronizations
            state.update(local=self.local_updates.state_dict(), inner=self.local_updates.inner.state_dict(),
                         model=pl_module.state_dict())
        return _to_cpu(state)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        local = self._local_state(pl_module)
        world, _ = world_info()
        shards = gather_objects(local, dst=0)  # every rank's shard, on rank 0 only
        if shards is not None:
            checkpoint["lbcomm"] = {"format": _FORMAT, "version": _VERSION, "world_size": world, "ranks": shards}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        entry = checkpoint.get("lbcomm")
        world, rank = world_info()
        problem = None
        if entry is None:
            problem = "the checkpoint holds no lbcomm state (saved without LbcommCallback)"
        elif entry.get("format") != _FORMAT or entry.get("version") != _VERSION:
            raise ValueError(f"LbcommCallback: unsupported lbcomm entry in the checkpoint ({entry.get('format')!r} "
                             f"version {entry.get('version')!r})")
        # (on_fit_start, which builds local updates given as a function, comes after this)
        with_local = self.local_updates is not None or self._make_local is not None
        if problem is None and with_local and entry["ranks"][0].get("local") is None:
            problem = "the checkpoint holds no local-updates state (saved without local_updates=)"
        if problem is not None and with_local:  # its anchors would be its first weights
            raise ValueError(f"LbcommCallback: {problem}; the local updates' state (the round's start, the outer "
                             "momentum) and every rank's own weights and inner optimizer state are only there, and "
                             "the local updates cannot continue without them")
        if problem is not None:
            msg = (f"LbcommCallback: {problem}; Lightning restores rank 0's optimizer state on every rank, so the "
                   "other ranks' compression error feedback restarts from zero")
            if self.strict:
                raise ValueError(msg + ". Pass LbcommCallback(strict=False) to continue anyway")
            _log.warning("%s", msg)
            self._pending = None
            return
        if entry["world_size"] != world:  # elastic resume
            self._pending = _redistributed_entry(entry["ranks"], world, rank)
            return
        self._pending = entry["ranks"][rank]  # applied once Lightning has restored the optimizer

    def on_train_start(self, trainer, pl_module) -> None:
        self._steps_seen = trainer.global_step  # restored by now on a resume
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if self.hook_state is not None and not (pending.get("compression_reset") and pending["hook"] is None):
            if pending["hook"] is None:
                raise ValueError(f"LbcommCallback: the checkpoint holds no {type(self.hook_state).__name__} (saved "
                                 "without hook_state=)")
            self.hook_state.load_state_dict(pending["hook"], all_ranks=pending.get("hook_all_ranks"))
        if self.local_updates is not None:  # after Lightning's restore of rank 0's weights and optimizer
            pl_module.load_state_dict(pending["model"])
            self.local_updates.inner.load_state_dict(pending["inner"])
            self.local_updates.load_state_dict(pending["local"], all_ranks=pending.get("local_all_ranks"))
        comp = None if self._optimizer is None else self._optimizer.compression_state
        if pending.get("compression_reset"):
            pass  # hierarchical errors of another world size: left reset by Lightning's load (logged)
        elif (comp is None) != (pending["compression"] is None):
            raise ValueError("LbcommCallback: the optimizer's compression stage does not match the checkpoint's "
                             f"(optimizer frozen: {getattr(self._optimizer, 'frozen', None)}, saved error feedback: "
                             f"{pending['compression'] is not None})")
        if comp is not None and not comp.load_state_dict(pending["compression"]):
            raise ValueError("LbcommCallback: the saved error feedback does not fit this optimizer's compression "
                             "state (another model or layout)")
        if self._optimizer is not None:  # after Lightning's restore of rank 0's optimizer state
            all_ranks = pending.get("buffers_all_ranks")
            self._optimizer.load_rank_local_buffers(pending.get("buffers"), all_ranks=all_ranks)
        _log.info("LbcommCallback: rank %s restored its compression error feedback", trainer.global_rank)
