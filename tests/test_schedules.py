"""lbcomm.schedules: scaled_lr's rules, LEGW's warmup length and shape, its decays, and
resume through the scheduler's state_dict."""
import math

import pytest
import torch

import lbcomm
from lbcomm.schedules import LEGW, scaled_lr


def _opt(lr=0.8):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(opt, sched, steps):
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_scaled_lr_rules():
    assert scaled_lr(0.1, 256, 8192) == pytest.approx(3.2)
    assert scaled_lr(0.1, 256, 8192, rule="linear") == pytest.approx(3.2)
    assert scaled_lr(0.1, 256, 8192, rule="sqrt") == pytest.approx(0.1 * math.sqrt(32))
    assert scaled_lr(0.1, 512, 128, rule="sqrt") == pytest.approx(0.05)
    assert scaled_lr(0.3, 64, 64, rule="sqrt") == 0.3
    with pytest.raises(ValueError, match="rule"):
        scaled_lr(0.1, 256, 512, rule="cube")
    with pytest.raises(ValueError, match="batch"):
        scaled_lr(0.1, 0, 512)


def test_legw_warmup_length_grows_with_the_batch_scale():
    """W = base x k (linear, LEGW) or base x sqrt(k); lr_k = peak k / W, then the peak."""
    for base, k, rule, expected in [(4, 3, "linear", 12), (2.5, 4, "linear", 10), (4, 9, "sqrt", 12),
                                    (500 * 256 / 8192, 32, "linear", 500), (0, 8, "linear", 0)]:
        opt = _opt()
        sched = LEGW(opt, base_warmup_steps=base, batch_scale=k, rule=rule)
        assert sched.warmup_steps == expected
        lrs = _lrs(opt, sched, expected + 3)
        ramp = [0.8 * s / expected for s in range(1, expected + 1)]
        assert lrs == pytest.approx(ramp + [0.8] * 3)
        if expected:
            assert all(b > a for a, b in zip(lrs[:expected - 1], lrs[1:expected]))


def test_legw_decays_after_the_warmup():
    for decay, f in [("cosine", lambda q: 0.5 * (1 + math.cos(math.pi * q))), ("poly", lambda q: (1 - q) ** 2)]:
        opt = _opt(lr=2.0)
        sched = LEGW(opt, base_warmup_steps=1, batch_scale=4, total_steps=20, decay=decay)
        lrs = _lrs(opt, sched, 24)
        assert lrs[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])
        for k in range(5, 25):  # step k > W = 4: q = (k - 4) / 17
            assert lrs[k - 1] == pytest.approx(2.0 * f(min(1.0, (k - 4) / 17))), (decay, k)
        assert lrs[19] > 0 and lrs[20] == 0.0  # step 20 = total_steps still moves
        assert all(b <= a for a, b in zip(lrs[3:], lrs[4:]))
    with pytest.raises(ValueError, match="total_steps"):
        LEGW(_opt(), 1, 2, decay="cosine")
    with pytest.raises(ValueError, match="total_steps"):
        LEGW(_opt(), 5, 2, total_steps=4)
    with pytest.raises(ValueError, match="decay"):
        LEGW(_opt(), 1, 2, total_steps=4, decay="step")
    with pytest.raises(ValueError, match="batch_scale"):
        LEGW(_opt(), 1, 0)


def test_legw_resumes_from_its_state_dict_and_keeps_group_peaks():
    model = torch.nn.Linear(3, 2)
    opt = lbcomm.Lars([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}], lr=1.0)
    sched = LEGW(opt, base_warmup_steps=2, batch_scale=2, total_steps=10, decay="poly")
    full = []
    for _ in range(10):
        full.append([g["lr"] for g in opt.param_groups])
        opt.step()  # no gradients: nothing moves
        sched.step()
    assert full[3] == pytest.approx([1.0, 0.1]) and full[0] == pytest.approx([0.25, 0.025])
    opt2 = lbcomm.Lars([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}], lr=1.0)
    s2 = LEGW(opt2, base_warmup_steps=2, batch_scale=2, total_steps=10, decay="poly")
    for _ in range(6):
        opt2.step()
        s2.step()
    sd = s2.state_dict()
    # the usual order: build optimizer and scheduler, then load both
    opt3 = lbcomm.Lars([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}], lr=1.0)
    s3 = LEGW(opt3, base_warmup_steps=2, batch_scale=2, total_steps=10, decay="poly")
    opt3.load_state_dict(opt2.state_dict())
    s3.load_state_dict(sd)
    assert s3.last_epoch == 6 and s3.warmup_steps == 4
    assert [g["lr"] for g in opt3.param_groups] == pytest.approx(full[6])
    for k in range(6, 9):
        opt3.step()
        s3.step()
        assert [g["lr"] for g in opt3.param_groups] == pytest.approx(full[k + 1])
