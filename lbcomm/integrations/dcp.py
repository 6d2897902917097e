"""torch.distributed.checkpoint (DCP) support: every rank's lbcomm state as its own item.

DCP assumes that a plain (non-DTensor) entry with the same key on every rank is
replicated and writes it once. The state of a 1-bit optimizer and of a compressor's hook
state (`OneBitHookState`, `lbcomm.fsdp.OneBitHSDPState`) is not: every rank keeps its own
compression error feedback. `RankLocal` wraps such an object in DCP's ``Stateful``
protocol under a key that names the rank, so DCP writes one item per rank and every rank
reads back its own; load with ``planner=LoadPlanner()``::

    import torch.distributed.checkpoint as dcp
    from lbcomm.integrations.dcp import LoadPlanner, RankLocal

    dcp.save({"model": model.state_dict(), "optim": RankLocal(opt)}, checkpoint_id="ckpt")
    state = {"model": model.state_dict(), "optim": RankLocal(opt)}
    dcp.load(state, checkpoint_id="ckpt", planner=LoadPlanner())   # bitwise exact continuation
    model.load_state_dict(state["model"])

Each item is the object's own ``state_dict()``, serialized with ``torch.save`` (DCP stores
non-tensor items that way too); the optimizer's moments are therefore stored once per
rank. Beside the per-rank items, every `RankLocal` records the class of the object it
saved (a ``holds:<class>`` key in the checkpoint's metadata).

`LoadPlanner` checks what the load restores: a checkpoint holding `RankLocal` items that
the loaded state does not name (model and optimizer restored, a compressor's error
feedback not, so the run silently continues from zero error feedback and ends elsewhere)
raises `MissingRankLocalError` naming the key, the class and what to pass. A `RankLocal`
loaded without the planner warns that nothing was checked.

Another world size (elastic resume) for a lbcomm optimizer, a hook state
(`OneBitHookState`, `DCTHookState`, `OneBitHSDPState`) and `OneBitLocalUpdates`: the same
planner asks DCP for the items of every saved rank (their names are in the checkpoint's
metadata), and every rank redistributes the saved error feedback onto the new world as
`lbcomm.load_sharded` does (the total carried error, mean worker error + server
error, is preserved; `lbcomm.CompressionState.redistribute`). Every rank then reads every
saved rank's item (the optimizer's moments included, so old-world-size x the optimizer
state, briefly). Without the planner a missing item makes ``dcp.load`` raise (DCP reports
the missing key ``<name>.rank<r>-of-<world>``).
"""
from __future__ import annotations

import inspect
import io
import logging
import re
import warnings
from typing import Any, Dict, List

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from ..checkpoint import redistribute_optimizer_state
from ..comm import world_info
from .attach import LBCOMM_OPTIMIZERS, unwrap_optimizer
from ..errors import MissingRankLocalError

__all__ = ["RankLocal", "LoadPlanner", "MissingRankLocalError"]

_log = logging.getLogger(__name__)
_KEY = re.compile(r"rank(\d+)-of-(\d+)")
_HOLDS = "holds:"  # the key (with the class name) that records what a RankLocal saved


class _RankEntries(dict):
    """What `RankLocal.state_dict` returns: ``{"rank<r>-of-<world>": bytes,
    "holds:<class>": <class name>}``; ``own`` is this rank's key, ``planned`` is set by
    `LoadPlanner` (which looks for these)."""

    own: str = ""
    planned: bool = False


class RankLocal:
    """DCP ``Stateful`` view of an object whose state differs between ranks.

    Args:
        obj: anything with ``state_dict()`` and ``load_state_dict(sd)``: a lbcomm optimizer
            (also inside accelerate's wrapper), a hook state, `OneBitLocalUpdates`.
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
        world, rank = world_info(self.group)
        return f"rank{rank}-of-{world}"

    def _holds(self) -> str:
        return _HOLDS + type(unwrap_optimizer(self.obj)).__name__

    def state_dict(self) -> Dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.obj.state_dict(), buf)
        holds = self._holds()
        out = _RankEntries({self._key(): buf.getvalue(), holds: holds[len(_HOLDS):]})
        out.own = self._key()
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not getattr(state_dict, "planned", False):
            warnings.warn(f"RankLocal({type(unwrap_optimizer(self.obj)).__name__}) was loaded without "
                          "lbcomm.integrations.dcp.LoadPlanner, so nothing checked that this load restores every "
                          "rank-local lbcomm state of the checkpoint (a compressor's error feedback left out goes on "
                          "from zero, silently); pass planner=LoadPlanner() to dcp.load", stacklevel=2)
        key = self._key()
        if key in state_dict:
            self.obj.load_state_dict(_decode(state_dict[key]))
            return
        saved = sorted((int(m.group(1)), int(m.group(2)), k) for k in state_dict if (m := _KEY.fullmatch(k)))
        old = {w for _, w, _ in saved}
        if not saved or len(old) != 1 or [r for r, _, _ in saved] != list(range(saved[0][1])):
            raise KeyError(f"RankLocal: the checkpoint has no entry {key!r} (saved entries: {sorted(state_dict)}); "
                           "to resume lbcomm state at another world size pass "
                           "planner=lbcomm.integrations.dcp.LoadPlanner() to dcp.load")
        target = unwrap_optimizer(self.obj)
        optimizer = isinstance(target, LBCOMM_OPTIMIZERS)
        if not (optimizer or _takes_all_ranks(target)):
            raise KeyError(f"RankLocal: the checkpoint was saved by {saved[0][1]} ranks and has no entry {key!r}; "
                           "only lbcomm optimizers and objects whose load_state_dict takes all_ranks= (the hook "
                           "states, OneBitLocalUpdates) can be redistributed onto another world size, not "
                           f"{type(target).__name__}")
        m = _KEY.fullmatch(key)
        rank, world = int(m.group(1)), int(m.group(2))
        states: List[Dict[str, Any]] = [_decode(state_dict[k]) for _, _, k in saved]
        mine = states[rank % len(states)]
        if not optimizer:
            target.load_state_dict(mine, all_ranks=states)
        else:
            redistribute_optimizer_state(mine, states, world, rank, where="the DCP checkpoint")
            self.obj.load_state_dict(mine)


def _takes_all_ranks(obj: Any) -> bool:
    """Whether ``obj.load_state_dict`` redistributes rank-local state itself, given every
    saved rank's state_dict as ``all_ranks=`` (`OneBitHookState`, `DCTHookState`,
    `OneBitHSDPState`, `OneBitLocalUpdates`)."""
    try:
        return "all_ranks" in inspect.signature(obj.load_state_dict).parameters
    except (TypeError, ValueError):
        return False


def _decode(blob: Any) -> Dict[str, Any]:
    if isinstance(blob, io.BytesIO):
        blob = blob.getvalue()
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def _saved_rank_locals(names) -> Dict[str, str]:
    """{item name: class name} of the `RankLocal` items among a checkpoint's metadata keys."""
    saved: Dict[str, str] = {}
    for fqn in names:
        name, _, leaf = fqn.rpartition(".")
        if name and leaf.startswith(_HOLDS):
            saved[name] = leaf[len(_HOLDS):]
        elif name and _KEY.fullmatch(leaf):
            saved.setdefault(name, "")
    return saved


class LoadPlanner(DefaultLoadPlanner):
    """``dcp.load(..., planner=LoadPlanner())``: load `RankLocal` items and check that the
    load restores all of them.

    * Every `RankLocal` item of the checkpoint must be named by the loaded state
      (``state[name] = RankLocal(obj)``), else `MissingRankLocalError` says which and what
      to pass: restoring the model and the optimizer but not a compressor's error feedback
      (a `OneBitHookState`, an HSDP hook state) continues the run from zero error feedback
      and ends with other weights, silently. ``allow_partial_load=True`` (DCP's argument)
      also allows that, and only logs it.
    * For every `RankLocal` whose own item (``rank<r>-of-<world>``) the checkpoint lacks,
      it requests the items of every saved rank instead (another world size), and
      `RankLocal.load_state_dict` redistributes their error feedback onto this world.

    Everything else is DCP's `DefaultLoadPlanner` (its arguments are accepted as they are).
    """

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            names = metadata.state_dict_metadata
            loaded = {name for name, value in state_dict.items() if isinstance(value, _RankEntries)}
            missing = {n: c for n, c in _saved_rank_locals(names).items() if n not in loaded}
            if missing:
                what = ", ".join(f"{n!r} ({c or 'unknown class'})" for n, c in sorted(missing.items()))
                fix = ", ".join(f"state[{n!r}] = RankLocal(<the {c or 'object'}>)" for n, c in sorted(missing.items()))
                msg = (f"LoadPlanner: the checkpoint holds rank-local lbcomm state under {what} that this load does "
                       "not restore: its compression error feedback would restart from zero and the run would end "
                       f"elsewhere than the one that saved it. Load it too: {fix}")
                if not getattr(self, "allow_partial_load", False):
                    raise MissingRankLocalError(msg)
                _log.warning("%s", msg)
            for name, value in state_dict.items():
                if not isinstance(value, _RankEntries):
                    continue
                value.planned = True
                for key in [k for k in value if k.startswith(_HOLDS)]:
                    if f"{name}.{key}" not in names:  # another class than the saved one: RankLocal decides
                        del value[key]
                if f"{name}.{value.own}" not in names:
                    prefix = f"{name}."
                    saved = [k[len(prefix):] for k in names if k.startswith(prefix) and _KEY.fullmatch(k[len(prefix):])]
                    if saved:
                        value.clear()
                        value.update({k: b"" for k in saved})  # placeholders that DCP fills
        super().set_up_planner(state_dict, metadata, is_coordinator)
