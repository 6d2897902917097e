"""One checkpoint shard per rank (see docs/checkpoints.md).

The optimizer state of a 1-bit optimizer differs between ranks (each rank keeps its own
worker and server error buffers), so every rank saves and loads its own file:

    <directory>/shard-00000-of-00002.pt   (rank and world size, five digits each)

`save_sharded` writes this rank's shard (atomically, then a barrier so that every shard
exists when it returns); `load_sharded` reads it back. With the same world size the
resume is bitwise identical to a run that never stopped. With another world size (elastic
resume) every rank reads shard ``rank % saved_world_size`` (the model and the optimizer
moments are identical on all ranks; the optimizer's `rank_local_buffers` start from
their mean) and the compression error feedback of every saved rank, which
`lbcomm.reducer.redistribute` maps onto the new world with its total (the
carried error of the error-feedback invariant: mean worker error + server error)
preserved; ``elastic=False`` resets it instead, with a logged warning. The same holds for
a `OneBitHookState` passed as ``hook_state=``: each of its units (bucket error feedback)
is redistributed by the same function.

A shard that holds a hook state (`OneBitHookState`, `DCTHookState`, `OneBitHSDPState`,
`OneBitLocalUpdates`: whatever was passed as ``hook_state=``) loaded by a call that
resumes training without ``hook_state=`` warns (`lbcomm.ddp.MissingHookStateWarning`):
that state would silently start from zero and the run would not continue as the saved one.

Format version (docs/checkpoints.md): a shard records the one current format version;
`load_sharded` reads that version only and refuses any other with an error naming both.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import warnings
from typing import Any, Dict, List, Optional

import torch

from .comm import get_transport
from .config import from_comm
from .ddp.resume import MissingHookStateWarning
from .optim.state import rank_mean
from .reducer import redistribute

__all__ = ["save_sharded", "load_sharded", "shard_path"]

_log = logging.getLogger(__name__)
_FORMAT = "lbcomm-shard"
_VERSION = 1  # the one format this lbcomm writes and reads (docs/checkpoints.md)
_SHARD_RE = re.compile(r"shard-(\d+)-of-(\d+)\.pt$")


def shard_path(directory: str, rank: int, world_size: int) -> str:
    """Path of one rank's shard in a checkpoint directory."""
    return os.path.join(os.fspath(directory), f"shard-{rank:05d}-of-{world_size:05d}.pt")


def save_sharded(directory: str, optimizer=None, model: Optional[torch.nn.Module] = None, *, extra: Any = None,
                 hook_state=None, group=None, backend: str = "auto", comm=None) -> str:
    """Save this rank's shard: the optimizer's state_dict (with its error buffers), the
    model's state_dict, the `OneBitHookState`'s state_dict and any `extra` payload (e.g.
    step, lr scheduler, RNG states).

    Call it on every rank of `group`; it returns after all ranks have written their shard.

    Args:
        directory (str): checkpoint directory (created if missing).
        optimizer (Optimizer, optional): usually an lbcomm optimizer (default: None).
        model (Module, optional): its state_dict is saved in the shard too (default: None).
        extra (Any, optional): anything torch.save can write; `load_sharded` returns it
            (default: None).
        hook_state (OneBitHookState, optional): the state of `lbcomm.onebit_hook` (its
            bucket error feedback), or of another compressor with per-rank state
            (`DCTHookState`, `OneBitHSDPState`, `OneBitLocalUpdates`);
            `load_sharded(hook_state=)` restores it (default: None).
        group (ProcessGroup, optional): the group whose ranks save together, a
            torch.distributed group or an mpi4py communicator (default: the world).
        backend (str, optional): "auto", "torch" or "mpi", as for the optimizers; see
            `lbcomm.comm.get_transport` (default: "auto").
        comm (CommConfig, optional): `group` and `backend` as a CommConfig (its
            ``process_group`` and ``backend``; then neither beside it) (default: None).

    Returns:
        The path of this rank's shard.

    Example::

        >>> # xdoctest: +SKIP
        >>> lbcomm.save_sharded("ckpt/step-1000", optimizer, model, extra={"step": 1000})
        >>> info = lbcomm.load_sharded("ckpt/step-1000", optimizer, model)
        >>> step = info["extra"]["step"]
    """
    s = from_comm(comm, "save_sharded", process_group=(group, None), backend=(backend, "auto"))
    transport = get_transport(s["process_group"], backend=s["backend"])
    world, rank = transport.world_size, transport.rank
    os.makedirs(directory, exist_ok=True)
    payload = {
        "format": _FORMAT,
        "version": _VERSION,
        "rank": rank,
        "world_size": world,
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "model": None if model is None else model.state_dict(),
        "extra": extra,
        "hook_state": None if hook_state is None else hook_state.state_dict(),
        "hook_state_type": None if hook_state is None else type(hook_state).__name__,
    }
    path = shard_path(directory, rank, world)
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(payload, tmp)
    os.replace(tmp, path)
    transport.barrier()
    return path


def _saved_world_size(directory: str) -> int:
    sizes = set()
    for f in glob.glob(os.path.join(os.fspath(directory), "shard-*-of-*.pt")):
        m = _SHARD_RE.search(os.path.basename(f))
        if m:
            sizes.add(int(m.group(2)))
    if not sizes:
        raise FileNotFoundError(f"load_sharded: no lbcomm checkpoint shards (shard-*-of-*.pt) in {directory!r}")
    if len(sizes) > 1:
        raise ValueError(f"load_sharded: {directory!r} holds shards of several world sizes {sorted(sizes)}; "
                         "keep one checkpoint per directory")
    return sizes.pop()


def load_sharded(directory: str, optimizer=None, model: Optional[torch.nn.Module] = None, *, hook_state=None,
                 map_location: Any = "cpu", group=None, backend: str = "auto",
                 weights_only: bool = True, elastic: bool = True, comm=None) -> Dict[str, Any]:
    """Load this rank's shard into `optimizer`, `model` and `hook_state` (each optional).

    Args:
        directory (str): the checkpoint directory written by `save_sharded`.
        optimizer (Optimizer, optional): receives the saved optimizer state (default: None).
        model (Module, optional): receives the saved model state (default: None).
        hook_state (OneBitHookState, optional): receives the saved state of
            `lbcomm.onebit_hook` or another compressor (saved with
            ``save_sharded(hook_state=)``); load it before the first backward pass of the
            new run. A shard that holds one, loaded with an optimizer (or a model, when
            the shard holds no optimizer state) but without it, warns with a
            `lbcomm.ddp.MissingHookStateWarning` (default: None).
        map_location (optional): passed to torch.load (default: "cpu"; the state is copied
            into the optimizer's own buffers on their device anyway).
        group (ProcessGroup, optional): the group of this run, a torch.distributed group
            or an mpi4py communicator (default: the world).
        backend (str, optional): "auto", "torch" or "mpi" (default: "auto").
        comm (CommConfig, optional): `group` and `backend` as a CommConfig (default: None).
        weights_only (bool, optional): passed to torch.load; set False only for trusted
            files whose `extra` holds arbitrary objects (default: True).
        elastic (bool, optional): with another world size than the saved one, give every
            rank the saved error feedback (of the optimizer and of `hook_state`)
            redistributed onto the new world (every rank reads the compression state of
            every saved shard, memory-mapped; see `lbcomm.reducer.redistribute`);
            False resets it to zero (default: True).

    Returns:
        A dict: ``extra`` (the saved payload), ``exact`` (True when the world size is the
        saved one, so the continuation is bitwise identical), ``saved_world_size`` and
        ``path`` (the shard read).
    """
    s = from_comm(comm, "load_sharded", process_group=(group, None), backend=(backend, "auto"))
    transport = get_transport(s["process_group"], backend=s["backend"])
    world, rank = transport.world_size, transport.rank
    path = shard_path(directory, rank, world)
    saved_world = world
    if not os.path.exists(path):
        saved_world = _saved_world_size(directory)
        if saved_world == world:
            raise FileNotFoundError(f"load_sharded: shard {path!r} of rank {rank} is missing")
        path = shard_path(directory, rank % saved_world, saved_world)
        if not elastic:
            _log.warning("lbcomm.load_sharded: %s was saved by %s ranks and this run has %s; rank %s reads shard %s. "
                         "Model and optimizer moments are restored; the compression error buffers are reset "
                         "(elastic=False).", directory, saved_world, world, rank, rank % saved_world)
    payload = _read(path, map_location, weights_only)
    hook_sd = payload["hook_state"]
    for name, obj, saved in (("model", model, payload["model"]), ("optimizer", optimizer, payload["optimizer"]),
                             ("hook_state", hook_state, hook_sd)):
        if obj is not None and saved is None:
            raise ValueError(f"load_sharded: {path!r} holds no {name} state (it was saved without one)")
    if hook_state is None and hook_sd is not None and (
            optimizer is not None or (model is not None and payload["optimizer"] is None)):
        _warn_hook_state_left_out(path, payload.get("hook_state_type"))
    others = None
    if saved_world != world and elastic and (optimizer is not None or hook_state is not None):
        others = [_read(shard_path(directory, r, saved_world), map_location, weights_only, mmap=True)
                  for r in range(saved_world)]
    if model is not None:
        model.load_state_dict(payload["model"])
    if optimizer is not None:
        if others is not None:
            redistribute_optimizer_state(payload["optimizer"], [o.get("optimizer") for o in others], world, rank,
                                         where=repr(directory))
        optimizer.load_state_dict(payload["optimizer"])
    if hook_state is not None:
        all_ranks = None
        if others is not None:
            all_ranks = [o["hook_state"] for o in others]
            if any(sd is None for sd in all_ranks):
                raise ValueError(f"load_sharded: some shards of {directory!r} hold no hook state, unlike shard "
                                 f"{rank % saved_world}; the checkpoint is inconsistent (pass elastic=False to reset "
                                 "the error feedback)")
        hook_state.load_state_dict(hook_sd, all_ranks=all_ranks)
    return {"extra": payload["extra"], "exact": saved_world == world, "saved_world_size": saved_world, "path": path}


def _warn_hook_state_left_out(path: str, saved_type: Optional[str]) -> None:
    """A resume that restores the optimizer (or the model) but leaves the shard's hook
    state out: that state would start from zero and the run would diverge, silently."""
    held = (f"the state of a {saved_type}" if saved_type else
            "a hook state (the state of a OneBitHookState, DCTHookState, OneBitHSDPState or OneBitLocalUpdates)")
    msg = (f"lbcomm.load_sharded: {path!r} holds {held}, saved with save_sharded(..., hook_state=), but this call "
           "does not restore it: its error feedback and counters start from zero, so the run does not continue as "
           f"the checkpointed one would. Pass hook_state=<this run's {saved_type or 'hook state'}> to load_sharded, "
           "before the first backward pass")
    warnings.warn(msg, MissingHookStateWarning, stacklevel=3)


def _read(path: str, map_location: Any, weights_only: bool, mmap: bool = False) -> Dict[str, Any]:
    payload = torch.load(path, map_location=map_location, weights_only=weights_only, mmap=mmap)
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ValueError(f"load_sharded: {path!r} is not an lbcomm checkpoint shard")
    if payload.get("version") != _VERSION:
        raise ValueError(f"load_sharded: {path!r} has shard version {payload.get('version')!r}; this lbcomm reads "
                         f"{_VERSION}")
    return payload


def redistribute_optimizer_state(opt_state: Dict[str, Any], saved: List[Dict[str, Any]], world: int, rank: int,
                                 where: str = "the checkpoint") -> None:
    """Elastic resume of a lbcomm 1-bit optimizer: replace the compression state in
    `opt_state` (the `state_dict` of one saved rank, to be loaded by `rank` of a world of
    `world` ranks) by the error feedback of every saved rank (`saved`: their optimizer
    state_dicts, in rank order) redistributed onto this world (`lbcomm.reducer.redistribute`;
    None, i.e. from zero, where it cannot be). Used by `load_sharded` and
    `lbcomm.integrations.dcp.RankLocal`; a no-op for a state without compression state
    (warmup, or not a 1-bit optimizer)."""
    extra = opt_state.get("lbcomm") if isinstance(opt_state, dict) else None
    if not isinstance(extra, dict) or extra.get("compression") is None:
        return  # not a 1-bit optimizer in its compression stage: nothing rank-local to map
    comps = [((other or {}).get("lbcomm") or {}).get("compression") for other in saved]
    extra["compression"] = redistribute(comps, world, rank, where=where)
    extra["world_size"] = world
    # the per-parameter buffers that differ between ranks (OneBitLamb's momentum of each rank's
    # own gradients): every new rank starts from the saved ranks' mean
    states = [(other or {}).get("state") or {} for other in saved]
    for pid, st in (opt_state.get("state") or {}).items():
        for name in extra.get("rank_local", ()):
            mine = [s.get(pid, {}).get(name) for s in states]
            if name in st and all(isinstance(t, torch.Tensor) and t.shape == st[name].shape for t in mine):
                st[name] = rank_mean(mine)
