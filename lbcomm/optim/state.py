"""The state of the lbcomm optimizers: the flat buffers' layout and the checkpoint format.

`build_layout` places every parameter's state in one slice of flat fp32 buffers (see
`flat`), keeping the state of parameters that were already there; `prepare` rebuilds it
when a parameter starts requiring grad; `attach_views` exposes it per parameter.

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

from typing import Any, Dict, Optional, Sequence

import torch
from torch import Tensor

from ..common import FLOAT_DTYPES
from .flat import FlatLayout, local_tensor

__all__ = ["STATE_VERSION", "READABLE_VERSIONS", "build_layout", "attach_views", "prepare", "param_indices",
           "save_hook", "load_pre_hook", "load_post_hook", "restore", "rank_mean", "state_class"]

STATE_VERSION = 2
READABLE_VERSIONS = (STATE_VERSION,)


def _select_params(opt, order: Optional[Sequence[int]] = None):
    flat = [(gi, p) for gi, g in enumerate(opt.param_groups) for p in g["params"]]
    if order is not None:
        return [flat[i] for i in order]
    # trainable params, and those that already have state (frozen for a while, not forgotten)
    old = opt._layout.index if opt._layout is not None else {}
    seen, chosen = set(), []
    for gi, p in flat:
        if (p.requires_grad or id(p) in old) and local_tensor(p).numel() > 0 and id(p) not in seen:
            seen.add(id(p))
            chosen.append((gi, p))
    return chosen


def build_layout(opt, order: Optional[Sequence[int]] = None) -> FlatLayout:
    """A new layout of `opt`'s parameters (in `order`, torch's state_dict numbering, when
    given), its flat buffers and per-parameter vectors, the old state carried over."""
    name = type(opt).__name__
    chosen = _select_params(opt, order)
    params = [p for _, p in chosen]
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"{name}: all parameters must be on one device (the state is one flat buffer), got "
                         f"{sorted(map(str, devices))}")
    for p in params:
        if p.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: parameters must be float32, float16 or bfloat16, got {p.dtype}")
    L = FlatLayout(params, [gi for gi, _ in chosen])
    if L.sharded and opt.shard_group is None:
        raise ValueError(f"{name}: the parameters are DTensors (a model sharded with FSDP2); create the optimizer "
                         f"with lbcomm.fsdp.onebit_optimizer(model, mesh, {name}, ...), which sets the replicate "
                         "group as comm.process_group and the shard group as comm.shard_group")
    f32 = dict(dtype=torch.float32, device=params[0].device if params else torch.device("cpu"))
    old, old_flat, old_vec = opt._layout, opt._flat, opt._vectors
    opt._flat = {n: torch.zeros(L.total, **f32) for n in opt._buffer_names()}
    opt._vectors = {n: torch.full((len(params),), v, **f32) for n, v in opt._param_vectors.items()}
    if old is not None:  # keep the state of parameters that were already there
        for i, p in enumerate(params):
            j = old.index.get(id(p))
            if j is None:
                continue
            for n, buf in opt._flat.items():
                if n in old_flat:
                    L.view(buf, i).copy_(old.view(old_flat[n], j))
            for n, vec in opt._vectors.items():
                vec[i] = old_vec[n][j]
    opt._on_layout(old, L)
    opt._grad_buf = None
    opt._layout = L
    opt._layout_stale = False
    opt._attach_views()
    return L


def attach_views(opt) -> None:
    """``opt.state[p]``: views of the flat buffers and the vectors' elements, per parameter."""
    L = opt._layout
    for i, p in enumerate(L.params):
        st = opt.state[p]
        for n, buf in opt._flat.items():
            st[n] = L.view(buf, i)
        for n, vec in opt._vectors.items():
            st[n] = vec[i]


def prepare(opt) -> FlatLayout:
    """`opt`'s layout for this step: built at the first step, rebuilt when a parameter
    started requiring grad (refused by a frozen 1-bit stage)."""
    opt.transport  # noqa: B018 - a wrong group or backend is an error at the first step
    L = opt._layout
    if L is None:
        return build_layout(opt)
    if not opt._layout_stale:
        opt._layout_stale = any(p.requires_grad and local_tensor(p).numel() > 0 and id(p) not in L.index
                                for g in opt.param_groups for p in g["params"])
    if opt._layout_stale:
        if opt._onebit is not None:
            opt._onebit.check_layout_change("let a parameter start requiring grad")
        return build_layout(opt)
    return L


def param_indices(opt) -> Dict[int, int]:
    """id(param) -> its index in torch's state_dict numbering."""
    mapping: Dict[int, int] = {}
    start = 0
    for g in opt.param_groups:
        for i, p in enumerate(g["params"], start):
            mapping.setdefault(id(p), i)
        start += len(g["params"])
    return mapping


def save_hook(opt, sd: Dict[str, Any]) -> Dict[str, Any]:
    """torch's state-dict post hook: the ``"lbcomm"`` entry."""
    sd["lbcomm"] = opt._extra_state()
    return sd


def state_class(opt) -> str:
    """The lbcomm optimizer class whose state `opt` keeps: the first lbcomm class in its
    MRO, so that a user's subclass saves and loads the state of the class it extends."""
    for cls in type(opt).__mro__:
        if cls.__module__.startswith("lbcomm."):
            return cls.__name__
    return type(opt).__name__


def base_extra_state(opt) -> Dict[str, Any]:
    """The ``"lbcomm"`` entry every optimizer writes."""
    L = opt._layout
    index = param_indices(opt)
    return {"version": STATE_VERSION, "class": state_class(opt),
            "layout": None if L is None else [index[id(p)] for p in L.params],
            "numels": None if L is None else list(L.numels), "global_step": opt._global_step,
            "skipped_steps": opt.skipped_steps, "rank_local": list(opt.rank_local_buffers())}


def rank_mean(tensors) -> Tensor:
    """The saved ranks' mean of a rank-local buffer (an elastic resume starts every rank from it)."""
    return torch.stack(list(tensors)).sum(0) / len(tensors)


def load_pre_hook(opt, sd: Dict[str, Any]) -> Dict[str, Any]:
    """torch's load pre hook: check the entry, keep the per-parameter state for `restore`
    (torch would cast it to the parameters' dtype; fp16/bf16 parameters keep fp32 state).

    Every optimizer class keeps other buffers and stages, so a state dict loads only into
    the class that saved it (``"class"`` in the entry); state dicts written before the
    entry recorded it fall back to the checks on its stages and buffers."""
    extra = sd.get("lbcomm")
    name = type(opt).__name__
    if extra is None:
        raise ValueError(f"{name}.load_state_dict: the state dict has no 'lbcomm' entry, so it was not saved by an "
                         "lbcomm optimizer; load it into the optimizer class that saved it")
    if extra.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{name}.load_state_dict: unsupported lbcomm state version {extra.get('version')!r} (this "
                         f"lbcomm reads {', '.join(map(str, READABLE_VERSIONS))})")
    saved_class, mine = extra.get("class"), state_class(opt)
    if saved_class is not None and saved_class != mine:
        raise ValueError(f"{name}.load_state_dict: the state dict was saved by {saved_class} and is being loaded "
                         f"into {mine}; their states differ (buffers, stages, counters), so it cannot be loaded "
                         f"here: load it into {saved_class}, the class that saved it")
    if (opt._onebit is not None) != ("frozen" in extra):
        raise ValueError(f"{name}.load_state_dict: the state dict was saved by an optimizer "
                         f"{'with' if 'frozen' in extra else 'without'} a 1-bit stage; load it into the optimizer "
                         "class that saved it")
    opt._loading = (sd.get("state", {}), extra)
    sd = {k: v for k, v in sd.items() if k != "lbcomm"}
    sd["state"] = {}
    return sd


def load_post_hook(opt) -> None:
    """torch's load post hook: rebuild the flat state bit for bit (`_load_extra_state`)."""
    state, extra = opt._loading
    opt._loading = None
    opt._load_extra_state(state, extra)


def restore(opt, state: Dict[Any, Dict[str, Any]], extra: Dict[str, Any]) -> None:
    """Rebuild the layout, the flat buffers and the per-parameter vectors from a loaded state dict."""
    name = type(opt).__name__
    opt._global_step = int(extra["global_step"])
    opt.skipped_steps = int(extra["skipped_steps"])
    opt._layout = None
    opt._grad_buf = None
    opt._flat, opt._vectors = {}, {}
    if extra["layout"] is None:
        return
    order = extra["layout"]
    L = build_layout(opt, order=order)
    if list(L.numels) != list(extra["numels"]):
        raise ValueError(f"{name}.load_state_dict: the parameters have other sizes than the saved ones ({L.numels} "
                         f"vs {extra['numels']})")
    missing = [k for k in order if k not in state]
    if missing:
        raise ValueError(f"{name}.load_state_dict: no state for parameters {missing} of the saved layout; the state "
                         "dict is incomplete")
    for n in list(state[order[0]]) if order else []:
        _check_saved_size(opt, n, [state[k].get(n) for k in order], L.total)
        if n in opt._vectors:
            opt._vectors[n].copy_(torch.stack([state[k][n].reshape(()) for k in order]))
        else:
            if n not in opt._flat:
                opt._flat[n] = torch.zeros(L.total, dtype=torch.float32, device=opt._device(L))
            opt._flat[n].copy_(torch.cat([state[k][n].reshape(-1) for k in order]))
    opt._attach_views()


def _check_saved_size(opt, n: str, saved, total: int) -> None:
    """A saved per-parameter state `n` that does not fit this optimizer's (a state dict
    of another class, saved before the ``"lbcomm"`` entry named it)."""
    per_param = n in opt._vectors
    ok = all(isinstance(t, torch.Tensor) for t in saved) and (
        all(t.numel() == 1 for t in saved) if per_param else sum(t.numel() for t in saved) == total)
    if not ok:
        name = type(opt).__name__
        raise ValueError(f"{name}.load_state_dict: the saved per-parameter state {n!r} has other sizes than "
                         f"{name} keeps ({'one value per parameter' if per_param else 'one value per element'}), so "
                         "the state dict was saved by another optimizer class; load it into the optimizer class "
                         "that saved it")
