"""OneBitAdam(rescale_variance=True): the frozen variance of each parameter follows the
change of its gradient scale, measured by the ranks' mean squared local gradient norm
(docs/concepts.md, "Robustness": the byte LM's frozen-variance gap).

One and two ranks: bitwise against lbcomm.testing.optim (a sum of two ranks' norms has
one result whatever the order; with four, gloo's order is not the simulation's and the
last bit can differ: tests/test_optim_ranks.py compares that case to fp32 rounding). The
optimizer's own averaging and lbcomm's warmup hook give the same statistic and the same
run (the hook hands over the local gradients, note_local_grads, before it averages).
Checkpoints: a resume is bitwise.
"""
import copy
import logging

import pytest
import torch

import lbcomm
from lbcomm.testing.optim import simulate_onebit_adam
from dist_util import run_ranks
from optim_util import make_opt

FREEZE, STEPS, LR = 4, 14, 1e-2
KW = dict(lr=LR, freeze_step=FREEZE, exact_numel=0, block_size=64, weight_decay=1e-2)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


def _batches(rank, steps=STEPS):
    g = torch.Generator().manual_seed(100 + rank)
    # the inputs shrink over the run, so that the gradient scale really changes after the freeze
    return [(torch.randn(8, 12, generator=g) * (1.0 - 0.05 * t), torch.randint(0, 5, (8,), generator=g))
            for t in range(steps)]


def _run(model, opt, batches, record_grads=False):
    hist, grads = [], []
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if record_grads:
            grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        hist.append([p.detach().clone() for p in model.parameters()])
    return hist, grads


def test_one_rank_bitwise_against_the_simulation():
    model = _model()
    p0 = [p.detach().clone() for p in model.parameters()]
    opt = make_opt(lbcomm.OneBitAdam, model.parameters(), rescale_variance=True, **KW)
    hist, grads = _run(model, opt, _batches(0), record_grads=True)
    sim = simulate_onebit_adam(p0, [[g] for g in grads], rescale_variance=True, **KW)
    for t in range(STEPS):
        assert all(torch.equal(a, b) for a, b in zip(sim[t], hist[t])), f"step {t + 1}"
    # the rescale is really applied: the published simulation differs after the freeze, not before
    plain = simulate_onebit_adam(p0, [[g] for g in grads], rescale_variance=False, **KW)
    assert all(torch.equal(a, b) for a, b in zip(plain[FREEZE - 1], hist[FREEZE - 1]))
    assert max((a - b).abs().max().item() for a, b in zip(plain[-1], hist[-1])) > 1e-5
    frozen = opt._vectors["grad_sq_frozen"]
    assert bool((frozen > 0).all())


def test_resume_is_bitwise_and_the_option_round_trips():
    save_at = FREEZE + 3
    batches = _batches(0)
    model = _model()
    opt = make_opt(lbcomm.OneBitAdam, model.parameters(), rescale_variance=True, **KW)
    straight, _ = _run(model, opt, batches)

    model = _model()
    opt = make_opt(lbcomm.OneBitAdam, model.parameters(), rescale_variance=True, **KW)
    _run(model, opt, batches[:save_at])
    sd, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    model2 = _model(seed=1)
    model2.load_state_dict(weights)
    opt2 = make_opt(lbcomm.OneBitAdam, model2.parameters(), rescale_variance=True, **KW)
    opt2.load_state_dict(sd)
    resumed, _ = _run(model2, opt2, batches[save_at:])
    for a, b in zip(resumed, straight[save_at:]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))

    # rescale_variance is a hyperparameter of the param groups: switched off in the state
    # dict, the run continues with the published frozen variance instead
    off = copy.deepcopy(sd)
    for g in off["param_groups"]:
        g["rescale_variance"] = False
    m = _model(seed=1)
    m.load_state_dict(weights)
    o = make_opt(lbcomm.OneBitAdam, m.parameters(), rescale_variance=True, **KW)
    o.load_state_dict(off)
    assert o.param_groups[0]["rescale_variance"] is False
    published, _ = _run(m, o, batches[save_at:])
    assert max((a - b).abs().max().item() for a, b in zip(published[-1], resumed[-1])) > 1e-6


def test_gradients_averaged_elsewhere_warn_and_keep_the_variance_frozen(caplog):
    """A DDP hook other than lbcomm's averaged the warmup's gradients: the local norms are
    unknown, so the run says so and is the published frozen-variance run, bit for bit."""
    runs = {}
    for rescale in (True, False):
        model = _model()
        opt = make_opt(lbcomm.OneBitAdam, model.parameters(), rescale_variance=rescale, **KW)
        opt.grads_averaged = True  # one rank: the "averaged" gradients are the local ones
        with caplog.at_level(logging.WARNING, logger="lbcomm"):
            runs[rescale], _ = _run(model, opt, _batches(0))
        if rescale:
            assert "rescale_variance is off for this run" in caplog.text
            assert bool((opt._vectors["grad_sq_frozen"] == -1).all())
    for a, b in zip(runs[True], runs[False]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_invalid_option():
    with pytest.raises(ValueError, match="rescale_variance"):
        make_opt(lbcomm.OneBitAdam, _model().parameters(), rescale_variance=1, **KW)


def _two_ranks(rank, p):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for how in ("optimizer", "hook"):
        model = _model()
        p0 = [q.detach().clone() for q in model.parameters()]
        opt = make_opt(lbcomm.OneBitAdam, model.parameters(), rescale_variance=True, **KW)
        net = model
        if how == "hook":
            net = DDP(model)
            net.register_comm_hook(lbcomm.ddp.WarmupAverage(opt), lbcomm.ddp.warmup_average_hook)
        hist, grads = [], []
        for x, y in _batches(rank):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            if how == "optimizer":
                grads.append([q.grad.clone() for q in model.parameters()])
            opt.step()
            hist.append([q.detach().clone() for q in model.parameters()])
        out[how] = dict(hist=hist, frozen=opt._vectors["grad_sq_frozen"].clone(),
                        ema=opt._vectors["grad_sq"].clone(), bytes=opt.bytes_per_step())
        if how == "optimizer":
            out["grads"], out["p0"] = grads, p0
    dist.barrier()
    return out


def test_two_ranks_optimizer_and_hook_paths_agree_with_the_simulation():
    res = run_ranks(_two_ranks, 2)
    for how in ("optimizer", "hook"):
        for t in range(STEPS):  # every rank the same parameters
            assert all(torch.equal(a, b) for a, b in zip(res[0][how]["hist"][t], res[1][how]["hist"][t]))
        assert bool((res[0][how]["frozen"] > 0).all()), how  # tracked on both paths
    # the hook handed over the same local norms the optimizer measures itself
    assert torch.equal(res[0]["hook"]["frozen"], res[0]["optimizer"]["frozen"])
    assert torch.equal(res[0]["hook"]["ema"], res[0]["optimizer"]["ema"])
    grads = [[res[r]["grads"][t] for r in range(2)] for t in range(STEPS)]
    sim = simulate_onebit_adam(res[0]["p0"], grads, rescale_variance=True, **KW)
    plain = simulate_onebit_adam(res[0]["p0"], grads, rescale_variance=False, **KW)
    for how in ("optimizer", "hook"):  # a sum of two ranks has one order: bitwise
        for t in range(STEPS):
            assert all(torch.equal(a, b) for a, b in zip(res[0][how]["hist"][t], sim[t])), (how, t + 1)
    assert max((a - b).abs().max().item() for a, b in zip(plain[-1], sim[-1])) > 1e-5
    # the statistic rides in the finiteness agreement: one fp32 scalar more per parameter
    n = len(res[0]["p0"])
    assert res[0]["optimizer"]["bytes"]["agreement"] == 4 * (1 + n)  # ring: 2 (p - 1) / p x 4 (1 + n) bytes


def _one_tensor_run(cls, rescale, growth):
    """One rank, one weight matrix (no bias), a regression whose inputs scale by
    (1 + growth t): its gradient norm grows (growth > 0) or shrinks (< 0) after the freeze."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(12, 5, bias=False)
    kw = dict(lr=LR, weight_decay=1e-2, comm=lbcomm.CommConfig(exact_numel=0, block_size=64),
              options=lbcomm.OneBitOptions(rescale_variance=rescale))
    opt = (cls(lin.parameters(), freeze_step=FREEZE, **kw) if cls is lbcomm.OneBitAdam
           else cls(lin.parameters(), var_freeze_step=FREEZE, var_update_scaler=2, local_step_clipper=2, **kw))
    g = torch.Generator().manual_seed(7)
    hist = []
    for t in range(STEPS):
        x = torch.randn(16, 12, generator=g) * (1.0 + growth * t)
        opt.zero_grad()
        (lin(x) - x[:, :5]).square().mean().backward()
        opt.step()
        hist.append(lin.weight.detach().clone())
    return hist, opt


@pytest.mark.parametrize("cls", [lbcomm.OneBitAdam, lbcomm.ZeroOneAdam])
def test_growing_gradients_leave_the_variance_as_it_is(cls):
    """The factor is capped at 1: when a tensor's gradients grow after the variance was last
    updated, the run is the unscaled one bit for bit; when they shrink, it is not."""
    grown, opt = _one_tensor_run(cls, True, 0.3)
    q, ref = opt._vectors["grad_sq"].item(), opt._vectors["grad_sq_frozen"].item()
    assert q / (1 - 0.999 ** STEPS) > 2 * ref  # the uncapped factor would be well above 1
    plain, _ = _one_tensor_run(cls, False, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(grown, plain))
    shrunk, _ = _one_tensor_run(cls, True, -0.05)
    plain, _ = _one_tensor_run(cls, False, -0.05)
    assert max((a - b).abs().max().item() for a, b in zip(shrunk, plain)) > 1e-6
