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
rank.

Another world size (elastic resume) for a lbcomm optimizer and a `OneBitHookState`:
load with ``planner=ElasticLoadPlanner()``. It asks DCP for the items of every saved rank
(their names are in the checkpoint's metadata), and every rank redistributes the saved
error feedback onto the new world as `lbcomm.load_sharded` does (the total carried error,
mean worker error + server error, is preserved; `lbcomm.reducer.redistribute`)::

    dcp.load(state, checkpoint_id="ckpt", planner=ElasticLoadPlanner())

Every rank then reads every saved rank's item (the optimizer's moments included, so
old-world-size x the optimizer state, briefly). With the saving world size the planner
changes nothing. Without it a missing item makes ``dcp.load`` raise (DCP reports the
missing key ``<name>.rank<r>-of-<world>``).
"""
from __future__ import annotations

import io
import logging
import re
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner

from ..checkpoint import redistribute_optimizer_state
from ..ddp import OneBitHookState
from .attach import LBCOMM_OPTIMIZERS, unwrap_optimizer

__all__ = ["RankLocal", "ElasticLoadPlanner"]

_log = logging.getLogger(__name__)
_KEY = re.compile(r"rank(\d+)-of-(\d+)")


class _RankEntries(dict):
    """What `RankLocal.state_dict` returns: ``{"rank<r>-of-<world>": bytes}``; ``own`` is
    this rank's key (`ElasticLoadPlanner` looks for these)."""

    own: str = ""


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
        out = _RankEntries({self._key(): buf.getvalue()})
        out.own = self._key()
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        key = self._key()
        if key in state_dict:
            self.obj.load_state_dict(_decode(state_dict[key]))
            return
        saved = sorted((int(m.group(1)), int(m.group(2)), k) for k in state_dict if (m := _KEY.fullmatch(k)))
        old = {w for _, w, _ in saved}
        if not saved or len(old) != 1 or [r for r, _, _ in saved] != list(range(saved[0][1])):
            raise KeyError(f"RankLocal: the checkpoint has no entry {key!r} (saved entries: {sorted(state_dict)}); "
                           "to resume lbcomm state at another world size pass "
                           "planner=lbcomm.integrations.dcp.ElasticLoadPlanner() to dcp.load")
        target = unwrap_optimizer(self.obj)
        if not isinstance(target, (OneBitHookState, *LBCOMM_OPTIMIZERS)):
            raise KeyError(f"RankLocal: the checkpoint was saved by {saved[0][1]} ranks and has no entry {key!r}; "
                           f"only lbcomm optimizers and OneBitHookState can be redistributed onto another world size, "
                           f"not {type(target).__name__}")
        m = _KEY.fullmatch(key)
        rank, world = int(m.group(1)), int(m.group(2))
        states: List[Dict[str, Any]] = [_decode(state_dict[k]) for _, _, k in saved]
        mine = states[rank % len(states)]
        if isinstance(target, OneBitHookState):
            target.load_state_dict(mine, all_ranks=states)
        else:
            redistribute_optimizer_state(mine, states, world, rank, where="the DCP checkpoint")
            self.obj.load_state_dict(mine)


def _decode(blob: Any) -> Dict[str, Any]:
    if isinstance(blob, io.BytesIO):
        blob = blob.getvalue()
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


class ElasticLoadPlanner(DefaultLoadPlanner):
    """``dcp.load(..., planner=ElasticLoadPlanner())``: resume `RankLocal` items saved by
    another world size. For every `RankLocal` whose own item (``rank<r>-of-<world>``) the
    checkpoint lacks, it requests the items of every saved rank instead (named in the
    checkpoint's metadata), and `RankLocal.load_state_dict` redistributes their error
    feedback onto this world. Everything else is DCP's `DefaultLoadPlanner` (its arguments
    are accepted as they are)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            names = metadata.state_dict_metadata
            for name, value in state_dict.items():
                if isinstance(value, _RankEntries) and f"{name}.{value.own}" not in names:
                    prefix = f"{name}."
                    saved = [k[len(prefix):] for k in names if k.startswith(prefix) and _KEY.fullmatch(k[len(prefix):])]
                    if saved:
                        value.clear()
                        value.update({k: b"" for k in saved})  # placeholders that DCP fills
        super().set_up_planner(state_dict, metadata, is_coordinator)
