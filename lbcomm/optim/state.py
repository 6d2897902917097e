"""The state of the lbcomm optimizers: the flat buffers' layout and the checkpoint format.

Functions of the optimizer's `FlatState` (`flatstate`): `build_layout` places every
parameter's state in one slice of flat fp32 buffers (see `flat`), keeping the state of
parameters that were already there; `prepare` rebuilds it when a parameter starts
requiring grad; `attach_views` exposes it per parameter; `extra_state`, `check_loadable`
and `restore` are the checkpoint's ``"lbcomm"`` entry, written and read.

Checkpoints: ``optimizer.state_dict()`` is torch's (per-parameter state: views of the flat
buffers and fp32 scalars; the param groups with the hyperparameters) plus an ``"lbcomm"``
entry with what is not per parameter: the format version, the class that saved it
(``class``), the layout, the step counter, the names of the per-parameter buffers that
differ between ranks (``rank_local``), and for
a 1-bit optimizer its stage's state (``frozen``, the mask, ``compression``: this
rank's compression errors, with the ``world_size`` and ``topology`` they belong to, which
`lbcomm.checkpoint.redistribute_optimizer_state` reads for an elastic resume).
The communication settings (`lbcomm.CommConfig`) are not saved: they belong to the run.

Versioning: ``sd["lbcomm"]["version"]`` is `STATE_VERSION`. Any change that a released
lbcomm could not read, or would read differently, raises it; a release reads exactly the
versions in `READABLE_VERSIONS`. Today that is one version: a loader for an older version
is written only for a format that a release has written.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch import Tensor

from ..common import FLOAT_DTYPES
from .flat import FlatLayout, local_tensor

__all__ = ["STATE_VERSION", "READABLE_VERSIONS", "build_layout", "attach_views", "prepare", "extra_state",
           "check_loadable", "restore", "rank_mean", "state_class", "load_rank_local"]

_log = logging.getLogger("lbcomm.optim.base")  # load_rank_local's warning, where it was logged before

STATE_VERSION = 2
READABLE_VERSIONS = (STATE_VERSION,)


def _select_params(fs, order: Optional[Sequence[int]] = None):
    flat = [(gi, p) for gi, g in enumerate(fs.param_groups) for p in g["params"]]
    if order is not None:
        return [flat[i] for i in order]
    # trainable params, and those that already have state (frozen for a while, not forgotten)
    old = fs.layout.index if fs.layout is not None else {}
    seen, chosen = set(), []
    for gi, p in flat:
        if (p.requires_grad or id(p) in old) and local_tensor(p).numel() > 0 and id(p) not in seen:
            seen.add(id(p))
            chosen.append((gi, p))
    return chosen


def build_layout(fs, order: Optional[Sequence[int]] = None) -> FlatLayout:
    """A new layout of the parameters of the flat state `fs` (a `FlatState`; in `order`,
    torch's state_dict numbering, when given), its flat buffers and per-parameter vectors,
    the old state carried over; ``fs.layout_listeners`` are told (old, new) afterwards."""
    name = fs.name
    chosen = _select_params(fs, order)
    params = [p for _, p in chosen]
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"{name}: all parameters must be on one device (the state is one flat buffer), got "
                         f"{sorted(map(str, devices))}")
    for p in params:
        if p.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: parameters must be float32, float16 or bfloat16, got {p.dtype}")
    L = FlatLayout(params, [gi for gi, _ in chosen])
    if L.sharded and fs.comm.shard_group is None:
        raise ValueError(f"{name}: the parameters are DTensors (a model sharded with FSDP2); create the optimizer "
                         f"with lbcomm.fsdp.onebit_optimizer(model, mesh, {name}, ...), which sets the replicate "
                         "group as comm.process_group and the shard group as comm.shard_group")
    f32 = dict(dtype=torch.float32, device=params[0].device if params else torch.device("cpu"))
    old, old_flat, old_vec = fs.layout, fs.buffers, fs.vectors
    fs.buffers = {n: fs.new_buffer(n, L) for n in fs.buffer_names()}
    fs.vectors = {n: torch.full((len(params),), v, **f32) for n, v in fs.vector_defaults.items()}
    if old is not None:  # keep the state of parameters that were already there
        for i, p in enumerate(params):
            j = old.index.get(id(p))
            if j is None:
                continue
            for n, buf in fs.buffers.items():
                if n in old_flat:
                    L.view(buf, i).copy_(old.view(old_flat[n], j))
            for n, vec in fs.vectors.items():
                vec[i] = old_vec[n][j]
    fs.grad_buf = None
    fs.layout = L
    fs.stale = False
    for listener in fs.layout_listeners:
        listener(old, L)
    return L


def attach_views(fs, state) -> None:
    """``state[p]`` (the optimizer's ``state``): views of the flat buffers and the vectors'
    elements, per parameter."""
    L = fs.layout
    for i, p in enumerate(L.params):
        st = state[p]
        for n, buf in fs.buffers.items():
            st[n] = L.view(buf, i)
        for n, vec in fs.vectors.items():
            st[n] = vec[i]


def prepare(fs, guard: Optional[Callable[[str], None]] = None) -> FlatLayout:
    """The layout of the flat state `fs` for this step: built at the first step, rebuilt
    when a parameter started requiring grad (`guard(what)` may refuse: a frozen 1-bit stage)."""
    fs.transport  # noqa: B018 - a wrong group or backend is an error at the first step
    L = fs.layout
    if L is None:
        return build_layout(fs)
    if not fs.stale:
        fs.stale = any(p.requires_grad and local_tensor(p).numel() > 0 and id(p) not in L.index
                       for g in fs.param_groups for p in g["params"])
    if fs.stale:
        if guard is not None:
            guard("let a parameter start requiring grad")
        return build_layout(fs)
    return L


def state_class(opt) -> str:
    """The lbcomm optimizer class whose state `opt` keeps: the first lbcomm class in its
    MRO, so that a user's subclass saves and loads the state of the class it extends."""
    for cls in type(opt).__mro__:
        if cls.__module__.startswith("lbcomm."):
            return cls.__name__
    return type(opt).__name__


def extra_state(fs, saved_class: str, skipped_steps: int, rank_local) -> Dict[str, Any]:
    """The ``"lbcomm"`` entry every optimizer writes (`fs`: its `FlatState`)."""
    L = fs.layout
    index = fs.param_indices()
    return {"version": STATE_VERSION, "class": saved_class,
            "layout": None if L is None else [index[id(p)] for p in L.params],
            "numels": None if L is None else list(L.numels), "global_step": fs.global_step,
            "skipped_steps": skipped_steps, "rank_local": list(rank_local)}


def rank_mean(tensors) -> Tensor:
    """The saved ranks' mean of a rank-local buffer (an elastic resume starts every rank from it)."""
    return torch.stack([t.float() for t in tensors]).sum(0) / len(tensors)


def load_rank_local(name: str, mine: Dict[str, Tensor], saved: Optional[Dict[str, Tensor]], all_ranks,
                    reset: Callable[[list], None]) -> None:
    """`BaseOptimizer.load_rank_local_buffers`: `mine` (the optimizer's rank-local buffers)
    from `saved`, or the mean of `all_ranks`; `reset(names)` starts those missing."""
    if not mine:
        return
    if all_ranks is not None:
        saved = {n: rank_mean([r[n] for r in all_ranks])
                 for n in mine if all(r is not None and n in r for r in all_ranks)}
    missing = sorted(n for n in mine if saved is None or n not in saved)
    if missing:
        _log.warning("%s: the checkpoint has no rank-local %s; they start from this rank's restored state "
                     "as at the freeze", name, ", ".join(missing))
        reset(missing)
    for n, buf in mine.items():
        if n in missing:
            continue
        if saved[n].numel() != buf.numel():
            raise ValueError(f"{name}.load_rank_local_buffers: {n} holds {saved[n].numel()} "
                             f"elements, this optimizer's {buf.numel()} (another model or layout)")
        buf.copy_(saved[n].reshape(-1))


def check_loadable(name: str, mine: str, has_stage: bool, sd: Dict[str, Any]):
    """torch's load pre hook's part: check the entry of `sd` (loaded into the optimizer class
    `name`, whose state is `mine`'s, with a 1-bit stage or not); returns (the per-parameter
    state kept for `restore`, the entry, the state dict torch loads: without either, since
    torch would cast the state to the parameters' dtype; fp16/bf16 parameters keep fp32 state).

    Every optimizer class keeps other buffers and stages, so a state dict loads only into
    the class that saved it (``"class"`` in the entry); state dicts written before the
    entry recorded it fall back to the checks on its stages and buffers."""
    extra = sd.get("lbcomm")
    if extra is None:
        raise ValueError(f"{name}.load_state_dict: the state dict has no 'lbcomm' entry, so it was not saved by an "
                         "lbcomm optimizer; load it into the optimizer class that saved it")
    if extra.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{name}.load_state_dict: unsupported lbcomm state version {extra.get('version')!r} (this "
                         f"lbcomm reads {', '.join(map(str, READABLE_VERSIONS))})")
    saved_class = extra.get("class")
    if saved_class is not None and saved_class != mine:
        raise ValueError(f"{name}.load_state_dict: the state dict was saved by {saved_class} and is being loaded "
                         f"into {mine}; their states differ (buffers, stages, counters), so it cannot be loaded "
                         f"here: load it into {saved_class}, the class that saved it")
    if has_stage != ("frozen" in extra):
        raise ValueError(f"{name}.load_state_dict: the state dict was saved by an optimizer "
                         f"{'with' if 'frozen' in extra else 'without'} a 1-bit stage; load it into the optimizer "
                         "class that saved it")
    kept = (sd.get("state", {}), extra)
    sd = {k: v for k, v in sd.items() if k != "lbcomm"}
    sd["state"] = {}
    return kept, sd


def restore(fs, state: Dict[Any, Dict[str, Any]], extra: Dict[str, Any]) -> None:
    """Rebuild the layout, the flat buffers and the per-parameter vectors of the flat state
    `fs` from a loaded state dict (the caller attaches the views)."""
    name = fs.name
    fs.global_step = int(extra["global_step"])
    fs.layout = None
    fs.grad_buf = None
    fs.buffers, fs.vectors = {}, {}
    if extra["layout"] is None:
        return
    order = extra["layout"]
    L = build_layout(fs, order=order)
    if list(L.numels) != list(extra["numels"]):
        raise ValueError(f"{name}.load_state_dict: the parameters have other sizes than the saved ones ({L.numels} "
                         f"vs {extra['numels']})")
    missing = [k for k in order if k not in state]
    if missing:
        raise ValueError(f"{name}.load_state_dict: no state for parameters {missing} of the saved layout; the state "
                         "dict is incomplete")
    for n in list(state[order[0]]) if order else []:
        _check_saved_size(fs, n, [state[k].get(n) for k in order], L.total)
        if n in fs.vectors:
            fs.vectors[n].copy_(torch.stack([state[k][n].reshape(()) for k in order]))
        else:
            if n not in fs.buffers:
                fs.buffers[n] = fs.new_buffer(n, L)
            fs.buffers[n].copy_(torch.cat([state[k][n].reshape(-1) for k in order]))


def _check_saved_size(fs, n: str, saved, total: int) -> None:
    """A saved per-parameter state `n` that does not fit this optimizer's (a state dict
    of another class, saved before the ``"lbcomm"`` entry named it)."""
    per_param = n in fs.vectors
    ok = all(isinstance(t, torch.Tensor) for t in saved) and (
        all(t.numel() == 1 for t in saved) if per_param else sum(t.numel() for t in saved) == total)
    if not ok:
        name = fs.name
        raise ValueError(f"{name}.load_state_dict: the saved per-parameter state {n!r} has other sizes than "
                         f"{name} keeps ({'one value per parameter' if per_param else 'one value per element'}), so "
                         "the state dict was saved by another optimizer class; load it into the optimizer class "
                         "that saved it")
