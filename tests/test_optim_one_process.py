"""OneBitAdam, Lamb and OneBitLamb in one process: against torch.optim.AdamW (param groups,
schedulers, closures, frozen and low-precision parameters, the frozen variance), against the
plain-torch simulation (lbcomm.testing.optim), and their formulas at the edges (zero norms,
non-finite gradients, the estimated norm)."""
import math

import pytest
import torch
from torch import nn

import lbcomm
from lbcomm.testing import optim as SIM
from dist_util import same as _same
from optim_util import _loss, _max_diff, _mlp, _snapshot, _train


def test_param_groups_schedulers_and_closures_match_adamw():
    model, ref = _mlp(), _mlp()
    groups = lambda m: [{"params": list(m[0].parameters()), "lr": 5e-3, "weight_decay": 0.0},  # noqa: E731
                        {"params": [q for layer in list(m)[1:] for q in layer.parameters()]}]
    opt = lbcomm.OneBitAdam(groups(model), lr=2e-3, weight_decay=0.1, freeze_step=500)
    ref_opt = torch.optim.AdamW(groups(ref), lr=2e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=10, gamma=0.5)
    losses = _train(model, opt, 50, closure=True, scheduler=sched)
    _train(ref, ref_opt, 50, closure=True, scheduler=ref_sched)
    assert _max_diff(model, ref) <= 1e-6
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3 / 32) and losses[-1] < losses[0]
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float32


def test_params_without_grads_and_frozen_params_match_adamw():
    model, ref = _mlp(), _mlp()
    for m in (model, ref):
        m[3].weight.requires_grad_(False)  # frozen
    extra, ref_extra = nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(7))
    ref_extra.data.copy_(extra.data)
    opt = lbcomm.OneBitAdam(list(model.parameters()) + [extra], lr=1e-2, weight_decay=0.1, freeze_step=500)
    ref_opt = torch.optim.AdamW(list(ref.parameters()) + [ref_extra], lr=1e-2, weight_decay=0.1)
    frozen0 = model[3].weight.detach().clone()
    for t in range(30):
        for m, e, o in ((model, extra, opt), (ref, ref_extra, ref_opt)):
            o.zero_grad()
            loss = _loss(m, 0, t)
            if t % 3 == 0:  # the extra param gets a grad only every third step
                loss = loss + (e ** 2).sum()
            loss.backward()
            if t % 5 == 4:  # and the last layer's bias sometimes none at all
                m[5].bias.grad = None
            o.step()
    assert _max_diff(model, ref) <= 1e-6 and (extra - ref_extra).abs().max().item() <= 1e-6
    assert torch.equal(model[3].weight, frozen0)
    assert model[3].weight not in opt.state
    assert opt.state[extra]["step"].item() == 10 and opt.state[model[5].bias]["step"].item() == 24


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_low_precision_params_keep_fp32_state(dtype, name):
    torch.manual_seed(0)
    p32 = torch.randn(64, 33)
    p_low = nn.Parameter(p32.to(dtype))
    ref = nn.Parameter(p_low.detach().float())
    make = (lambda ps: lbcomm.OneBitAdam(ps, lr=1e-2, freeze_step=3)) if name == "adam" else \
        (lambda ps: lbcomm.OneBitLamb(ps, lr=1e-2, weight_decay=0.01, freeze_step=3))
    opt, ref_opt = make([p_low]), make([ref])
    for t in range(6):
        g = torch.randn(64, 33).to(dtype)
        p_low.grad, ref.grad = g, g.float()
        ref.data.copy_(p_low.detach().float())  # same start: the fp32 result rounded is the low-precision one
        start = ref.detach().clone()
        opt.step()
        ref_opt.step()
        assert p_low.dtype == dtype
        assert torch.equal(p_low.detach(), ref.detach().to(dtype)), t
        assert not torch.equal(start, ref.detach())
    for key, val in opt.state[p_low].items():  # the optimizer's own dtypes, whatever the parameter's
        assert val.dtype == (torch.bfloat16 if key == "exp_avg_local" else torch.float32), key
    assert torch.equal(opt.state[p_low]["exp_avg"], ref_opt.state[ref]["exp_avg"])


def test_one_rank_past_freeze_equals_adamw_with_frozen_variance():
    lr, b1, b2, eps, wd, freeze = 3e-3, 0.9, 0.999, 1e-8, 0.02, 12
    model, ref = _mlp(), _mlp()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, freeze_step=freeze,
                            # the published update (the formula below)
                            options=lbcomm.OneBitOptions(max_update=None, rescale_variance=False))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    _train(model, opt, freeze)
    _train(ref, ref_opt, freeze)
    assert opt.frozen and opt.compression_state is None and _max_diff(model, ref) <= 1e-6
    state = {q: (ref_opt.state[q]["exp_avg"], ref_opt.state[q]["exp_avg_sq"]) for q in ref.parameters()}
    for t in range(freeze + 1, freeze + 41):
        _train(model, opt, 1, start=t - 1)
        ref.zero_grad()
        _loss(ref, 0, t - 1).backward()
        with torch.no_grad():
            for q in ref.parameters():
                m, v = state[q]
                m.lerp_(q.grad, 1 - b1)
                # v and its correction frozen; the root correctly rounded (fp64, rounded once)
                denom = (torch.sqrt(v.double()).float() / math.sqrt(1 - b2 ** freeze)).add_(eps)
                q.mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
        assert _max_diff(model, ref) <= 1e-6, t
    assert torch.equal(opt.state[model[0].weight]["exp_avg_sq"], state[ref[0].weight][1])


def test_past_freeze_missing_grads_and_eps_changes_match_the_formula():
    """The compression stage reads grads straight from .grad (None counts as zero) and
    caches sqrt(v^) + eps; a changed eps must be picked up."""
    lr, b1, b2, wd, freeze = 3e-3, 0.9, 0.999, 0.02, 5
    model, ref = _mlp(), _mlp()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=lr, betas=(b1, b2), eps=1e-8, weight_decay=wd, freeze_step=freeze,
                            # the published update (the formula below)
                            options=lbcomm.OneBitOptions(max_update=None, rescale_variance=False))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(b1, b2), eps=1e-8, weight_decay=wd)
    _train(model, opt, freeze)
    _train(ref, ref_opt, freeze)
    state = {q: (ref_opt.state[q]["exp_avg"], ref_opt.state[q]["exp_avg_sq"]) for q in ref.parameters()}
    eps = 1e-8
    for t in range(freeze + 1, freeze + 21):
        if t == freeze + 8:
            eps = 1e-3
            opt.param_groups[0]["eps"] = eps
        for mod in (model, ref):
            mod.zero_grad()
            _loss(mod, 0, t - 1).backward()
            if t % 3 == 0:
                mod[5].bias.grad = None
        opt.step()
        with torch.no_grad():
            for q in ref.parameters():
                m, v = state[q]
                m.lerp_(torch.zeros_like(q) if q.grad is None else q.grad, 1 - b1)
                denom = (torch.sqrt(v.double()).float() / math.sqrt(1 - b2 ** freeze)).add_(eps)
                q.mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
        assert _max_diff(model, ref) == 0, t


@pytest.mark.parametrize("fraction", [0.001, 0.5])
def test_masked_coordinates_stay_put_past_the_freeze(fraction):
    """Sparse masks are zeroed through an index list, dense ones with masked_fill."""
    model = _mlp()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, weight_decay=0.0, freeze_step=3)
    w = model[3].weight
    keep = torch.rand(w.shape, generator=torch.Generator().manual_seed(1)) >= fraction
    keep.view(-1)[0] = False
    opt.set_momentum_mask(w, keep)
    _train(model, opt, 3)
    before = w.detach().clone()
    _train(model, opt, 5, start=3)
    assert torch.equal(w[~keep], before[~keep])
    assert bool((w[keep] != before[keep]).all())
    assert torch.equal(opt.state[w]["exp_avg"][~keep], torch.zeros(int((~keep).sum())))


def test_lamb_matches_the_simulation_on_one_rank():
    model = _mlp()
    params0 = [q.detach().clone() for q in model.parameters()]
    opt = lbcomm.Lamb(model.parameters(), lr=1e-2, weight_decay=0.01)
    grads = []
    for t in range(20):
        opt.zero_grad()
        _loss(model, 0, t).backward()
        grads.append([[q.grad.clone() for q in model.parameters()]])
        opt.step()
    history = SIM.simulate_lamb(params0, grads, lr=1e-2, weight_decay=0.01)
    assert all(torch.equal(a, b) for a, b in zip(history[-1], model.parameters()))


@pytest.mark.parametrize("name", ["lamb", "onebit_lamb"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lamb_coefficients_stay_finite_for_zero_norms(name, wd):
    zero_param = nn.Parameter(torch.zeros(5, 4))  # ||p|| = 0
    still = nn.Parameter(torch.randn(6))  # its gradient is always zero: zero momentum, ||u|| = 0 without wd
    moving = nn.Parameter(torch.randn(8))
    params = [zero_param, still, moving]
    opt = lbcomm.Lamb(params, lr=1e-2, weight_decay=wd) if name == "lamb" else \
        lbcomm.OneBitLamb(params, lr=1e-2, weight_decay=wd, freeze_step=3)
    still0, moving0 = still.detach().clone(), moving.detach().clone()
    for t in range(8):
        opt.zero_grad()
        (moving.sum() * (t + 1) + (zero_param * 0).sum() + (still * 0).sum()).backward()
        opt.step()
        for q in params:
            assert torch.isfinite(q).all(), (t, q)
        for st in opt.state.values():
            for key, val in st.items():
                assert torch.isfinite(val).all(), (t, key)
    if wd == 0:
        assert torch.equal(still, still0) and torch.equal(zero_param, torch.zeros(5, 4))
    assert (moving - moving0).abs().min().item() > 1e-3


def test_nonfinite_on_one_rank_raises_or_skips_with_state_untouched():
    for policy in ("raise", "skip"):
        model = _mlp()
        opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm=lbcomm.CommConfig(nonfinite=policy))
        for t in range(4):
            opt.zero_grad()
            _loss(model, 0, t).backward()
            if t in (1, 3):  # one in the warmup, one after the freeze
                model[0].weight.grad[1, 1] = float("nan")
            before = _snapshot(model, opt)
            if policy == "raise" and t in (1, 3):
                with pytest.raises(lbcomm.NonFiniteError, match="state is unchanged"):
                    opt.step()
            else:
                opt.step()
            assert opt.last_step_skipped == (t in (1, 3))
            if t in (1, 3):
                assert _same(before, _snapshot(model, opt))
        assert opt.global_step == 2 and opt.skipped_steps == 2


def test_the_estimated_norm_is_bounded_by_the_peak_lr():
    """The live ratio's norm: the estimate's root, never below 0.1 ||u||, and under
    norm_step_bound tau never below ||u|| / max(1, tau / lr_peak): the bound is set by the
    largest lr of the compression stage and stays as the schedule decays the lr."""
    est = lbcomm.OneBitLamb._estimated_norm
    un = torch.tensor([2.0])
    sq = torch.tensor(0.01, dtype=torch.float64)  # an estimate far below ||u||
    assert est(sq, un, {"lr": 0.01, "norm_step_bound": None}).item() == pytest.approx(0.2)  # 0.1 ||u||
    assert est(sq, un, {"lr": 0.01, "norm_step_bound": 0.1}).item() == pytest.approx(0.2)  # factor 10
    assert est(sq, un, {"lr": 0.01, "norm_step_bound": 0.05}).item() == pytest.approx(0.4)  # factor 5
    # decayed from a peak of 0.05: the factor stays 2, not 10
    assert est(sq, un, {"lr": 0.01, "lr_peak": 0.05, "norm_step_bound": 0.1}).item() == pytest.approx(1.0)
    # a run at an lr of tau or more divides by the decoded norm (or the estimate, if larger)
    assert est(sq, un, {"lr": 0.2, "norm_step_bound": 0.1}).item() == pytest.approx(2.0)
    assert est(torch.tensor(9.0, dtype=torch.float64), un, {"lr": 0.2, "norm_step_bound": 0.1}).item() == 3.0
