"""The contract of `lbcomm.optim.FlatState`: the optimizer's flat state as an object of its
own, which the pieces (the warmup update, the mask, the checkpoint code) take instead of
the optimizer (one process, one rank)."""
import copy

import pytest
import torch

import lbcomm
from lbcomm.comm import get_transport
from lbcomm.config import CommConfig
from lbcomm.optim import FlatState, state
from lbcomm.optim.adam import adamw_warmup_
from lbcomm.optim.mask import MomentumMask


def _params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5)),
            torch.nn.Parameter(torch.randn(2, 2))]


def _flat_state(groups, buffers=("exp_avg", "exp_avg_sq"), vectors=None, comm=None):
    """A FlatState without any optimizer: the groups, a one-rank transport, its own options."""
    comm = comm or CommConfig()
    tr = get_transport(None, backend=comm.backend)
    defaults = dict(groups[0], params=None)
    return FlatState("Standalone", comm, lambda: groups, defaults, lambda: tr,
                     vectors if vectors is not None else {"step": 0.0}, lambda: buffers)


def _group(params, **kw):
    return dict(params=params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, bias_correction=True, **kw)


def test_warmup_update_from_a_flat_state_alone_is_adamw():
    """The warmup update takes a FlatState and nothing else: three AdamW steps on it are
    bitwise torch.optim.AdamW's (the gradients copied into its gradient buffer)."""
    ours, ref = _params(), _params()
    fs = _flat_state([_group(ours)])
    L = state.build_layout(fs)
    assert L.total == 12 + 5 + 4 and set(fs.buffers) == {"exp_avg", "exp_avg_sq"}
    assert fs.vectors["step"].tolist() == [0.0, 0.0, 0.0] and fs.device == torch.device("cpu")
    adamw = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        fs.grad_buf = torch.cat([g.reshape(-1) for g in grads])
        with torch.no_grad():  # as in an optimizer step
            adamw_warmup_(fs, L, [True] * 3, [None] * 3)
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        adamw.step()
        for a, b in zip(ours, ref):
            assert torch.equal(a.detach(), b.detach())
    assert fs.vectors["step"].tolist() == [3.0, 3.0, 3.0]


def test_segments_advance_only_the_included_parameters():
    p = _params()
    fs = _flat_state([_group(p[:2]), _group(p[2:])])
    L = state.build_layout(fs)
    segs = fs.segments(L, [True, False, True])
    assert fs.vectors["step"].tolist() == [1.0, 0.0, 1.0]
    assert [(s.group, s.idx, s.lo, s.hi) for s in segs] == [(0, [0], 0, 12), (1, [2], 17, 21)]
    segs = fs.segments(L, [True, True, True])  # steps 2, 1, 2: three runs, the groups apart
    assert [(s.idx, s.step) for s in segs] == [([0], 2.0), ([1], 1.0), ([2], 2.0)]
    assert fs.bias_corrections(fs.param_groups[0], segs[1]) == (1 - 0.9, 1 - 0.999)


def test_mask_from_a_flat_state_alone():
    """The momentum mask takes the flat state: coordinates of zero (or below the threshold)
    variance are held at zero, a user mask overrides its parameter's."""
    p = _params()
    fs = _flat_state([_group(p)])
    L = state.build_layout(fs)
    v = fs.buffers["exp_avg_sq"]
    v.fill_(1.0)
    v[[0, 5, 13]] = 0.0
    mask = MomentumMask(fs, 0.0)
    mask.build(L)
    assert mask.count == 3 and mask.counts == (3, 3)
    values = torch.ones(L.total)
    mask.apply(values, 0, L.total)
    assert values.eq(0).nonzero().view(-1).tolist() == [0, 5, 13]
    user = torch.ones(5, dtype=torch.bool)
    user[4] = False  # train element 13 - 12 = 1 of the second parameter again, hold element 4
    user[1] = True
    mask.set_user(L, p[1], user, rebuild=True)
    values = torch.ones(L.total)
    mask.apply(values, 0, L.total)
    assert values.eq(0).nonzero().view(-1).tolist() == [0, 5, 16]


def test_layout_rebuild_keeps_state_and_tells_the_listeners():
    p = _params()
    p[1].requires_grad_(False)
    fs = _flat_state([_group(p)])
    seen = []
    fs.layout_listeners.append(lambda old, new: seen.append((old, new)))
    L = state.prepare(fs)
    assert [q is r for q, r in zip(L.params, [p[0], p[2]])] == [True, True] and seen == [(None, L)]
    fs.buffers["exp_avg"].copy_(torch.arange(float(L.total)))
    fs.vectors["step"].fill_(7.0)
    assert state.prepare(fs) is L and len(seen) == 1  # nothing changed: no rebuild
    p[1].requires_grad_(True)
    refused = []
    new = state.prepare(fs, guard=refused.append)
    assert refused == ["let a parameter start requiring grad"] and seen[-1] == (L, new) and not fs.stale
    assert torch.equal(new.view(fs.buffers["exp_avg"], 0).reshape(-1), torch.arange(12.0))
    assert torch.equal(new.view(fs.buffers["exp_avg"], 2).reshape(-1), torch.arange(12.0, 16.0))
    assert new.view(fs.buffers["exp_avg"], 1).abs().sum() == 0
    assert fs.vectors["step"].tolist() == [7.0, 0.0, 7.0]


@pytest.mark.parametrize("cls,kw", [(lbcomm.OneBitAdam, dict(freeze_step=2)),
                                    (lbcomm.OneBitLamb, dict(freeze_step=2)),
                                    (lbcomm.ZeroOneAdam, dict(var_freeze_step=3, local_step_scaler=1)),
                                    (lbcomm.Lamb, {})])
def test_optimizer_owns_one_flat_state(cls, kw):
    """The optimizer's flat state is ``flat_state``; the old private names read it, and
    ``optimizer.state[p]`` holds views of its buffers."""
    model = torch.nn.Linear(3, 2)
    opt = cls(model.parameters(), lr=1e-2, **kw)
    fs = opt.flat_state
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(4, 3)).square().sum().backward()
        opt.step()
    assert opt._flat is fs.buffers and opt._vectors is fs.vectors and opt._layout is fs.layout
    assert fs.global_step == opt.global_step == 5 and fs.name == cls.__name__
    w = model.weight
    st = opt.state[w]
    for name, buf in fs.buffers.items():
        assert st[name].data_ptr() == fs.layout.view(buf, fs.layout.index[id(w)]).data_ptr()
    if cls is not lbcomm.Lamb:
        assert opt._onebit.fs is fs and opt.frozen


@pytest.mark.parametrize("cls,kw", [(lbcomm.OneBitAdam, dict(freeze_step=2)),
                                    (lbcomm.OneBitLamb, dict(freeze_step=2)),
                                    (lbcomm.ZeroOneAdam, dict(var_freeze_step=3, local_step_scaler=1))])
def test_state_dict_round_trip_is_exact(cls, kw):
    """Saved, loaded into a fresh optimizer and saved again, the state dict is the same,
    and the two optimizers then train bitwise alike."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = cls(model.parameters(), lr=1e-2, **kw)
    xs = [torch.randn(4, 3) for _ in range(8)]

    def step(m, o, x):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()

    for x in xs[:4]:
        step(model, opt, x)
    sd = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    opt2 = cls(twin.parameters(), lr=1e-2, **kw)
    opt2.load_state_dict(copy.deepcopy(sd))
    again = opt2.state_dict()
    assert set(again) == set(sd) and again["lbcomm"].keys() == sd["lbcomm"].keys()
    assert again["param_groups"] == sd["param_groups"]
    for k, st in sd["state"].items():
        assert st.keys() == again["state"][k].keys()
        for name, t in st.items():
            assert torch.equal(t, again["state"][k][name]), name
    for x in xs[4:]:
        step(model, opt, x)
        step(twin, opt2, x)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
