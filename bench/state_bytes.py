"""Memory of an optimizer: the bytes of every tensor it holds, and of its checkpoint.

Counted by walking the optimizer's attributes (into lbcomm's own objects: stages,
reducers, buffers), each storage once, the parameters and gradients left out. Reported by
bench/convergence.py per parameter; tests/optim_memory.py holds the optimizers to it.
"""
from __future__ import annotations

import io

import torch

MAX_STATE_DEPTH = 16


def state_bytes(opt, model):
    """Bytes of every tensor the optimizer holds (flat buffers, gradient buffer, masks,
    compression errors and wire buffers), storages counted once, parameters and
    gradients excluded; and the size of its serialized state_dict."""
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    seen, visited, total = set(), set(), 0

    def visit(o, depth=0):
        nonlocal total
        # deep enough for opt -> stage -> reducer -> buffers -> wire rows; each object once
        if depth > MAX_STATE_DEPTH:
            return
        if isinstance(o, torch.Tensor):
            ptr = o.untyped_storage().data_ptr()
            if ptr not in exclude and ptr not in seen:
                seen.add(ptr)
                total += o.untyped_storage().nbytes()
            return
        if id(o) in visited:
            return
        visited.add(id(o))
        if isinstance(o, dict):
            for v in o.values():
                visit(v, depth + 1)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v, depth + 1)
        elif type(o).__module__.startswith("lbcomm"):
            visit(vars(o), depth + 1)

    visit({k: v for k, v in vars(opt).items() if k != "param_groups"})
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return total, buf.tell()
