"""max_update for the 1-bit optimizers: the bound U on each coordinate's
|m^ / (sqrt(v^) + eps)| in the compression stage (per parameter: ``max_update`` at its
group's betas, or "warmup"'s recorded U_p), and its move into the compressed allreduce
(``capped_decode``: `decode_caps`; both `lbcomm.OneBitOptions`). Functions of the optimizer's `FlatState`, called by
its `OneBitStage`."""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import functional as F
from . import kernels as K
from ..reduce.inputs import TableCaps
from .flat import FlatLayout

__all__ = ["record_update_bounds", "update_bounds", "decode_caps", "left_caps"]


def record_update_bounds(fs, L: FlatLayout, stage: Tensor) -> None:
    """At the freeze, for max_update="warmup": U_p = max_i |m^_i / (sqrt(v^_i) + eps)| of
    each parameter after its last warmup step (its largest full-precision step, in units
    of lr), kept in fp32 per parameter (``fs.vectors["max_update_bound"]``) so that a resumed
    run uses the same bound; 0 for parameters that never had a gradient (they are not
    updated). `stage`: a bounded scratch buffer."""
    m, v = fs.buffers["exp_avg"], fs.buffers["exp_avg_sq"]
    bound, steps = fs.vectors["max_update_bound"], fs.vectors["step"].tolist()
    for i, gi in enumerate(L.group_of):
        group = fs.param_groups[gi]
        if steps[i] == 0:
            bound[i] = 0.0
            continue
        b1, b2 = group["betas"]
        bc1, bc2 = (1 - b1 ** steps[i], 1 - b2 ** steps[i]) if group["bias_correction"] else (1.0, 1.0)
        bound[i:i + 1] = F.max_abs_update(L.view(m, i), L.view(v, i), bc1, bc2, group["eps"], stage)
    if fs.sharded():  # the bound of the whole parameter tensor: the max over its shards
        bound.copy_(fs.per_tensor(L, bound.reshape(-1, 1), op="max").reshape(-1))


def update_bounds(fs, L: FlatLayout, max_update) -> List[Optional[float]]:
    """Per parameter, this step's bound U on |m^ / (sqrt(v^) + eps)| (the option
    `max_update` at its group's betas; None: unbounded, the published update)."""
    per_group = [F.resolve_max_update(max_update, g["betas"]) for g in fs.param_groups]
    recorded, out = None, []
    for i, gi in enumerate(L.group_of):
        u = per_group[gi]
        if u == "warmup":
            if recorded is None:
                recorded = fs.vectors["max_update_bound"].tolist()
            u = recorded[i] if recorded[i] >= 0 else None
        out.append(u)
    return out


def decode_caps(fs, L: FlatLayout, segs, factors, bounds: List[Optional[float]],
                scale: Optional[Tensor] = None, on_result: bool = True) -> Union[TableCaps, Callable[[int, int, Tensor], None]]:
    """max_update's bound moved into the compressed allreduce (capped_decode): per
    coordinate, the momentum whose Adam step is exactly the bound,
    c = U bc1 (sqrt(v^) + eps) with this step's bias corrections (`segs`, steps advanced)
    and rescale factors, times the parameter's `scale` when the reduced momentum is
    scaled (OneBitLamb), +inf where no bound applies; the reducer decodes every value
    to at most c and its error feedback keeps the rest (`lbcomm.compressed.reduce_`).
    On the CPU returned as `TableCaps` (per parameter (a, b, s)), which the compressing
    kernels compute from the variance inside their passes; elsewhere as a callable
    cap(lo, hi, buf) that computes the caps of flat elements [lo, hi) when the reducer
    asks for them (range by range into its bounded staging, one `kernels.decode_caps_`
    per parameter in the range). Either way no model-sized buffer holds them, and each
    element goes through the same operations as in `lbcomm.testing.compressors.decode_caps`.
    `on_result` False (`TableCaps` only): the reducer leaves the result's caps to the
    caller's update (`TableCaps.on_result`)."""
    v = fs.buffers["exp_avg_sq"]
    # per parameter: (a, b) with c = a sqrt(v) + b (U bc1 (sqrt(v) / sqrt(bc2') + eps)), None: uncapped
    coeffs: List[Optional[tuple]] = [None] * len(L.params)
    for seg in segs:
        group = fs.param_groups[seg.group]
        bc1, bc2 = fs.bias_corrections(group, seg)
        for i in seg.idx:
            if bounds[i] is not None:
                coeffs[i] = F.cap_coefficients(bounds[i], bc1, F.rescaled_bc2(bc2, factors, i), group["eps"])

    if K.caps_table_op(v):  # one op call per range, whatever the number of parameters in it
        inf = float("inf")
        table = torch.tensor([(0.0, inf, 1.0) if c is None else (c[0], c[1], 1.0) for c in coeffs],
                             dtype=torch.float32)
        if scale is not None:
            table[:, 2] = scale.float()
        end = L.offsets[-1] + L.numels[-1]
        starts = torch.tensor(L.offsets + [end], dtype=torch.int64)
        # the CPU kernels compute these caps inside their passes; `fill` where they cannot
        return TableCaps(v, starts, table, lambda lo, hi, buf: K.decode_caps_table_(buf[:hi - lo], v, lo, starts, table),
                         end, on_result=on_result)

    def cap(lo: int, hi: int, buf: Tensor) -> None:
        for i, a, b in L.overlapping(lo, hi):
            o = L.offsets[i]
            out = buf[o + a - lo:o + b - lo]
            if coeffs[i] is None:  # no bound here: nothing capped
                out.fill_(float("inf"))
                continue
            K.decode_caps_(out, v[o + a:o + b], coeffs[i][0], coeffs[i][1], None if scale is None else scale[i])

    return cap


def left_caps(caps, exact_part) -> Optional[List[Optional[Tuple[float, float]]]]:
    """The caps a decode under `caps` left to the update (`TableCaps.on_result` False): per
    parameter (a, b), None where the decoded value needs none (an uncapped parameter, b =
    inf, or one averaged exactly, `exact_part` = `ExactPart.part`: its exact mean replaced
    the value); None when the decode left nothing."""
    if not isinstance(caps, TableCaps) or caps.on_result:
        return None
    skip = set() if exact_part is None else {i for i, _ in exact_part[1]}
    return [None if i in skip or math.isinf(b) else (a, b) for i, (a, b, _) in enumerate(caps.table.tolist())]
