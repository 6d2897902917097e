"""One hierarchical compressed allreduce: its collective schedule, `steps` (the call behind
`lbcomm.reduce.hierarchical.hierarchical_allreduce_` and `HierarchicalState.reduce_`; the
algorithm is described in `lbcomm.reduce.hierarchical`). It works on the state through its
public API only (`in_flight`, `count`, `verified`, `spans`, `span`, `slice_len`).

Per call and rank, with the local group's transport `local` (any `lbcomm.comm.Transport`:
its row collectives move the slices, through shared memory or the group's network alike):

    handshake  local all_gather, once per state    every rank of the node: same call?
    rs         local all_to_all_rows               slice l of every node member's input
                                                   (and its flag: input finite?) to rank l
    mean       fp32, in local rank order, into this rank's all-gather row
    1-bit      the flat call's steps (`lbcomm.reduce.flatcall.FlatCall`) on the slice, cross group
    ag         local all_gather_rows               every decoded slice and its status

The schedule is a generator that yields every future it waits for, like the flat call's,
and runs the flat call's steps inside it: `lbcomm.common.drive` runs it blocking or from
the futures' callbacks (async_op), and every rank issues the same collectives in the same
order either way.
"""
from __future__ import annotations

import logging
from typing import Generator, Optional

import torch
from torch import Tensor
from torch.profiler import record_function

from ..common import NonFiniteError
from .flatcall import FlatCall

__all__ = ["steps", "FLAG_BYTES"]

_log = logging.getLogger("lbcomm.topology")  # the 0.2 logger name, kept for users' logging settings

# Status of a rank's slice after the 1-bit stage, carried in its all-gather row.
_APPLIED, _SKIPPED, _EMPTY = 1, 2, 3
FLAG_BYTES = 4


def steps(name: str, state, tensor: Tensor, cap: Optional[Tensor] = None) -> Generator[torch.futures.Future, None, bool]:
    """The schedule of one call on `state` (a HierarchicalState) reducing `tensor` in
    place: yields each future to wait for, returns True when `tensor` holds the mean
    (False: skipped for non-finite input with nonfinite="skip"). `cap` (flat, checked by
    the caller): the capped decode of the 1-bit stage, each slice with its part."""
    t = state.topology
    if t.flat:  # one node or one rank per node: the flat call over every rank
        applied = yield from FlatCall(name, state.compression, tensor, tensor, False, bool, None, cap).steps()
        state.count(skipped=not applied)
        return applied
    with state.in_flight():
        if not state.verified:
            yield from _handshake(state)
        G, L, n0 = t.local_size, state.slice_len, state.numel
        x = tensor.reshape(-1)
        lo, hi = state.span
        real = hi - lo
        row = 4 * L + FLAG_BYTES
        # Reduce-scatter inside the node: slice j of this rank's input (fp32) and its flag
        # (input not finite) to local rank j; this rank's own slice is read from the input.
        with record_function("lbcomm.hier.stage_in"):
            finite = bool(torch.isfinite(x.sum(dtype=torch.float32))) or bool(torch.isfinite(x).all())
            send = t.local.rows_out(G, row, state.device)
            send_f = send[:, :4 * L].view(torch.float32)
            for j, (a, b) in enumerate(state.spans):
                if j != t.local_rank:
                    send_f[j, :b - a].copy_(x[a:b])
            send[:, 4 * L:].view(torch.int32).fill_(0 if finite else 1)
        fut = t.local.all_to_all_rows(async_op=True)
        yield fut
        received = fut.value()
        rows = [x[lo:hi] if j == t.local_rank else r[:4 * real].view(torch.float32) for j, r in enumerate(received)]
        node_bad = any(bool(r[4 * L:].view(torch.int32)) for r in received)
        mine = t.local.rows_out(1, row, state.device)[0]  # the all-gather row, filled in place
        acc = mine[:4 * L].view(torch.float32)[:real]
        with record_function("lbcomm.hier.mean"):
            if real:  # fp32, local rank order: the recipe of lbcomm.testing.kernels.hierarchical_allreduce
                # (a half-precision row of this rank's own input is widened exactly by the add)
                torch.add(rows[0], rows[1], out=acc)
                for j in range(2, G):
                    acc.add_(rows[j])
                acc.div_(G)
        if real == 0:
            status = _EMPTY
        else:
            if node_bad:
                acc[0] = float("nan")  # every cross group then agrees on "skip", errors untouched
            # the slice's state skips (never raises): every rank must reach the all-gather
            part = None if cap is None else cap[lo:hi]
            applied = yield from FlatCall(name, state.compression, acc, acc, False, bool, None, part).steps()
            status = _APPLIED if applied else _SKIPPED
        mine[4 * L:].view(torch.int32).fill_(status)
        # All-gather inside the node: every slice's result and status.
        fut = t.local.all_gather_rows(async_op=True)
        yield fut
        views = fut.value()
        statuses = [int(v[4 * L:].view(torch.int32)) for v in views]
        skipped = _SKIPPED in statuses
        state.count(skipped)
        if skipped:
            _skip(name, state, mixed=_APPLIED in statuses)
            return False
        with record_function("lbcomm.hier.copy_out"):
            flat = tensor.view(-1) if tensor.is_contiguous() else torch.empty(n0, dtype=tensor.dtype,
                                                                               device=tensor.device)
            for j, (a, b) in enumerate(state.spans):
                flat[a:b].copy_(views[j][:4 * (b - a)].view(torch.float32))
            if not tensor.is_contiguous():
                tensor.copy_(flat.view(tensor.shape))
        return True


def _skip(name: str, state, mixed: bool) -> None:
    """A skipped call: reset the errors when some slices committed new ones and others did
    not (no consistent state left), then raise or log per the state's policy."""
    if mixed:
        state.reset()
        what = ("a slice's intra-node mean or a server sum overflowed float32 although the inputs were finite; "
                "the error feedback was reset to zero on every rank")
    else:
        what = "the input holds NaN or Inf on at least one rank (the error buffers are unchanged)"
    if state.nonfinite == "raise":
        raise NonFiniteError(f"{name}: {what}; check for overflow, or pass nonfinite='skip'")
    _log.debug("%s: skipped: %s", name, what)


def _handshake(state):
    """Once per state: every local rank's layout, compared before the variable-size
    intra-node collectives (different row lengths would abort gloo)."""
    t = state.topology
    mine = torch.tensor([state.numel, state.block_size or 0, state.calls, t.nodes, t.node], dtype=torch.int64)
    everyone = torch.empty(t.local_size * mine.numel(), dtype=torch.int64, device=state.device)
    fut = t.local.all_gather(everyone.view(torch.uint8), mine.to(state.device).view(torch.uint8), async_op=True)
    yield fut
    fut.value()
    rows = everyone.view(t.local_size, -1).cpu()
    same = rows[:, :4] == mine[:4]
    if not bool(same.all()) or not bool((rows[:, 4] == mine[4]).all()):
        desc = ", ".join(f"local rank {r}: numel={int(v[0])} block_size={int(v[1]) or None} calls={int(v[2])} "
                         f"nodes={int(v[3])} node={int(v[4])}" for r, v in enumerate(rows))
        raise ValueError("hierarchical_allreduce_: the ranks of a node called with different tensors, state layouts "
                         f"or topologies ({desc}); every rank must reduce the same sizes in the same order, and the "
                         "local group must hold the ranks of one node")
    state.verified = True
