"""Shared by the optimizer tests (test_optim_*.py and others): `make_opt` (one flat dict of
options to an optimizer), the small models and their deterministic data, state snapshots,
and a training loop in one process. Not a test module: importing it collects nothing."""

import torch
import torch.nn.functional as F
from torch import nn

import lbcomm
from lbcomm.config import split_settings

OPTS = {"adam": lbcomm.OneBitAdam, "lamb": lbcomm.OneBitLamb}


def make_opt(cls, params, **kw):
    """An optimizer from one flat dict of options, the form the simulations in
    lbcomm.testing.optim take: the CommConfig fields go into ``comm``, the OneBitOptions
    fields into ``options`` (1-bit optimizers), the options a param group sets into the
    one group."""
    comm, options, kw = split_settings(kw)
    group = {k: kw.pop(k) for k in list(kw) if k in cls.GROUP_OPTIONS}
    if group:
        params = [{"params": list(params), **group}]
    if options:
        kw["options"] = lbcomm.OneBitOptions(**options)
    return cls(params, comm=lbcomm.CommConfig(**comm), **kw)


def _mlp(seed=0, d_in=12, d_h=24, d_out=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, d_h), nn.LayerNorm(d_h), nn.Tanh(), nn.Linear(d_h, d_h), nn.Tanh(),
                         nn.Linear(d_h, d_out))


def _batch(rank, step, n=32, d_in=12, d_out=5):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, d_in, generator=g)
    y = (x[:, :d_out] + 0.3 * torch.randn(n, d_out, generator=g)).argmax(1)
    return x, y


def _loss(model, rank, step):
    x, y = _batch(rank, step)
    return F.cross_entropy(model(x), y)


def _quantize(g):
    """Gradients on a 2^-16 grid: their sum over ranks is exact in any order, so the
    warmup mean does not depend on gloo's summation order."""
    return (g * 65536).round_() / 65536


class _SparseNet(nn.Module):
    """Coordinates that never see a gradient: embedding rows >= 25 are never looked up,
    and input features 0 and 1 are always zero. And one that sees only rounding noise:
    `shift` is added to every logit, to which softmax is invariant (like an attention key
    bias); its gradient is ~1e-8, its variance ~1e-14 of the others."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(40, 6)
        self.lin = nn.Linear(6 + 4, 3)
        self.shift = nn.Parameter(torch.zeros(1))

    def forward(self, ids, feats):
        return self.lin(torch.cat([self.emb(ids), feats], dim=1)) + self.shift


def _sparse_batch(rank, step, n=32):
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    ids = torch.randint(0, 25, (n,), generator=g)
    feats = torch.randn(n, 4, generator=g)
    feats[:, :2] = 0.0
    return ids, feats, torch.randint(0, 3, (n,), generator=g)


def _flat_state(sd):
    """The per-parameter state of an optimizer state dict, in the saved layout's order:
    tensors concatenated per name ("buffers"), fp32 scalars stacked per name ("vectors")."""
    state, layout = sd["state"], sd["lbcomm"]["layout"] or []
    names = list(state[layout[0]]) if layout else []
    cat = {n: [state[k][n] for k in layout] for n in names}
    return {"buffers": {n: torch.cat([t.reshape(-1) for t in ts]) for n, ts in cat.items() if ts[0].dim() > 0},
            "vectors": {n: torch.stack(ts) for n, ts in cat.items() if ts[0].dim() == 0}}


def _snapshot(model, opt):
    sd = opt.state_dict()
    comp = sd["lbcomm"]["compression"]
    return {
        "params": [q.detach().clone() for q in model.parameters()],
        **_flat_state(sd),
        "errors": None if comp is None else (comp["worker_error"].clone(), comp["server_error"].clone()),
        "global_step": sd["lbcomm"]["global_step"],
    }


def _train(model, opt, steps, start=0, closure=False, scheduler=None):
    losses = []
    for t in range(start, start + steps):
        def closure_fn(t=t):
            opt.zero_grad()
            loss = _loss(model, 0, t)
            loss.backward()
            return loss

        if closure:
            losses.append(opt.step(closure_fn).item())
        else:
            losses.append(closure_fn().item())
            opt.step()
        if scheduler is not None:
            scheduler.step()
    return losses


def _max_diff(m1, m2):
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(m1.parameters(), m2.parameters()))
