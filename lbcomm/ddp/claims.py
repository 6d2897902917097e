"""One compressor per gradient ("never silent": a misconfigured stack raises an error
that names the fix instead of training on quietly; see docs/hooks.md).

`onebit_hook` compresses the gradients of its DDP model; a 1-bit optimizer (OneBitAdam,
OneBitLamb) compresses its momentum, which is formed from the same gradients. Stacked,
the gradients would be compressed twice. Each of them claims the parameters it
compresses with `claim_gradients`; a claim on a parameter that a live compressor of the
other kind holds raises an error that names the fix. Claims are weak: a collected hook
state or optimizer releases its parameters.

`AveragedGradientsError` is the other half of the rule, raised by the 1-bit optimizers:
gradients that reach them already averaged by a DDP without lbcomm's hook (DDP's
full-precision allreduce would run next to the optimizer's own communication).
"""
import weakref
from typing import Iterable, Optional

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import AveragedGradientsError, DoubleCompressionError

__all__ = ["claim_gradients", "compressed_by_hook", "DoubleCompressionError", "AveragedGradientsError", "HOOK"]

HOOK = "onebit_hook"

_claims = WeakIdKeyDictionary()  # parameter -> (kind, weakref to its compressor)


def claim_gradients(params: Iterable[Tensor], owner, kind: str) -> None:
    """Record that `owner` compresses the communication of `params`: a `OneBitHookState`
    (`kind` = ``HOOK``) or a 1-bit optimizer (`kind` = its class name).

    Raises:
        DoubleCompressionError: one of them is held by a live compressor such that one of
            the two is onebit_hook and the other a 1-bit optimizer.
    """
    ref = weakref.ref(owner)
    for p in params:
        held = _claims.get(p)
        if held is not None and (held[0] == HOOK) != (kind == HOOK) and held[1]() is not None:
            optimizer = held[0] if kind == HOOK else kind
            raise DoubleCompressionError(
                f"{kind}: parameters of this model are already compressed by {held[0]}; onebit_hook compresses the "
                f"gradients and {optimizer} compresses its momentum, so they would be compressed twice. With a 1-bit "
                "optimizer register its own hook, ddp_model.register_comm_hook(optimizer, "
                "lbcomm.ddp.onebit_optimizer_hook); use onebit_hook with an optimizer that does not compress (SGD, "
                "AdamW, lbcomm.Lamb, ...).")
        _claims[p] = (kind, ref)


def held_by(param: Tensor) -> Optional[str]:
    """The kind of the live compressor that claimed `param` (``HOOK`` or a 1-bit optimizer's
    class name), or None."""
    held = _claims.get(param)
    return held[0] if held is not None and held[1]() is not None else None


def compressed_by_hook(params: Iterable[Tensor]) -> bool:
    """Whether a live `onebit_hook` state has claimed any of `params` (its DDP then delivers
    their gradients averaged over the ranks; `lbcomm.Lars` does not average them again)."""
    return any(held_by(p) == HOOK for p in params)
