"""`attach`: register the right lbcomm DDP communication hook on whatever wraps the model.

Training frameworks wrap the `torch.nn.parallel.DistributedDataParallel` they create in
their own objects (accelerate may compile it, Lightning keeps it in
``trainer.strategy.model``, `torch.compile` returns an ``OptimizedModule``), so the
usual ``ddp_model.register_comm_hook(...)`` first needs the DDP. `find_ddp` looks for it
through these wrappers; `attach` registers

* `lbcomm.ddp.warmup_average_hook` with a `WarmupAverage` of the optimizer for a lbcomm optimizer
  (`OneBitAdam`, `OneBitLamb`, `Lamb`): DDP averages the gradients during the warmup and
  communicates nothing after the freeze, where the optimizer compresses its momentum;
* `lbcomm.onebit_hook` for a `OneBitHookState`, `lbcomm.dct_hook` for a `DCTHookState`
  (an optimizer that does not communicate by itself; ``optimizer=`` names it, and a 1-bit
  optimizer there raises `lbcomm.errors.DoubleCompressionError`): every gradient bucket
  goes through the 1-bit compressed allreduce, or the thresholded sparse exchange;
* `lbcomm.ddp.local_gradients_hook` for a `OneBitLocalUpdates`: DDP communicates nothing,
  every rank's inner optimizer steps on its own gradient, and the local updates
  synchronize the ranks every H steps (``optimizer=`` must be its inner optimizer).

Without it, DDP's full-precision allreduce keeps running next to the optimizer's own
communication, and nothing is saved.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..comm import world_info
from ..ddp import (DCTHookState, OneBitHookState, WarmupAverage, dct_hook, local_gradients_hook, onebit_hook,
                   warmup_average_hook)
from ..errors import DoubleCompressionError
from ..local import OneBitLocalUpdates
from ..optim import Lamb, OneBitAdam, OneBitLamb, ZeroOneAdam

__all__ = ["attach", "find_ddp", "unwrap_optimizer", "check_callback_args", "check_not_communicating",
           "check_local_updates", "make_local_updates", "hook_for", "refuse_norm_clipping",
           "LBCOMM_OPTIMIZERS", "ONEBIT_OPTIMIZERS", "HOOK_STATES"]

_log = logging.getLogger(__name__)

#: The lbcomm optimizers that compress their own communication (the momentum, after the freeze).
ONEBIT_OPTIMIZERS = (OneBitAdam, OneBitLamb, ZeroOneAdam)
#: The lbcomm optimizers that average or compress by themselves: they pair with
#: `warmup_average_hook` (DDP averages their warmup gradients, or nothing at all).
LBCOMM_OPTIMIZERS = ONEBIT_OPTIMIZERS + (Lamb,)
#: The hook states `attach` and the frameworks' callbacks (``hook_state=``) take, each with
#: its hook: every gradient bucket of an optimizer that does not communicate by itself goes
#: through it. All of them keep rank-local state with ``state_dict`` / ``load_state_dict(sd,
#: all_ranks=)`` and ``check_resume``, which the callbacks save and restore alike.
_HOOKS = ((OneBitHookState, onebit_hook), (DCTHookState, dct_hook))
HOOK_STATES = tuple(cls for cls, _ in _HOOKS)

# Attributes under which known wrappers keep the object they wrap, searched in this order:
# torch.compile (OptimizedModule._orig_mod), Lightning Fabric (_FabricModule._forward_module),
# accelerate/transformers/DeepSpeed-style `.module`, Lightning's wrapper of a LightningModule.
_MODULE_ATTRS = ("_orig_mod", "_forward_module", "module", "_module")
# Optimizer wrappers: accelerate's AcceleratedOptimizer (.optimizer), Lightning's
# LightningOptimizer (._optimizer).
_OPTIMIZER_ATTRS = ("optimizer", "_optimizer")


def _is_fsdp(obj: Any) -> bool:
    try:  # FSDP1 and FSDP2 (fully_shard); both are public torch names
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(obj, (FullyShardedDataParallel, FSDPModule))


def _lightning_strategy_model(obj: Any) -> Any:
    """A LightningModule's DDP lives in its trainer's strategy (``trainer.strategy.model``)."""
    trainer = getattr(obj, "_trainer", None)  # LightningModule.trainer raises when detached
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    return getattr(strategy, "model", None) if strategy is not None else None


def find_ddp(model: Any) -> Optional[DistributedDataParallel]:
    """The `DistributedDataParallel` that `model` is or wraps, or None.

    Looks through torch.compile's ``OptimizedModule``, accelerate's and transformers'
    wrappers, Lightning Fabric's ``_FabricModule``, a Lightning ``Trainer`` (its
    ``strategy.model``) and a ``LightningModule`` attached to one.

    Raises:
        TypeError: when the model is sharded with FSDP (lbcomm's hooks are DDP hooks).
    """
    seen = set()
    todo = [model]
    while todo:
        obj = todo.pop(0)
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, DistributedDataParallel):
            return obj
        if _is_fsdp(obj):
            raise TypeError("lbcomm.attach: the model is sharded with FSDP, which reduce-scatters gradients without "
                            "DDP communication hooks; lbcomm's 1-bit compression works with DistributedDataParallel "
                            "(use strategy 'ddp' / no FSDP plugin)")
        strategy = getattr(obj, "strategy", None)  # a Lightning Trainer
        if strategy is not None and not isinstance(obj, torch.nn.Module):
            todo.append(getattr(strategy, "model", None))
        for name in _MODULE_ATTRS:
            inner = obj.__dict__.get(name) if hasattr(obj, "__dict__") else None
            if inner is None and isinstance(obj, torch.nn.Module):
                inner = obj._modules.get(name)
            if inner is not None:
                todo.append(inner)
        if isinstance(obj, torch.nn.Module):
            todo.append(_lightning_strategy_model(obj))
    return None


def _wrapped(optimizer: Any) -> Iterator[Any]:
    """`optimizer`, then each optimizer it wraps (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``: the inner one in ``.optimizer`` / ``._optimizer``)."""
    seen, obj = set(), optimizer
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        yield obj
        attrs = getattr(obj, "__dict__", {})
        obj = next((attrs[n] for n in _OPTIMIZER_ATTRS if attrs.get(n) is not None), None)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The lbcomm optimizer inside accelerate's ``AcceleratedOptimizer`` or Lightning's
    ``LightningOptimizer`` (or `optimizer` itself)."""
    return next((o for o in _wrapped(optimizer) if isinstance(o, LBCOMM_OPTIMIZERS)), optimizer)


def refuse_norm_clipping(framework_clip: str, unset: str, callback_clip: str, optimizer_name: str,
                         max_grad_norm: Optional[float]) -> None:
    """Raise for a framework's own clipping by norm (`framework_clip`, e.g.
    ``TrainingArguments(max_grad_norm=1.0)``) beside a lbcomm optimizer: after the freeze the
    gradients are local to each rank (always with Lamb), so each rank would clip by its own
    norm. The message names the fix: `unset` the framework's clipping and clip with
    `callback_clip` (the callback's one norm for all ranks)."""
    if max_grad_norm is not None:
        raise ValueError(f"LbcommCallback(max_grad_norm={max_grad_norm}) clips by one norm for all ranks, and "
                         f"{framework_clip} would clip each rank by its own norm as well; {unset}")
    raise ValueError(f"LbcommCallback: {framework_clip} clips every rank's gradient by its own norm, and with "
                     f"lbcomm.{optimizer_name} the gradients are local to each rank (after the freeze; always with "
                     f"Lamb). Clip by one norm for all ranks instead: {unset} and {callback_clip}")


def hook_for(hook_state: Any):
    """The DDP communication hook of a hook state (`onebit_hook` for a `OneBitHookState`,
    `dct_hook` for a `DCTHookState`), or None for any other object."""
    return next((hook for cls, hook in _HOOKS if isinstance(hook_state, cls)), None)


def check_callback_args(who: str, hook_state: Any, max_grad_norm: Optional[float],
                        local_updates: Any = None) -> None:
    """The argument checks of the frameworks' callbacks (`who` names the callback in the
    error): `hook_state` None or one of `HOOK_STATES`, `local_updates` None or a
    `OneBitLocalUpdates` (not both: DDP takes one communication hook), `max_grad_norm`
    None or > 0 (and not with local updates)."""
    if hook_state is not None and hook_for(hook_state) is None:
        raise TypeError(f"{who}: hook_state must be a lbcomm.OneBitHookState or lbcomm.DCTHookState, got "
                        f"{type(hook_state).__name__}")
    if local_updates is not None and not (isinstance(local_updates, OneBitLocalUpdates) or callable(local_updates)):
        raise TypeError(f"{who}: local_updates must be a lbcomm.OneBitLocalUpdates, or a function (model, optimizer) "
                        f"-> OneBitLocalUpdates, got {type(local_updates).__name__}")
    if hook_state is not None and local_updates is not None:
        raise ValueError(f"{who}: hook_state= compresses DDP's gradient communication at every step and "
                         "local_updates= turns it off (every rank steps on its own gradient, the ranks meet every "
                         "sync_every steps); DDP takes one communication hook, so pass one of them")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                      or not max_grad_norm > 0):
        raise ValueError(f"{who}: invalid max_grad_norm {max_grad_norm!r} (must be a number > 0, or None)")
    if max_grad_norm is not None and local_updates is not None:
        raise ValueError(f"{who}: max_grad_norm clips with a lbcomm optimizer's clip_grad_norm_ (one norm for all "
                         "ranks); with local_updates= every rank steps on its own gradient and clips it by its own "
                         "norm, as DiLoCo's inner steps do: use the framework's clipping (TrainingArguments("
                         "max_grad_norm=...), Trainer(gradient_clip_val=...)) instead")


def check_not_communicating(who: str, optimizer: Any, hook_state: Any = None) -> None:
    """A hook state's gradients (`hook_state`: a `OneBitHookState` when None) must go to an
    optimizer that does not communicate by itself: a 1-bit optimizer would compress them a
    second time (two error feedbacks on one signal) and raises `DoubleCompressionError`;
    `lbcomm.Lamb` would average the already averaged gradients again (ValueError)."""
    opt = unwrap_optimizer(optimizer)
    name = type(opt).__name__
    state = "OneBitHookState" if hook_state is None else type(hook_state).__name__
    hook = (hook_for(hook_state) or onebit_hook).__name__
    if isinstance(opt, ONEBIT_OPTIMIZERS):
        raise DoubleCompressionError(
            f"{who}: lbcomm.{name} compresses its own communication (its momentum, after the freeze), and the "
            f"{state}'s {hook} would compress the gradients it steps on first: two compressors on the "
            f"same gradients. Drop the hook state and attach the optimizer instead: lbcomm.attach(model, opt) (for "
            f"the frameworks' callbacks: LbcommCallback without hook_state=), or keep the hook with an optimizer "
            f"that does not communicate (torch.optim.AdamW, SGD, ...)")
    if isinstance(opt, LBCOMM_OPTIMIZERS):
        raise ValueError(f"{who}: lbcomm.{name} averages its gradients itself, and the {state}'s {hook} "
                         "would have averaged them already. Attach the optimizer instead: lbcomm.attach(model, opt) "
                         "(LbcommCallback without hook_state=), or use the hook with a torch optimizer")


def make_local_updates(who: str, make, model: torch.nn.Module, optimizers) -> OneBitLocalUpdates:
    """The callbacks' ``local_updates=`` given as a function: ``make(model, optimizer)``,
    called when training begins with the unwrapped model and the framework's one optimizer
    (the innermost, out of accelerate's / Lightning's wrappers), must return the
    `OneBitLocalUpdates` whose inner optimizer that is. By then torch.distributed is
    initialized and the model is on its device, which the local updates need when they
    are built."""
    optimizers = list(optimizers)
    if len(optimizers) != 1:
        raise ValueError(f"{who}: local updates step one inner optimizer, and the framework has {len(optimizers)}")
    *_, inner = _wrapped(optimizers[0])
    local = make(model, inner)
    if not isinstance(local, OneBitLocalUpdates):
        raise TypeError(f"{who}: local_updates(model, optimizer) must return a lbcomm.OneBitLocalUpdates, got "
                        f"{type(local).__name__}")
    return local


def check_local_updates(who: str, local: OneBitLocalUpdates, optimizers=()) -> None:
    """Under DDP, a `OneBitLocalUpdates` needs: an inner optimizer that does not
    communicate by itself (a lbcomm optimizer would average or compress every step, and the
    steps would not be local); each of `optimizers` (the ones the framework steps, or their
    accelerate / Lightning wrappers) being that inner optimizer (otherwise `local.step()`
    would follow steps it does not know, and its own inner optimizer would never step); its
    anchors on the parameters' device (it was built before the model was moved)."""
    inner = local.inner
    if isinstance(unwrap_optimizer(inner), LBCOMM_OPTIMIZERS):  # also inside accelerate's wrapper
        raise ValueError(f"{who}: the OneBitLocalUpdates' inner optimizer is lbcomm."
                         f"{type(unwrap_optimizer(inner)).__name__}, which "
                         "communicates at every step by itself, so the inner steps would not be local. Use a torch "
                         "optimizer (torch.optim.AdamW, SGD, ...) as the inner optimizer")
    for opt in optimizers:
        if not any(o is inner for o in _wrapped(opt)):
            raise ValueError(f"{who}: the optimizer that steps the model ({type(unwrap_optimizer(opt)).__name__}) is "
                             f"not the OneBitLocalUpdates' inner optimizer ({type(inner).__name__}); local.step() "
                             "must follow the steps of its own inner optimizer. Give the framework that same object "
                             "(transformers: Trainer(optimizers=(inner, scheduler)); Lightning: configure_optimizers "
                             "returns it)")
    anchor, param = local.fragments[0].anchor.device, local.params[0].device
    if anchor != param:
        raise ValueError(f"{who}: the OneBitLocalUpdates was built with its parameters on {anchor} and they are now "
                         f"on {param}; build it after the model has been moved to its device")


def check_hook_momentum(who: str, hook_state: Any, optimizers) -> None:
    """With ``OneBitHookState(momentum=mu)`` the hook hands the optimizer m^_t - mu m^_{t-1}
    (see `OneBitHookState`'s ``momentum``), which is right only for ``torch.optim.SGD``
    with that same momentum: another SGD momentum raises. SGD with momentum under a hook
    that compresses the gradients gets a logged hint: compressing the momentum instead
    keeps SGD's momentum from summing the compression errors of many steps. Only a
    `OneBitHookState` has a momentum setting: nothing is checked for another hook state."""
    if not isinstance(hook_state, OneBitHookState):
        return
    for opt in optimizers:
        *_, inner = _wrapped(opt)  # the innermost: accelerate's wrapper is an Optimizer too
        if not isinstance(inner, torch.optim.SGD):
            continue
        moms = sorted({float(g.get("momentum", 0.0)) for g in inner.param_groups})
        if hook_state.momentum is not None and moms != [hook_state.momentum]:
            raise ValueError(f"{who}: OneBitHookState(momentum={hook_state.momentum}) must equal the SGD's momentum "
                             f"(its param groups have {moms}): the hook hands SGD m^_t - momentum m^_(t-1), which "
                             "another momentum turns into wrong steps. Set the hook's momentum to the SGD's, or None")
        if hook_state.momentum is None and any(m > 0 for m in moms):
            _log.info("%s: SGD with momentum %s under a hook that compresses gradients; "
                      "OneBitHookState(momentum=%s, normalize='adaptive') compresses the momentum instead and "
                      "converges closer to full precision (docs/hooks.md, 'SGD with momentum')",
                      who, moms[-1], moms[-1])


def _same_group(a, b) -> bool:
    """Whether two process groups (None = the default group) are the same."""
    world = dist.group.WORLD
    return (world if a is None else a) is (world if b is None else b)


def attach(model: Any, optimizer_or_hook_state: Any, *, optimizer: Any = None,
           warmup_fp16: bool = False) -> Optional[DistributedDataParallel]:
    """Register lbcomm's DDP communication hook on the DDP inside `model`.

    Args:
        model: a `DistributedDataParallel`, or anything that wraps one: what
            ``accelerator.prepare`` returns, transformers' ``trainer.model_wrapped``,
            Lightning's ``trainer.strategy.model`` (or the Trainer, or the LightningModule
            it trains), ``torch.compile(ddp_model)``.
        optimizer_or_hook_state: a lbcomm optimizer (`OneBitAdam`, `OneBitLamb`,
            `Lamb`; also inside accelerate's/Lightning's optimizer wrappers) ->
            `warmup_average_hook`; a `OneBitHookState` (with any optimizer) -> `onebit_hook`;
            a `DCTHookState` (with any optimizer) -> `dct_hook`; a `OneBitLocalUpdates` ->
            `lbcomm.ddp.local_gradients_hook` (DDP communicates nothing; call
            ``local.step()`` after every ``inner.step()`` as without DDP).
        optimizer (optional): with a hook state, the optimizer that steps on the hook's
            gradients (or its accelerate / Lightning wrapper, or a list of them), checked
            against the state: a 1-bit optimizer (`OneBitAdam`, `OneBitLamb`,
            `ZeroOneAdam`) raises `lbcomm.errors.DoubleCompressionError` (it compresses by
            itself), `Lamb` a ValueError (it averages by itself); with a `OneBitHookState`,
            ``torch.optim.SGD`` whose momentum differs from ``OneBitHookState(momentum=)``
            raises (the steps would be wrong) and SGD with momentum under the
            gradient-compressing default logs a hint. It is also the optimizer the state's
            ``check_resume`` watches: a resume that restores it but not the hook state warns
            (default: None, nothing checked). With a `OneBitLocalUpdates`, it must be (or
            wrap) the local updates' inner optimizer. The frameworks' callbacks always pass it.
        warmup_fp16 (bool, optional): with a lbcomm optimizer, average the warmup gradients
            in fp16 (``WarmupAverage(opt, torch.float16)``) (default: False).

    Returns:
        The `DistributedDataParallel` the hook was registered on, or None with one process
        (world size 1, no DDP): there is nothing to communicate, and a lbcomm optimizer or
        hook state then runs uncompressed (logged at INFO).

    Calling it again with the same optimizer or state is a no-op (frameworks' callbacks
    may attach a model the user already attached).

    Raises:
        DoubleCompressionError: a hook state with ``optimizer=`` a 1-bit optimizer.
        ValueError: no DDP found with more than one process; a hook (another one, or this
            one with another state) is already registered; the optimizer, state or local
            updates communicate over another process group than the DDP; a
            `OneBitLocalUpdates` whose inner optimizer is a lbcomm optimizer, or is not
            ``optimizer=``.
        TypeError: an object that is none of the above; an FSDP model; ``optimizer=``
            with a lbcomm optimizer (it is the first argument).

    Example::

        >>> # xdoctest: +SKIP
        >>> model, opt = accelerator.prepare(model, lbcomm.OneBitAdam(model.parameters(), freeze_step=1000))
        >>> lbcomm.attach(model, opt)
    """
    target = unwrap_optimizer(optimizer_or_hook_state)
    optimizers = [o for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]) if o is not None]
    what = type(target).__name__
    if isinstance(target, LBCOMM_OPTIMIZERS):
        if optimizer is not None:
            raise TypeError("lbcomm.attach: optimizer= is for a hook state or a OneBitLocalUpdates (the optimizer "
                            f"stepping on the hook's gradients); {what} is the optimizer already: attach(model, opt)")
        hook = warmup_average_hook
        group, group_fix = target.process_group, "build it with process_group=<the DDP's process group>"
    elif hook_for(target) is not None:
        if warmup_fp16:
            raise ValueError(f"lbcomm.attach: warmup_fp16 applies to lbcomm optimizers; a {what} averages "
                             "its first start_iter iterations at the bucket's own precision")
        hook = hook_for(target)
        # Before anything is registered: a refused pairing leaves the DDP as it was.
        for opt in optimizers:
            check_not_communicating("lbcomm.attach", opt, target)
        check_hook_momentum("lbcomm.attach", target, optimizers)
        if optimizers:  # a resume that forgets the hook state is named
            target.check_resume(unwrap_optimizer(optimizers[0]))
        group = target.process_group
        group_fix = f"build it with {what}(comm=lbcomm.CommConfig(process_group=<the DDP's process group>))"
    elif isinstance(target, OneBitLocalUpdates):
        if warmup_fp16:
            raise ValueError("lbcomm.attach: warmup_fp16 applies to lbcomm optimizers; with a OneBitLocalUpdates "
                             "DDP communicates nothing")
        hook = local_gradients_hook
        check_local_updates("lbcomm.attach", target, optimizers)
        # its synchronizations run on its own transport; an MPI one has no torch group to compare
        group = dist.group.WORLD if target.comm.backend == "mpi" else target.comm.process_group
        group_fix = "build it with OneBitLocalUpdates(comm=lbcomm.CommConfig(process_group=<the DDP's process group>))"
    elif isinstance(target, torch.optim.Optimizer):
        raise TypeError(f"lbcomm.attach: {what} is not a lbcomm optimizer, so it cannot compress "
                        "anything itself. Either use lbcomm.OneBitAdam / lbcomm.OneBitLamb, or keep this optimizer "
                        "and pass a hook state: lbcomm.attach(model, lbcomm.OneBitHookState(start_iter=...), "
                        "optimizer=opt) (or lbcomm.DCTHookState)")
    else:
        raise TypeError(f"lbcomm.attach: expected a lbcomm optimizer (OneBitAdam, OneBitLamb, Lamb), a "
                        f"lbcomm.OneBitHookState or lbcomm.DCTHookState, or a lbcomm.OneBitLocalUpdates, got {what}")

    ddp = find_ddp(model)
    if ddp is None:
        world, _ = world_info()
        if world == 1:
            _log.info("lbcomm.attach: one process and no DistributedDataParallel in %s; nothing to communicate, "
                      "so nothing is attached (%s runs uncompressed)", type(model).__name__, what)
            return None
        raise ValueError(
            f"lbcomm.attach: found no DistributedDataParallel in {type(model).__name__} (world size {world}). Pass "
            "the wrapped model: ddp_model / accelerator.prepare(model) / trainer.model_wrapped / "
            "trainer.strategy.model. Without DDP, a lbcomm optimizer communicates by itself and a "
            "OneBitLocalUpdates trains the plain module, so neither needs attach; a hook state needs DDP.")

    if hook is local_gradients_hook and target.world_size != world_info(ddp.process_group)[0]:
        raise ValueError(f"lbcomm.attach: the OneBitLocalUpdates synchronizes {target.world_size} rank(s) and the DDP "
                         f"model {world_info(ddp.process_group)[0]}: it was built before torch.distributed was "
                         "initialized (transformers initializes it with TrainingArguments, Lightning in fit: build "
                         "the local updates after that), or over another group")
    if not _same_group(group, ddp.process_group):
        who = "the optimizer reduces" if hook is warmup_average_hook else f"the {what} communicates"
        raise ValueError(f"lbcomm.attach: {who} over another process group than the DDP model; {group_fix}")

    state = target
    if hook is warmup_average_hook:
        state = WarmupAverage(target, torch.float16 if warmup_fp16 else torch.float32,
                              process_group=target.process_group)
    registered = getattr(ddp, "_comm_hooks", None)  # DDP keeps [(hook, state)]; read only
    if registered:
        if any(h is hook and getattr(s, "optimizer", s) is target for h, s in registered):
            _log.debug("lbcomm.attach: %s is already registered with this state", hook.__name__)
            return ddp
        names = ", ".join(getattr(h, "__name__", repr(h)) for h, _ in registered)
        raise ValueError(f"lbcomm.attach: the DDP model already has a communication hook ({names}); DDP takes one. "
                         "Remove the other registration (e.g. accelerate's comm_hook setting, Lightning's "
                         "ddp_comm_hook, an earlier register_comm_hook) and let lbcomm.attach register its hook.")
    try:
        ddp.register_comm_hook(state, hook)
    except RuntimeError as exc:  # e.g. a built-in (C++) hook that `_comm_hooks` does not list
        raise ValueError(f"lbcomm.attach: DDP refused the hook ({exc}); the model already has a communication "
                         "hook. Remove the other registration and let lbcomm.attach register its hook.") from exc
    _log.info("lbcomm.attach: registered %s on the DistributedDataParallel (%s ranks) with %s", hook.__name__,
              world_info(ddp.process_group)[0], what)
    return ddp
