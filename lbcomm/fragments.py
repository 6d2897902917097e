"""The fragments of `lbcomm.OneBitLocalUpdates` (Streaming DiLoCo): which parameters each
one synchronizes (`fragment_bounds`), the state of one (`Fragment`: anchor, buffer, reducer,
a synchronization in flight), and the checks of the arguments that shape them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["fragment_bounds", "Fragment", "ceil_div", "check_args"]


def fragment_bounds(numels: Sequence[int], fragments: int) -> List[int]:
    """Cut parameters of `numels` elements, in order, into `fragments` non-empty runs of
    about equal size: fragment f is parameters [b[f], b[f + 1]). A run ends at the first
    parameter where the running total reaches (f + 1) / fragments of all elements (or where
    the parameters left are just enough for the runs left)."""
    n, total = len(numels), sum(numels)
    if not 1 <= fragments <= n:
        raise ValueError(f"fragments={fragments}: need 1 <= fragments <= the number of parameters ({n})")
    bounds, run = [0], 0
    for i, k in enumerate(numels[:-1]):
        run += k
        cuts = len(bounds)  # fragments closed so far + 1
        if cuts < fragments and (run * fragments >= cuts * total or n - (i + 1) == fragments - cuts):
            bounds.append(i + 1)
    bounds.append(n)
    return bounds


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Fragment:
    """One synchronized unit: parameters [lo, hi) of the list, its anchor θ_start (fp32,
    flat, the outer optimizer's parameter), its Δ buffer, reducer and exact coordinates."""

    lo: int
    hi: int
    phase: int  # synchronized at inner steps t with t % H == phase
    anchor: Tensor
    delta: Tensor
    reducer: Any = None
    exact: Optional[Tensor] = None
    # a synchronization in flight (overlap >= 1): applied after inner step `due`
    due: Optional[int] = None
    sent: Optional[Tensor] = None  # θ when it started, flat
    future: Any = None
    result: Any = None  # True / False (finite or not), or the NonFiniteError raised


def check_args(name, params, inner, sync_every, outer_lr, outer_momentum, nesterov, compress, fragments) -> None:
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"{name}: inner must be a torch.optim.Optimizer over the same parameters, got "
                        f"{type(inner).__name__}")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"{name}: invalid sync_every {sync_every!r} (an int >= 1: inner steps per synchronization)")
    if not params:
        raise ValueError(f"{name}: got no parameters")
    ids = [id(p) for p in params]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name}: a parameter appears twice in params")
    inner_ids = {id(p) for g in inner.param_groups for p in g["params"]}
    if inner_ids != set(ids):
        raise ValueError(f"{name}: params must be exactly the inner optimizer's parameters ({len(set(ids) - inner_ids)} "
                         f"given here are not in it, {len(inner_ids - set(ids))} of it are missing here)")
    bad = [tuple(p.shape) for p in params if not p.is_floating_point()]
    if bad:
        raise TypeError(f"{name}: parameters must be floating point, got non-float ones of shapes {bad}")
    if len({p.device for p in params}) != 1:
        raise ValueError(f"{name}: all parameters must be on one device")
    if not (isinstance(outer_lr, (int, float)) and math.isfinite(outer_lr) and outer_lr > 0):
        raise ValueError(f"{name}: invalid outer_lr {outer_lr!r} (a number > 0)")
    if not (isinstance(outer_momentum, (int, float)) and 0 <= outer_momentum < 1):
        raise ValueError(f"{name}: invalid outer_momentum {outer_momentum!r} (need 0 <= outer_momentum < 1)")
    if nesterov and outer_momentum == 0:
        raise ValueError(f"{name}: nesterov=True needs outer_momentum > 0 (leave nesterov out for plain averaging)")
    if not isinstance(compress, bool):
        raise TypeError(f"{name}: compress must be a bool (False: plain fp32 allreduce, DiLoCo itself)")
    if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= sync_every:
        raise ValueError(f"{name}: invalid fragments {fragments!r} (an int, 1 <= fragments <= sync_every)")
