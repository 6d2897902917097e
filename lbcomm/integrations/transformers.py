"""Hugging Face transformers: `LbcommCallback`, a ``TrainerCallback`` that makes the
Trainer's DDP really use lbcomm and resume it exactly.

* Train begin: registers the right DDP communication hook on ``trainer.model_wrapped``
  (`lbcomm.attach`): with a lbcomm optimizer passed as ``Trainer(optimizers=(opt, sched))``
  DDP stops its full-precision allreduce after the freeze; with
  ``LbcommCallback(hook_state=lbcomm.OneBitHookState(...))`` every gradient bucket of any
  optimizer goes through the 1-bit allreduce.
* Every checkpoint: each rank writes its shard into ``checkpoint-N/``
  (``shard-<rank>-of-<world>.pt``, `lbcomm.save_sharded`): the full optimizer state of
  that rank (including its compression error feedback, which differs between ranks and
  which the Trainer's rank-0 ``optimizer.pt`` cannot hold) and the hook state.
  ``save_total_limit`` removes the shards together with their checkpoint directory.
* Resume (``trainer.train(resume_from_checkpoint=...)``): after the Trainer has loaded
  its own files, every rank loads its shard, so the continuation is bitwise identical to
  a run that never stopped (same world size).
* Gradient norm and clipping: after the freeze of a lbcomm optimizer every rank holds its
  local gradient, and the Trainer would clip each by its own norm and log rank 0's. The
  callback routes the Trainer's norm call (``accelerator.clip_grad_norm_`` on the model's
  parameters, made for ``TrainingArguments(max_grad_norm=x)`` and, with x = 0, for the
  logged ``grad_norm``) to the optimizer's `clip_grad_norm_`: one norm for every rank
  (one scalar allreduce after the freeze, none before), so both the clipping and the
  logged ``grad_norm`` are the same on every rank. ``LbcommCallback(max_grad_norm=x)``
  with ``TrainingArguments(max_grad_norm=0)`` clips the same way (in that same call) and
  also logs the norm as ``lbcomm_grad_norm``. With ``hook_state=`` the hook averages the
  gradients, so the Trainer's own norm is already the same on every rank.

Requires ``transformers``; lbcomm itself does not.
"""
from __future__ import annotations

import gc
import logging
import os
import warnings
from typing import Any, Iterator, Optional

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from ..checkpoint import load_sharded, save_sharded, shard_path
from ..comm import get_transport
from ..ddp import OneBitHookState
from .attach import (LBCOMM_OPTIMIZERS, attach, check_callback_args, check_hook_momentum, find_ddp,
                     unwrap_optimizer)

__all__ = ["LbcommCallback"]

_log = logging.getLogger(__name__)


def _world_rank():
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _live(cls) -> Iterator[Any]:
    """The live objects of class `cls` (callbacks are handed neither the Trainer nor its DDP).
    Quietly: isinstance() on some deprecated torch objects warns."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        found = [obj for obj in gc.get_objects() if isinstance(obj, cls)]
    return iter(found)


def _ddp_of(model) -> Optional[DistributedDataParallel]:
    """The live DistributedDataParallel whose module is `model` (Trainer hands callbacks
    the unwrapped model, and ``trainer.model_wrapped`` is not reachable from them)."""
    for obj in _live(DistributedDataParallel):
        inner = getattr(obj.module, "_orig_mod", obj.module)  # torch.compile inside DDP
        if inner is model:
            return obj
    return None


def _trainer_of(callback) -> Any:
    """The live Trainer whose callbacks include `callback` (callbacks are not handed the Trainer)."""
    from transformers import Trainer

    for obj in _live(Trainer):
        if any(c is callback for c in getattr(obj.callback_handler, "callbacks", ())):
            return obj
    return None


def _covers(optimizer, params) -> bool:
    """Whether `params` (those with a gradient) all belong to `optimizer`, and it has no others."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    given = {id(p) for p in params}
    return mine <= given and {id(p) for p in params if p.grad is not None} <= mine


class LbcommCallback(TrainerCallback):
    """Attach lbcomm to the Trainer's DDP and keep every rank's lbcomm state in its checkpoints.

    Args:
        hook_state (OneBitHookState, optional): compress the gradients of any optimizer
            with `lbcomm.onebit_hook`; leave it None when the Trainer's optimizer is a
            lbcomm optimizer (``optimizers=(lbcomm.OneBitAdam(...), scheduler)``) (default: None).
        trainer (Trainer, optional): read the DDP from ``trainer.model_wrapped``; without
            it the callback finds the live DDP that wraps the Trainer's model (default: None).
        warmup_fp16 (bool, optional): average the warmup gradients of a lbcomm optimizer
            in fp16 (default: False).
        resume_from_checkpoint (str, optional): where the shards of a resumed run are;
            default: ``args.resume_from_checkpoint`` when it is a path, else
            ``<output_dir>/checkpoint-<global_step>`` (what ``resume_from_checkpoint=True``
            and ``=<output_dir>/checkpoint-N`` load).
        strict (bool, optional): a resumed run without shards raises; False logs a warning
            and continues with the error feedback of rank 0 only (rank 0 exact, the other
            ranks reset) (default: True).
        max_grad_norm (float, optional): clip the gradients of the lbcomm optimizer by one
            norm shared by all ranks (`lbcomm.optim.BaseOptimizer.clip_grad_norm_`) before
            every optimizer step and log it as ``lbcomm_grad_norm``; needs
            ``TrainingArguments(max_grad_norm=0)``. ``TrainingArguments(max_grad_norm=x)``
            alone does the same (the callback routes the Trainer's clipping to the shared
            norm) (default: None, no clipping here).

    Example::

        >>> # xdoctest: +SKIP
        >>> opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=1000)
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None),
        ...                   callbacks=[LbcommCallback()])
        >>> trainer.train()                                  # or resume_from_checkpoint=True
    """

    def __init__(self, hook_state: Optional[OneBitHookState] = None, *, trainer: Any = None,
                 warmup_fp16: bool = False, resume_from_checkpoint: Optional[str] = None, strict: bool = True,
                 max_grad_norm: Optional[float] = None):
        check_callback_args("LbcommCallback", hook_state, max_grad_norm)
        self.hook_state = hook_state
        self.trainer = trainer
        self.warmup_fp16 = warmup_fp16
        self.resume_from_checkpoint = resume_from_checkpoint
        self.strict = strict
        self.max_grad_norm = max_grad_norm
        self.grad_norm = None  # the last norm the optimizer's clip_grad_norm_ returned (0-dim tensor)
        self.ddp: Optional[DistributedDataParallel] = None
        self._optimizer = None
        self._clipped = False  # this step's gradients went through the shared norm already

    # ------------------------------------------------------------------ attach
    def _lbcomm_optimizer(self, optimizer):
        opt = unwrap_optimizer(optimizer)
        if isinstance(opt, LBCOMM_OPTIMIZERS):
            if self.hook_state is not None:
                raise ValueError(f"LbcommCallback: the Trainer's optimizer is lbcomm.{type(opt).__name__}, which "
                                 "communicates by itself, and a hook_state was given too (its gradients would be "
                                 "compressed twice); drop hook_state=")
            return opt
        if self.hook_state is None:
            raise ValueError(f"LbcommCallback: the Trainer's optimizer is {type(opt).__name__}, not a lbcomm "
                             "optimizer, and no hook_state was given, so nothing would be compressed. Pass "
                             "optimizers=(lbcomm.OneBitAdam(model.parameters(), ...), scheduler) to the Trainer, or "
                             "LbcommCallback(hook_state=lbcomm.OneBitHookState(start_iter=...)) for this optimizer")
        check_hook_momentum("LbcommCallback", self.hook_state, [optimizer])
        return None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._optimizer = self._lbcomm_optimizer(optimizer)
        if self.max_grad_norm is not None:
            if self._optimizer is None:
                raise ValueError("LbcommCallback: max_grad_norm clips with a lbcomm optimizer's clip_grad_norm_; with "
                                 "hook_state= the gradients are averaged by the hook, so use the Trainer's "
                                 "max_grad_norm instead")
            if args.max_grad_norm and args.max_grad_norm > 0:
                raise ValueError(f"LbcommCallback(max_grad_norm={self.max_grad_norm}) clips by one norm for all "
                                 f"ranks, and TrainingArguments(max_grad_norm={args.max_grad_norm}) clips too (the "
                                 "callback routes it to the same shared norm); use one of them: "
                                 "TrainingArguments(max_grad_norm=x) alone suffices, or set it to 0")
        if self._optimizer is not None:
            self._route_trainer_norm()
        wrapped = self.trainer.model_wrapped if self.trainer is not None else (_ddp_of(model) or model)
        if self.ddp is None or find_ddp(wrapped) is not self.ddp:
            self.ddp = attach(wrapped, self._optimizer if self._optimizer is not None else self.hook_state,
                              warmup_fp16=self.warmup_fp16)
        if state.global_step > 0:
            self._restore(args, state)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_dirs(self, args, state):
        dirs = []
        if self.resume_from_checkpoint:
            dirs.append(os.fspath(self.resume_from_checkpoint))
        if isinstance(args.resume_from_checkpoint, str) and args.resume_from_checkpoint:
            dirs.append(args.resume_from_checkpoint)
        dirs.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        return dirs

    def _restore(self, args, state) -> None:
        world, rank = _world_rank()
        dirs = self._checkpoint_dirs(args, state)
        found = next((d for d in dirs if os.path.exists(shard_path(d, rank, world))), None)
        if found is None:
            found = next((d for d in dirs if os.path.isdir(d) and any(
                f.startswith("shard-") for f in os.listdir(d))), None)
        if found is None:
            msg = (f"LbcommCallback: resuming at step {state.global_step} but no lbcomm shard "
                   f"({os.path.basename(shard_path('.', rank, world))}) in {dirs}; the Trainer's optimizer.pt holds "
                   "rank 0's error feedback only. Pass LbcommCallback(resume_from_checkpoint=<checkpoint dir>), or "
                   "strict=False to continue with the other ranks' error feedback reset")
            if self.strict:
                raise FileNotFoundError(msg)
            _log.warning("%s", msg)
            return
        info = load_sharded(found, self._optimizer, hook_state=self.hook_state)  # any world size (elastic)
        extra = info["extra"] or {}
        if extra.get("global_step") != state.global_step:
            raise ValueError(f"LbcommCallback: the lbcomm shard in {found!r} was saved at step "
                             f"{extra.get('global_step')} but the Trainer resumes at step {state.global_step}; pass "
                             "LbcommCallback(resume_from_checkpoint=<the checkpoint dir the Trainer resumes from>)")
        _log.info("LbcommCallback: rank %s restored its lbcomm state from %s (exact: %s)", rank, info["path"],
                  info["exact"])

    # ------------------------------------------------------------------ gradient norm
    def _route_trainer_norm(self) -> None:
        """Make the Trainer's ``accelerator.clip_grad_norm_(model.parameters(), x)`` use the
        lbcomm optimizer's shared norm (the Trainer offers no other place for it)."""
        trainer = self.trainer if self.trainer is not None else _trainer_of(self)
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is None:
            _log.warning("LbcommCallback: the Trainer was not found, so its grad_norm and max_grad_norm clipping stay "
                         "rank-local after the freeze; pass LbcommCallback(trainer=trainer)")
            return
        original = accelerator.clip_grad_norm_
        if getattr(original, "lbcomm_callback", None) is self:
            return
        original = getattr(original, "lbcomm_original", original)

        def clip_grad_norm_(parameters, max_norm, norm_type=2, **kwargs):
            params = list(parameters)
            opt = self._optimizer
            if opt is None or kwargs or float(norm_type) != 2.0 or not _covers(opt, params):
                return original(params, max_norm, norm_type=norm_type, **kwargs)
            if self.max_grad_norm is not None and max_norm == float("inf"):
                max_norm = self.max_grad_norm  # the callback's clipping, in the Trainer's norm call
            accelerator.unscale_gradients()
            self.grad_norm = opt.clip_grad_norm_(max_norm)
            self._clipped = self.max_grad_norm is not None
            return self.grad_norm

        clip_grad_norm_.lbcomm_callback = self
        clip_grad_norm_.lbcomm_original = original
        accelerator.clip_grad_norm_ = clip_grad_norm_
        _log.info("LbcommCallback: the Trainer's gradient norm and clipping use lbcomm.%s.clip_grad_norm_ (one norm "
                  "for every rank)", type(self._optimizer).__name__)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.max_grad_norm is not None and not self._clipped:  # the Trainer made no norm call this step
            self.grad_norm = self._optimizer.clip_grad_norm_(self.max_grad_norm)
        self._clipped = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.max_grad_norm is not None and self.grad_norm is not None and logs is not None:
            logs["lbcomm_grad_norm"] = float(self.grad_norm)

    def on_save(self, args, state, control, **kwargs):
        directory = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        save_sharded(directory, self._optimizer, extra={"global_step": state.global_step}, hook_state=self.hook_state)

    def on_train_end(self, args, state, control, **kwargs):
        # The Trainer's last collective (store_flos's all_gather) is not lbcomm's: it leaves a
        # Python tensor in a gloo work object, and if a gloo worker thread drops that object
        # last while Python finalizes, the process aborts ("terminate called without an active
        # exception", plain Trainer too). A barrier holds every earlier work of the group, and
        # lbcomm's transport keeps the barrier's own work until exit, so the main thread frees
        # them all, with the GIL. lbcomm's own collectives need no such step.
        get_transport(None, backend="torch").barrier()
