"""`attach`: register the right lbcomm DDP communication hook on whatever wraps the model.

Training frameworks wrap the `torch.nn.parallel.DistributedDataParallel` they create in
their own objects (accelerate may compile it, Lightning keeps it in
``trainer.strategy.model``, `torch.compile` returns an ``OptimizedModule``), so the
usual ``ddp_model.register_comm_hook(...)`` first needs the DDP. `find_ddp` looks for it
through these wrappers; `attach` registers

* `lbcomm.ddp.warmup_average_hook` with a `WarmupAverage` of the optimizer for a lbcomm optimizer
  (`OneBitAdam`, `OneBitLamb`, `Lamb`): DDP averages the gradients during the warmup and
  communicates nothing after the freeze, where the optimizer compresses its momentum;
* `lbcomm.onebit_hook` for a `OneBitHookState` (an optimizer that does not communicate
  by itself; ``optimizer=`` names it, and a 1-bit optimizer there raises
  `lbcomm.errors.DoubleCompressionError`): every gradient bucket goes through the 1-bit
  compressed allreduce.

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
from ..ddp import OneBitHookState, WarmupAverage, onebit_hook, warmup_average_hook
from ..errors import DoubleCompressionError
from ..optim import Lamb, OneBitAdam, OneBitLamb, ZeroOneAdam

__all__ = ["attach", "find_ddp", "unwrap_optimizer", "check_callback_args", "check_not_communicating",
           "refuse_norm_clipping",
           "LBCOMM_OPTIMIZERS", "ONEBIT_OPTIMIZERS"]

_log = logging.getLogger(__name__)

#: The lbcomm optimizers that compress their own communication (the momentum, after the freeze).
ONEBIT_OPTIMIZERS = (OneBitAdam, OneBitLamb, ZeroOneAdam)
#: The lbcomm optimizers that average or compress by themselves: they pair with
#: `warmup_average_hook` (DDP averages their warmup gradients, or nothing at all).
LBCOMM_OPTIMIZERS = ONEBIT_OPTIMIZERS + (Lamb,)

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


def check_callback_args(who: str, hook_state: Any, max_grad_norm: Optional[float]) -> None:
    """The argument checks of the frameworks' callbacks (`who` names the callback in the
    error): `hook_state` None or a `OneBitHookState`, `max_grad_norm` None or > 0."""
    if hook_state is not None and not isinstance(hook_state, OneBitHookState):
        raise TypeError(f"{who}: hook_state must be a lbcomm.OneBitHookState, got {type(hook_state).__name__}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                      or not max_grad_norm > 0):
        raise ValueError(f"{who}: invalid max_grad_norm {max_grad_norm!r} (must be a number > 0, or None)")


def check_not_communicating(who: str, optimizer: Any) -> None:
    """A OneBitHookState's gradients must go to an optimizer that does not communicate by
    itself: a 1-bit optimizer would compress them a second time (two error feedbacks on
    one signal) and raises `DoubleCompressionError`; `lbcomm.Lamb` would average the
    already averaged gradients again (ValueError)."""
    opt = unwrap_optimizer(optimizer)
    name = type(opt).__name__
    if isinstance(opt, ONEBIT_OPTIMIZERS):
        raise DoubleCompressionError(
            f"{who}: lbcomm.{name} compresses its own communication (its momentum, after the freeze), and the "
            f"OneBitHookState's onebit_hook would compress the gradients it steps on first: two compressors on the "
            f"same gradients. Drop the hook state and attach the optimizer instead: lbcomm.attach(model, opt) (for "
            f"the frameworks' callbacks: LbcommCallback without hook_state=), or keep the hook with an optimizer "
            f"that does not communicate (torch.optim.AdamW, SGD, ...)")
    if isinstance(opt, LBCOMM_OPTIMIZERS):
        raise ValueError(f"{who}: lbcomm.{name} averages its gradients itself, and the OneBitHookState's onebit_hook "
                         "would have averaged them already. Attach the optimizer instead: lbcomm.attach(model, opt) "
                         "(LbcommCallback without hook_state=), or use the hook with a torch optimizer")


def check_hook_momentum(who: str, hook_state: Optional[OneBitHookState], optimizers) -> None:
    """With ``OneBitHookState(momentum=mu)`` the hook hands the optimizer m^_t - mu m^_{t-1}
    (see `OneBitHookState`'s ``momentum``), which is right only for ``torch.optim.SGD``
    with that same momentum: another SGD momentum raises. SGD with momentum under a hook
    that compresses the gradients gets a logged hint: compressing the momentum instead
    keeps SGD's momentum from summing the compression errors of many steps."""
    if hook_state is None:
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
            `warmup_average_hook`; a `OneBitHookState` (with any optimizer) -> `onebit_hook`.
        optimizer (optional): with a `OneBitHookState`, the optimizer that steps on the
            hook's gradients (or its accelerate / Lightning wrapper, or a list of them),
            checked against the state: a 1-bit optimizer (`OneBitAdam`, `OneBitLamb`,
            `ZeroOneAdam`) raises `lbcomm.errors.DoubleCompressionError` (it compresses by
            itself), `Lamb` a ValueError (it averages by itself); ``torch.optim.SGD`` whose
            momentum differs from ``OneBitHookState(momentum=)`` raises (the steps would be
            wrong); SGD with momentum under the gradient-compressing default logs a hint.
            It is also the optimizer `OneBitHookState.check_resume` watches: a resume that
            restores it but not the hook state warns (default: None, nothing checked). The
            frameworks' callbacks always pass it.
        warmup_fp16 (bool, optional): with a lbcomm optimizer, average the warmup gradients
            in fp16 (``WarmupAverage(opt, torch.float16)``) (default: False).

    Returns:
        The `DistributedDataParallel` the hook was registered on, or None with one process
        (world size 1, no DDP): there is nothing to communicate, and a lbcomm optimizer or
        hook state then runs uncompressed (logged at INFO).

    Calling it again with the same optimizer or state is a no-op (frameworks' callbacks
    may attach a model the user already attached).

    Raises:
        DoubleCompressionError: a `OneBitHookState` with ``optimizer=`` a 1-bit optimizer.
        ValueError: no DDP found with more than one process; a hook (another one, or this
            one with another state) is already registered; the optimizer reduces over
            another process group than the DDP.
        TypeError: an object that is neither a lbcomm optimizer nor a `OneBitHookState`;
            an FSDP model; ``optimizer=`` with a lbcomm optimizer (it is the first argument).

    Example::

        >>> # xdoctest: +SKIP
        >>> model, opt = accelerator.prepare(model, lbcomm.OneBitAdam(model.parameters(), freeze_step=1000))
        >>> lbcomm.attach(model, opt)
    """
    target = unwrap_optimizer(optimizer_or_hook_state)
    if isinstance(target, LBCOMM_OPTIMIZERS):
        if optimizer is not None:
            raise TypeError("lbcomm.attach: optimizer= is for a OneBitHookState (the optimizer stepping on the "
                            f"hook's gradients); {type(target).__name__} is the optimizer already: attach(model, opt)")
        hook = warmup_average_hook
    elif isinstance(target, OneBitHookState):
        if warmup_fp16:
            raise ValueError("lbcomm.attach: warmup_fp16 applies to lbcomm optimizers; a OneBitHookState averages "
                             "its first start_iter iterations at the bucket's own precision")
        hook = onebit_hook
        # Before anything is registered: a refused pairing leaves the DDP as it was.
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        for opt in (o for o in optimizers if o is not None):
            check_not_communicating("lbcomm.attach", opt)
        check_hook_momentum("lbcomm.attach", target, [o for o in optimizers if o is not None])
        for opt in (o for o in optimizers if o is not None):  # a resume that forgets the hook state is named
            target.check_resume(unwrap_optimizer(opt))
            break
    elif isinstance(target, torch.optim.Optimizer):
        raise TypeError(f"lbcomm.attach: {type(target).__name__} is not a lbcomm optimizer, so it cannot compress "
                        "anything itself. Either use lbcomm.OneBitAdam / lbcomm.OneBitLamb, or keep this optimizer "
                        "and pass a hook state: lbcomm.attach(model, lbcomm.OneBitHookState(start_iter=...))")
    else:
        raise TypeError(f"lbcomm.attach: expected a lbcomm optimizer (OneBitAdam, OneBitLamb, Lamb) or a "
                        f"lbcomm.OneBitHookState, got {type(optimizer_or_hook_state).__name__}")

    ddp = find_ddp(model)
    if ddp is None:
        world, _ = world_info()
        if world == 1:
            _log.info("lbcomm.attach: one process and no DistributedDataParallel in %s; nothing to communicate, "
                      "so nothing is attached (%s runs uncompressed)", type(model).__name__, type(target).__name__)
            return None
        raise ValueError(
            f"lbcomm.attach: found no DistributedDataParallel in {type(model).__name__} (world size {world}). Pass "
            "the wrapped model: ddp_model / accelerator.prepare(model) / trainer.model_wrapped / "
            "trainer.strategy.model. Without DDP, a lbcomm optimizer communicates by itself and needs no attach; "
            "a OneBitHookState needs DDP.")

    if hook is not onebit_hook and not _same_group(target.process_group, ddp.process_group):
        raise ValueError("lbcomm.attach: the optimizer reduces over another process group than the DDP model; "
                         "build it with process_group=<the DDP's process group>")
    if hook is onebit_hook and not _same_group(target.process_group, ddp.process_group):
        raise ValueError("lbcomm.attach: the OneBitHookState has another process group than the DDP model; "
                         "build it with OneBitHookState(comm=lbcomm.CommConfig(process_group=<the DDP's process "
                         "group>))")

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
              world_info(ddp.process_group)[0], type(target).__name__)
    return ddp
