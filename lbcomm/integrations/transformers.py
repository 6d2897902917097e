"""Hugging Face transformers: `LbcommCallback`, a ``TrainerCallback`` that makes the
Trainer's DDP really use lbcomm and resume it exactly::

    trainer = Trainer(model=model, args=args, optimizers=(lbcomm.OneBitAdam(...), scheduler), ...,
                      callbacks=[LbcommCallback()])
    trainer.train()

or, built with its Trainer, ``trainer.add_callback(LbcommCallback(trainer))``.

The callback events hand callbacks the unwrapped model, not the DDP that wraps it
(``trainer.model_wrapped``), which lbcomm attaches to. Built with its Trainer, the callback
reads the DDP from it; built without (``callbacks=[LbcommCallback()]``), it takes the Trainer
that raises ``on_train_begin`` (the nearest caller on the stack that is a Trainer holding
this callback).

* Train begin: registers the right DDP communication hook on ``trainer.model_wrapped``
  (`lbcomm.attach`): with a lbcomm optimizer passed as ``Trainer(optimizers=(opt, sched))``
  DDP stops its full-precision allreduce after the freeze; with
  ``LbcommCallback(hook_state=lbcomm.OneBitHookState(...))`` (or a
  `lbcomm.DCTHookState`) every gradient bucket of any optimizer goes through the 1-bit
  allreduce (or the thresholded sparse exchange; a 1-bit optimizer there raises
  `lbcomm.errors.DoubleCompressionError`).
* Local updates: with ``LbcommCallback(local_updates=local)`` (a
  `lbcomm.OneBitLocalUpdates` whose inner optimizer is the Trainer's,
  ``Trainer(optimizers=(local.inner, scheduler))``) DDP communicates nothing
  (`lbcomm.ddp.local_gradients_hook`): every rank steps on its own gradient, and the
  callback calls ``local.step()`` after every optimizer step (``on_optimizer_step``: once
  per ``gradient_accumulation_steps`` micro-batches, gradients still in place, before the
  scheduler steps), which synchronizes the ranks every ``sync_every`` steps. It also
  follows a step that the fp16 grad scaler skipped, so that every rank synchronizes at the
  same step. The Trainer's ``max_grad_norm`` clips each rank's gradient by its own norm,
  as DiLoCo's inner steps do (its logged ``grad_norm`` is that rank's own norm).
* Every checkpoint: each rank writes its shard into ``checkpoint-N/``
  (``shard-00000-of-00002.pt`` for rank 0 of 2, `lbcomm.save_sharded`): the full optimizer state of
  that rank (including its compression error feedback, which differs between ranks and
  which the Trainer's rank-0 ``optimizer.pt`` cannot hold) and the hook state. With local
  updates: the local updates' state, the inner optimizer's state and the model's weights
  of that rank (between synchronizations every rank has its own). ``save_total_limit``
  removes the shards together with their checkpoint directory.
* Resume (``trainer.train(resume_from_checkpoint=...)``): after the Trainer has loaded
  its own files, every rank loads its shard, so the continuation is bitwise identical to
  a run that never stopped (same world size).
* Gradient norm and clipping: after the freeze of a lbcomm optimizer every rank holds its
  local gradient, and the Trainer's clipping (``TrainingArguments(max_grad_norm=x)``, 1.0
  by default) would clip each by its own norm; the Trainer offers no place to change how
  it clips, so with a lbcomm optimizer the callback takes the clipping over: it sets
  ``args.max_grad_norm`` to 0 when training begins (saying so once, with a
  `ClippingTakenOverWarning`) and clips at that norm by the optimizer's `clip_grad_norm_`
  (one norm for every rank: one scalar allreduce after the freeze, none before) just
  before every optimizer step (``on_pre_optimizer_step``), logging that shared norm as
  ``lbcomm_grad_norm``. ``LbcommCallback(max_grad_norm=x)`` clips at x instead (then
  ``TrainingArguments(max_grad_norm=0)`` keeps it quiet). The Trainer's own logged
  ``grad_norm`` stays this rank's norm (the same on every rank before the freeze, local
  after it). With ``hook_state=`` the hook averages the gradients, so the Trainer's own
  clipping and norm are already the same on every rank, and the callback leaves them.

Requires ``transformers``; lbcomm itself does not.
"""
from __future__ import annotations

import inspect
import logging
import os
import warnings
from typing import Callable, Optional, Union

from transformers import Trainer, TrainerCallback

from ..checkpoint import load_sharded, save_sharded, shard_path
from ..comm import get_transport
from ..ddp import DCTHookState, OneBitHookState
from ..local import OneBitLocalUpdates
from ..errors import ClippingTakenOverWarning
from .attach import (LBCOMM_OPTIMIZERS, attach, check_callback_args, check_local_updates, check_not_communicating,
                     make_local_updates, unwrap_optimizer)

__all__ = ["LbcommCallback", "ClippingTakenOverWarning"]

_log = logging.getLogger(__name__)


class LbcommCallback(TrainerCallback):
    """Attach lbcomm to the Trainer's DDP and keep every rank's lbcomm state in its checkpoints.

    Args:
        trainer (Trainer, optional): the Trainer this callback serves, for
            ``trainer.add_callback(LbcommCallback(trainer, ...))``; its DDP is read from
            ``trainer.model_wrapped`` when training begins. Leave it out to pass the callback
            to the Trainer, ``Trainer(..., callbacks=[LbcommCallback(...)])``: it then serves
            the Trainer that raises ``on_train_begin`` (default: None).
        hook_state (OneBitHookState or DCTHookState, optional): compress the gradients of
            an optimizer that does not communicate by itself with `lbcomm.onebit_hook` (or
            `lbcomm.dct_hook`); leave it None when the Trainer's optimizer is a lbcomm
            optimizer (``optimizers=(lbcomm.OneBitAdam(...), scheduler)``) (default: None).
        local_updates (OneBitLocalUpdates or callable, optional): train with local
            updates: DDP communicates nothing, ``local.step()`` follows every optimizer
            step. Its inner optimizer must be the Trainer's
            (``optimizers=(local.inner, scheduler)``); build it after the
            ``TrainingArguments`` (they initialize torch.distributed, which it needs). Or a
            function ``(model, optimizer) -> OneBitLocalUpdates``, called when training
            begins with the Trainer's model and optimizer (also one the Trainer created).
            Not with ``hook_state=`` or ``max_grad_norm=`` (default: None).
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
            every optimizer step and log it as ``lbcomm_grad_norm``. Default None: with a
            lbcomm optimizer, clip at ``TrainingArguments.max_grad_norm`` the same way
            (taken over from the Trainer, which would clip each rank by its own norm); no
            clipping when that is 0. Given, it replaces ``TrainingArguments.max_grad_norm``
            (a ``ClippingTakenOverWarning`` unless that is 0).

    Raises (when training begins):
        ValueError: neither a lbcomm optimizer nor a hook state nor local updates; local
            updates whose inner optimizer is not the Trainer's; the callback was built with
            another Trainer than the one it was added to; built without its Trainer, it
            found none raising ``on_train_begin`` on more than one process.
        lbcomm.errors.DoubleCompressionError: a hook state with a 1-bit optimizer.

    Warns (when training begins, on the main process):
        ClippingTakenOverWarning: a lbcomm optimizer with ``TrainingArguments(max_grad_norm
            > 0)`` (the default 1.0): the callback sets it to 0 and clips by the shared norm
            itself.

    Example::

        >>> # xdoctest: +SKIP
        >>> opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=1000)
        >>> args = TrainingArguments(...)                    # max_grad_norm=1.0: the callback clips
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None),
        ...                   callbacks=[LbcommCallback()])
        >>> trainer.train()                                  # or resume_from_checkpoint=True
        >>> # local updates: any torch optimizer inside, the ranks meet every 32 steps
        >>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> local = lbcomm.OneBitLocalUpdates(model.parameters(), inner, sync_every=32)
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(inner, None))
        >>> trainer.add_callback(LbcommCallback(trainer, local_updates=local))
    """

    def __init__(self, trainer: Optional[Trainer] = None,
                 hook_state: Optional[Union[OneBitHookState, DCTHookState]] = None, *,
                 local_updates: Optional[Union[OneBitLocalUpdates, Callable[..., OneBitLocalUpdates]]] = None,
                 warmup_fp16: bool = False,
                 resume_from_checkpoint: Optional[str] = None, strict: bool = True,
                 max_grad_norm: Optional[float] = None):
        if trainer is not None and not isinstance(trainer, Trainer):
            raise TypeError(f"LbcommCallback: the first argument is the transformers Trainer the callback serves, got "
                            f"{type(trainer).__name__}: trainer.add_callback(LbcommCallback(trainer, hook_state=...)), "
                            "or Trainer(..., callbacks=[LbcommCallback(hook_state=...)]) with keyword arguments only")
        check_callback_args("LbcommCallback", hook_state, max_grad_norm, local_updates)
        self.trainer = trainer  # built without it: the Trainer that raises on_train_begin
        self._own_trainer = trainer is not None
        self.hook_state = hook_state
        # the local updates, or the function that builds them when training begins
        self.local_updates = local_updates if isinstance(local_updates, OneBitLocalUpdates) else None
        self._make_local = None if local_updates is None or self.local_updates is not None else local_updates
        self.warmup_fp16 = warmup_fp16
        self.resume_from_checkpoint = resume_from_checkpoint
        self.strict = strict
        self.max_grad_norm = max_grad_norm  # the clip applied; taken from TrainingArguments when not given
        self._clip_given = max_grad_norm is not None
        self.grad_norm = None  # the last norm the optimizer's clip_grad_norm_ returned (0-dim tensor)
        self.ddp = None
        self._model = None  # the Trainer's (unwrapped) model, from train begin on
        self._optimizer = None
        self._transport = None  # the world's transport (rank, world size, the exit barrier), made at train begin

    # ------------------------------------------------------------------ attach
    def _lbcomm_optimizer(self, optimizer):
        """The lbcomm optimizer to attach (None with a hook state or local updates), after
        every check of the settings, so that a refused setup registers nothing."""
        if self.local_updates is not None:  # the Trainer's optimizer must be the inner one
            check_local_updates("LbcommCallback", self.local_updates, [optimizer])
            return None
        if self.hook_state is not None:
            # a 1-bit optimizer: DoubleCompressionError
            check_not_communicating("LbcommCallback", optimizer, self.hook_state)
            if self.max_grad_norm is not None:
                raise ValueError("LbcommCallback: max_grad_norm clips with a lbcomm optimizer's clip_grad_norm_; with "
                                 "hook_state= the gradients are averaged by the hook, so use the Trainer's "
                                 "max_grad_norm instead")
            return None
        opt = unwrap_optimizer(optimizer)
        if not isinstance(opt, LBCOMM_OPTIMIZERS):
            raise ValueError(f"LbcommCallback: the Trainer's optimizer is {type(opt).__name__}, not a lbcomm "
                             "optimizer, and neither hook_state nor local_updates was given, so nothing would be "
                             "compressed. Pass optimizers=(lbcomm.OneBitAdam(model.parameters(), ...), scheduler) to "
                             "the Trainer, or LbcommCallback(hook_state=lbcomm.OneBitHookState(start_iter=...)) for "
                             "this optimizer")
        return opt

    def _take_over_clipping(self, args, state, optimizer_name):
        """Turn the Trainer's clipping off (it reads ``args.max_grad_norm`` at every step)
        and clip by the shared norm instead, at the callback's own max_grad_norm when
        given, else at the Trainer's."""
        clip = args.max_grad_norm
        if not self._clip_given:
            self.max_grad_norm = clip
        args.max_grad_norm = 0.0
        if not state.is_world_process_zero:  # said once, by the main process
            return
        why = (f"TrainingArguments(max_grad_norm={clip}) would clip every rank's gradient by its own norm, and with "
               f"lbcomm.{optimizer_name} the gradients are local to each rank (after the freeze; always with Lamb)")
        if self._clip_given:
            msg = (f"LbcommCallback: clipping at LbcommCallback(max_grad_norm={self.max_grad_norm}) by one norm "
                   f"for all ranks (logged as lbcomm_grad_norm) and setting the Trainer's max_grad_norm to 0: {why}. "
                   "Pass TrainingArguments(max_grad_norm=0) to silence this")
        else:
            msg = (f"LbcommCallback: clipping at max_grad_norm={clip} by one norm for all ranks (logged as "
                   f"lbcomm_grad_norm) instead of the Trainer, whose max_grad_norm is set to 0: {why}. Pass "
                   f"TrainingArguments(max_grad_norm=0) and LbcommCallback(max_grad_norm={clip}) to silence this")
        warnings.warn(msg, ClippingTakenOverWarning, stacklevel=2)

    def _calling_trainer(self) -> Optional[Trainer]:
        """The Trainer raising the current event: the nearest caller on the stack whose
        ``self`` is a Trainer holding this callback (the event's arguments carry the
        unwrapped model, not the DDP)."""
        frame = inspect.currentframe()
        try:
            while frame is not None:
                owner = frame.f_locals.get("self")
                if isinstance(owner, Trainer) and any(cb is self for cb in owner.callback_handler.callbacks):
                    return owner
                frame = frame.f_back
        finally:
            del frame
        return None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._transport is None:
            self._transport = get_transport(None, backend="torch")
        if self._own_trainer:
            if model is not None and model is not self.trainer.model:
                raise ValueError("LbcommCallback: this callback was built for another Trainer; add "
                                 "LbcommCallback(trainer) to the Trainer it was built with")
        else:
            self.trainer = self._calling_trainer()
            if self.trainer is None and self._transport.world_size > 1:
                raise ValueError("LbcommCallback: built without its Trainer, the callback serves the Trainer that "
                                 "raises on_train_begin, and found none on the call stack (the event carries the "
                                 "unwrapped model, not the DistributedDataParallel lbcomm attaches to). Build it "
                                 "with its Trainer: trainer.add_callback(LbcommCallback(trainer, ...))")
        self._model = self.trainer.model if self.trainer is not None else model
        if self._make_local is not None:
            self.local_updates = make_local_updates("LbcommCallback", self._make_local, self._model, [optimizer])
        self._optimizer = self._lbcomm_optimizer(optimizer)
        # one process without a Trainer (the event called by hand): no DDP, nothing to attach
        wrapped = self.trainer.model_wrapped if self.trainer is not None else model
        if self._optimizer is not None:
            self.ddp = attach(wrapped, self._optimizer, warmup_fp16=self.warmup_fp16)
        else:
            self.ddp = attach(wrapped, self._rank_local(), optimizer=optimizer, warmup_fp16=self.warmup_fp16)
        if self._optimizer is not None and args.max_grad_norm and args.max_grad_norm > 0:
            self._take_over_clipping(args, state, type(self._optimizer).__name__)
        if state.global_step > 0:
            self._restore(args, state)

    def _rank_local(self):
        """The hook state or local updates (None with a lbcomm optimizer): attached with the
        Trainer's optimizer, and saved in every rank's shard as its ``hook_state``."""
        return self.hook_state if self.hook_state is not None else self.local_updates

    def _shard_contents(self):
        """(optimizer, model) of this rank's shard: a lbcomm optimizer's full state (its
        error feedback differs between ranks); with local updates the inner optimizer's
        state and the model's weights, both this rank's own between synchronizations."""
        if self.local_updates is not None:
            return self.local_updates.inner, self._model
        return self._optimizer, None

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
        world, rank = self._transport.world_size, self._transport.rank
        dirs = self._checkpoint_dirs(args, state)
        found = next((d for d in dirs if os.path.exists(shard_path(d, rank, world))), None)
        if found is None:
            found = next((d for d in dirs if os.path.isdir(d) and any(
                f.startswith("shard-") for f in os.listdir(d))), None)
        if found is None:
            where = (f"LbcommCallback: resuming at step {state.global_step} but no lbcomm shard "
                     f"({os.path.basename(shard_path('.', rank, world))}) in {dirs}")
            if self.local_updates is not None:  # its anchors would be the weights it was built with: wrong steps
                raise FileNotFoundError(f"{where}; the local updates' state (the round's start, the outer momentum) "
                                        "and every rank's own weights are only there. Pass LbcommCallback(trainer, "
                                        "local_updates=..., resume_from_checkpoint=<checkpoint dir>)")
            msg = (f"{where}; the Trainer's optimizer.pt holds rank 0's error feedback only. Pass "
                   "LbcommCallback(trainer, resume_from_checkpoint=<checkpoint dir>), or strict=False to continue "
                   "with the other ranks' error feedback reset")
            if self.strict:
                raise FileNotFoundError(msg)
            _log.warning("%s", msg)
            return
        optimizer, model = self._shard_contents()
        info = load_sharded(found, optimizer, model, hook_state=self._rank_local())  # any world size (elastic)
        extra = info["extra"] or {}
        if extra.get("global_step") != state.global_step:
            raise ValueError(f"LbcommCallback: the lbcomm shard in {found!r} was saved at step "
                             f"{extra.get('global_step')} but the Trainer resumes at step {state.global_step}; pass "
                             "LbcommCallback(trainer, resume_from_checkpoint=<the checkpoint dir the Trainer resumes "
                             "from>)")
        _log.info("LbcommCallback: rank %s restored its lbcomm state from %s (exact: %s)", rank, info["path"],
                  info["exact"])

    # ------------------------------------------------------------------ gradient norm
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.max_grad_norm is not None:
            self.grad_norm = self._optimizer.clip_grad_norm_(self.max_grad_norm)

    # ------------------------------------------------------------------ local updates
    def on_optimizer_step(self, args, state, control, **kwargs):
        # Right after the Trainer's optimizer.step() (the gradients are still there for the
        # local updates' averaged-gradients probe), once per optimizer step whatever the
        # gradient accumulation; every rank counts the same steps.
        if self.local_updates is not None:
            self.local_updates.step()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.max_grad_norm is not None and self.grad_norm is not None and logs is not None:
            logs["lbcomm_grad_norm"] = float(self.grad_norm)

    def on_save(self, args, state, control, **kwargs):
        directory = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        optimizer, model = self._shard_contents()
        save_sharded(directory, optimizer, model, extra={"global_step": state.global_step},
                     hook_state=self._rank_local())

    def on_train_end(self, args, state, control, **kwargs):
        # The Trainer's last collective (store_flos's all_gather) is not lbcomm's: it leaves a
        # Python tensor in a gloo work object, and if a gloo worker thread drops that object
        # last while Python finalizes, the process aborts ("terminate called without an active
        # exception", plain Trainer too). A barrier holds every earlier work of the group, and
        # lbcomm's transport keeps the barrier's own work until exit, so the main thread frees
        # them all, with the GIL. lbcomm's own collectives need no such step.
        if self.local_updates is not None:
            self.local_updates.flush()  # a synchronization still in flight (overlap) is applied
        self._transport.barrier()
