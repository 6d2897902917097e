"""torch.distributed.checkpoint (DCP) support: every rank's lbcomm state as its own item.

DCP assumes that a plain (non-DTensor) entry with the same key on every rank is
replicated and writes it once. The state of a 1-bit optimizer and of a `OneBitHookState`
is not: every rank keeps its own compression error feedback. `RankLocal` wraps such an
object in DCP's ``Stateful`` protocol under a key that names the rank, so DCP writes one
item per rank and every rank reads back its own::

    import torch.distributed.checkpoint as dcp
    from lbcomm.integrations.dcp import RankLocal

    dcp.save({"model": model.state_dict(), "optim": RankLocal(opt)}, checkpoint_id="ckpt")
    state = {"model": model.state_dict(), "optim": RankLocal(opt)}
    dcp.load(state, checkpoint_id="ckpt")      # same world size: bitwise exact continuation
    model.load_state_dict(state["model"])

Each item is the object's own ``state_dict()``, serialized with ``torch.save`` (DCP stores
non-tensor items that way too); the optimizer's moments are therefore stored once per
rank. Loading needs the saving world size: a rank whose item is missing makes
``dcp.load`` raise (DCP reports the missing key ``<name>.rank<r>-of-<world>``).
"""
from __future__ import annotations

import io
import logging
from typing import Any, Dict

import torch
import torch.distributed as dist

__all__ = ["RankLocal"]

_log = logging.getLogger(__name__)


class RankLocal:
    """DCP ``Stateful`` view of an object whose state differs between ranks.

    Args:
        obj: anything with ``state_dict()`` and ``load_state_dict(sd)``: a lbcomm optimizer
            (also inside accelerate's wrapper), a `OneBitHookState`.
        group (ProcessGroup, optional): the group whose rank names the item (default: the world).

    ``state_dict()`` returns ``{"rank<r>-of-<world>": <bytes of obj.state_dict()>}``;
    ``load_state_dict`` reads this rank's entry back into `obj`.
    """

    def __init__(self, obj: Any, group=None):
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"RankLocal: {type(obj).__name__} has no state_dict()/load_state_dict()")
        self.obj = obj
        self.group = group

    def _key(self) -> str:
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        else:
            rank, world = 0, 1
        return f"rank{rank}-of-{world}"

    def state_dict(self) -> Dict[str, bytes]:
        buf = io.BytesIO()
        torch.save(self.obj.state_dict(), buf)
        return {self._key(): buf.getvalue()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        key = self._key()
        if key not in state_dict:
            raise KeyError(f"RankLocal: the checkpoint has no entry {key!r} (saved entries: {sorted(state_dict)}); "
                           "DCP checkpoints of lbcomm state are loaded with the world size that saved them")
        blob = state_dict[key]
        if isinstance(blob, io.BytesIO):
            blob = blob.getvalue()
        self.obj.load_state_dict(torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True))
