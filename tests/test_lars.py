"""lbcomm.Lars: the plain formula (reference.simulate_lars, and the textbook expression),
exclusion of 1-D tensors, param groups, schedulers, checkpoints, non-finite steps, and on 2
gloo ranks under DDP + onebit_hook (replicas identical, no second allreduce)."""
import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lbcomm
from lbcomm.compressed import NonFiniteError
from lbcomm.testing import optim as SIM
from dist_util import run_ranks
from optim_util import _loss, _mlp


def _run(model, opt, steps, start=0, rank=0, scheduler=None):
    grads = []
    for t in range(start, start + steps):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        grads.append([[q.grad.clone() for q in model.parameters()]])
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return grads


def test_first_steps_follow_the_plain_formula():
    """Bitwise against reference.simulate_lars, and against the textbook expressions
    m = mu m + (1-mu) g, u = m + wd w, c = eta ||w|| / (||u|| + eps) to rounding."""
    model = _mlp()
    params0 = [q.detach().clone() for q in model.parameters()]
    kw = dict(lr=2.0, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, eps=1e-8)
    opt = lbcomm.Lars(model.parameters(), **kw)
    grads = _run(model, opt, 6)
    history = SIM.simulate_lars(params0, grads, **kw)
    assert all(torch.equal(a, b) for a, b in zip(history[-1], model.parameters()))
    # the textbook expressions, written out once more for the first two steps
    w = [q.clone() for q in params0]
    m = [torch.zeros_like(q) for q in w]
    for t in range(2):
        for i, q in enumerate(w):
            g = grads[t][0][i]
            m[i] = 0.9 * m[i] + 0.1 * g
            if q.dim() > 1:
                u = m[i] + 0.01 * q
                c = 0.02 * q.norm() / (u.norm() + 1e-8)
                q -= 2.0 * c * u
                # the step of an adapted tensor has length lr * eta * ||w||
                assert torch.allclose((2.0 * c * u).norm(), 2.0 * 0.02 * (q + 2.0 * c * u).norm(), rtol=1e-5)
            else:
                q -= 2.0 * m[i]
        for a, b in zip(w, history[t]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(history[-1], params0)) > 1e-3


def test_exclusion_rules():
    """Default: 1-D tensors get neither trust ratio nor weight decay (step = lr m); True/False
    and a callable per group; the optimizer agrees with the reference in every case."""
    for exclude in (None, True, False, lambda q: q.shape[0] == 24):
        model = _mlp(seed=1)
        params0 = [q.detach().clone() for q in model.parameters()]
        kw = dict(lr=0.5, weight_decay=0.1, trust_coefficient=0.01, exclude_from_adaptation=exclude)
        opt = lbcomm.Lars(model.parameters(), **kw)
        grads = _run(model, opt, 1)
        hist = SIM.simulate_lars(params0, grads, **kw)
        assert all(torch.equal(a, b) for a, b in zip(hist[0], model.parameters())), exclude
        for q, q0, g in zip(model.parameters(), params0, grads[0][0]):
            excluded = (q.dim() <= 1) if exclude is None else exclude if isinstance(exclude, bool) else exclude(q)
            plain = q0 - 0.5 * (0.1 * g)  # m_1 = (1 - mu) g, no decay, no trust ratio
            if q0.norm() == 0:  # (LayerNorm's bias starts at 0: c = 1 and no decay either way)
                continue
            assert torch.allclose(q, plain, atol=1e-7) == bool(excluded), (exclude, q.shape)


def test_param_groups_and_validation():
    model = _mlp(seed=2)
    weights = [q for q in model.parameters() if q.dim() > 1]
    others = [q for q in model.parameters() if q.dim() <= 1]
    opt = lbcomm.Lars([{"params": weights, "weight_decay": 0.05}, {"params": others, "lr": 0.1}], lr=1.0)
    params0 = [q.detach().clone() for q in weights + others]
    grads = []
    for t in range(3):
        opt.zero_grad()
        _loss(model, 0, t).backward()
        grads.append([[q.grad.clone() for q in weights + others]])
        opt.step()
    # the same run as two separate optimizers of one group each
    a = SIM.simulate_lars(params0[:len(weights)], [[g[0][:len(weights)]] for g in grads], lr=1.0, weight_decay=0.05)
    b = SIM.simulate_lars(params0[len(weights):], [[g[0][len(weights):]] for g in grads], lr=0.1)
    assert all(torch.equal(x, y) for x, y in zip(a[-1] + b[-1], weights + others))
    for bad, match in [(dict(lr=-1.0), "learning rate"), (dict(lr=1.0, momentum=1.0), "momentum"),
                       (dict(lr=1.0, trust_coefficient=0.0), "trust_coefficient"),
                       (dict(lr=1.0, exclude_from_adaptation="bias"), "exclude_from_adaptation")]:
        with pytest.raises(ValueError, match=match):
            lbcomm.Lars(model.parameters(), **bad)
    with pytest.raises(ValueError, match="nonfinite"):
        lbcomm.Lars(model.parameters(), lr=1.0, comm=lbcomm.CommConfig(nonfinite="ignore"))


def test_scheduler_state_dict_and_bitwise_resume():
    """LEGW drives the lr; optimizer + scheduler state dicts (through torch.save) resume a
    run bitwise as if it never stopped."""
    def make():
        model = _mlp(seed=3)
        opt = lbcomm.Lars(model.parameters(), lr=1.0, weight_decay=0.01, trust_coefficient=0.01)
        return model, opt, lbcomm.schedules.LEGW(opt, base_warmup_steps=1, batch_scale=3, total_steps=8,
                                                 decay="cosine")

    model, opt, sched = make()
    _run(model, opt, 10, scheduler=sched)
    ref = [q.detach().clone() for q in model.parameters()]
    model, opt, sched = make()
    _run(model, opt, 4, scheduler=sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(sched.factor(5))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    assert set(ck["opt"]["state"][0]) == {"momentum_buffer", "step"}
    model, opt, sched = make()
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    sched.load_state_dict(ck["sched"])
    _run(model, opt, 6, start=4, scheduler=sched)
    assert all(torch.equal(a, b) for a, b in zip(ref, model.parameters()))


def test_nonfinite_gradients_raise_or_skip_with_the_state_unchanged():
    model = _mlp(seed=4)
    opt = lbcomm.Lars(model.parameters(), lr=1.0, comm=lbcomm.CommConfig(nonfinite="skip"))
    _run(model, opt, 2)
    before = copy.deepcopy(opt.state_dict())
    w = [q.detach().clone() for q in model.parameters()]
    opt.zero_grad()
    _loss(model, 0, 5).backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(w, model.parameters()))
    after = opt.state_dict()
    assert all(torch.equal(before["state"][k][n], after["state"][k][n]) for k in before["state"]
               for n in before["state"][k])
    strict = lbcomm.Lars(model.parameters(), lr=1.0, comm=lbcomm.CommConfig(nonfinite="raise"))
    with pytest.raises(NonFiniteError, match="nonfinite='skip'"):
        strict.step()


def test_zero_weights_and_zero_updates_stay_finite():
    zero = nn.Parameter(torch.zeros(4, 3))
    still = nn.Parameter(torch.randn(3, 3))
    s0 = still.detach().clone()
    opt = lbcomm.Lars([zero, still], lr=1.0)
    for _ in range(3):
        opt.zero_grad()
        ((zero * 1.0).sum() + (still * 0).sum()).backward()
        opt.step()
    assert torch.isfinite(zero).all() and (zero != 0).all()  # c = 1 while ||w|| = 0
    assert torch.equal(still, s0)  # zero gradient: ||u|| = 0, c = 1, u = 0 (no NaN from 0/0)


# ---------------------------------------------------------------------- 2 gloo ranks
def _ddp_onebit_hook(rank):
    """Lars under DDP + onebit_hook: 12 steps, one rank's loss overflows at step 9."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DDP(model)
    state = lbcomm.OneBitHookState(3, comm=lbcomm.CommConfig(nonfinite="skip", exact_numel=0))
    ddp.register_comm_hook(state, lbcomm.onebit_hook)
    # the hook averages the gradients: Lars is told so and does not communicate
    opt = lbcomm.Lars(ddp.parameters(), lr=2.0, weight_decay=1e-3, trust_coefficient=0.01, grads_averaged=True,
                      comm=lbcomm.CommConfig(nonfinite="skip"))
    calls = []
    orig = opt.transport.all_reduce
    opt.transport.all_reduce = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
    losses, snapshots = [], []
    for t in range(12):
        g = torch.Generator().manual_seed(100 * t + rank)
        x = torch.randn(32, 16, generator=g)
        y = (x[:, :4] + 0.1 * torch.randn(32, 4, generator=g)).argmax(1)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        if t == 8 and rank == 1:
            loss = loss * float("inf")  # one rank's gradients overflow: the hook makes the bucket NaN everywhere
        loss.backward()
        opt.step()
        losses.append(loss.item())
        snapshots.append([q.detach().clone() for q in model.parameters()])
    return {"losses": losses, "params": snapshots, "skipped": opt.skipped_steps, "averaged": opt.grads_averaged,
            "calls": len(calls), "compressed_bytes": state.total_bytes_sent < state.total_bytes_uncompressed}


def _self_averaging(rank):
    """Lars without DDP averages the (quantized, so exactly summable) gradients itself; under
    a plain DDP it refuses to average a second time until told grads_averaged."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from lbcomm.errors import AveragedGradientsError
    from optim_util import _quantize
    model = _mlp(seed=6)
    params0 = [q.detach().clone() for q in model.parameters()]
    opt = lbcomm.Lars(model.parameters(), lr=1.0, weight_decay=0.01, trust_coefficient=0.02)
    grads = []
    for t in range(3):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        for q in model.parameters():
            q.grad = _quantize(q.grad)
        grads.append([q.grad.clone() for q in model.parameters()])
        opt.step()
    ddp = DDP(_mlp(seed=6))
    plain = lbcomm.Lars(ddp.parameters(), lr=1.0)
    F.cross_entropy(ddp(torch.randn(4, 12)), torch.tensor([0, 1, 2, 3])).backward()
    try:
        plain.step()
        error = None
    except AveragedGradientsError as e:
        error = str(e)
    plain.grads_averaged = True
    plain.step()
    return {"params0": params0, "grads": grads, "params": [q.detach().clone() for q in model.parameters()],
            "error": error}


def _two_ranks(rank, p):
    return {"hook": _ddp_onebit_hook(rank), "self": _self_averaging(rank)}


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_ranks, 2)


def test_lars_averages_by_itself_and_refuses_a_second_average(two_ranks):
    res = [r["self"] for r in two_ranks]
    grads = [[res[r]["grads"][t] for r in range(2)] for t in range(3)]
    sim = SIM.simulate_lars(res[0]["params0"], grads, lr=1.0, weight_decay=0.01, trust_coefficient=0.02)
    for r in res:
        assert all(torch.equal(a, b) for a, b in zip(sim[-1], r["params"]))
        assert r["error"] is not None and "grads_averaged = True" in r["error"]


def test_lars_under_ddp_and_onebit_hook_keeps_replicas_identical(two_ranks):
    res = [r["hook"] for r in two_ranks]
    for t in range(12):
        assert all(torch.equal(a, b) for a, b in zip(res[0]["params"][t], res[1]["params"][t])), t
    for r in res:
        assert r["averaged"] and r["calls"] == 0  # the hook averaged: Lars did not communicate
        assert r["compressed_bytes"]  # and the hook really compressed
        assert r["skipped"] == 1  # step 9 (NaN on every rank after the hook) skipped on both ranks
    assert all(torch.equal(a, b) for a, b in zip(res[0]["params"][7], res[0]["params"][8]))
    assert sum(res[0]["losses"][-3:]) < sum(res[0]["losses"][:3])
