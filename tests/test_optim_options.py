"""OneBitAdam and OneBitLamb options: invalid values refused with the option's name, param
group options, and what the optimizers log and warn about."""
import logging

import pytest
import torch
from torch import nn

import lbcomm
from optim_util import _mlp, _train, make_opt


def test_onebit_lamb_norm_options_are_validated():
    model = _mlp()
    for bad in (-1, 2.5, True, "256"):
        with pytest.raises(ValueError, match="norm_samples"):
            lbcomm.OneBitLamb([{"params": model.parameters(), "norm_samples": bad}])
    for bad in (0, -0.1, True, "0.03"):
        with pytest.raises(ValueError, match="norm_step_bound"):
            lbcomm.OneBitLamb([{"params": model.parameters(), "norm_step_bound": bad}])
    opt = lbcomm.OneBitLamb([{"params": model.parameters(), "norm_samples": 0, "norm_step_bound": None}])
    assert opt.param_groups[0]["norm_samples"] == 0 and opt.param_groups[0]["norm_step_bound"] is None
    assert lbcomm.OneBitLamb(model.parameters()).defaults["norm_samples"] == 256


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1.0), "Invalid learning rate: -1.0"),
    (dict(eps=-1e-8), "Invalid epsilon value"),
    (dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0"),
    (dict(weight_decay=-0.1), "Invalid weight_decay value"),
    (dict(freeze_step=0), "Invalid freeze_step"),
    (dict(block_size=100), "Invalid block_size"),
    (dict(nonfinite="ignore"), "Invalid nonfinite policy"),
    (dict(max_update=0.0), "Invalid max_update: 0.0"),
    (dict(max_update=-1.0), "Invalid max_update"),
    (dict(max_update=float("nan")), "Invalid max_update"),
    (dict(max_update=True), "Invalid max_update"),
    (dict(max_update="warm"), "Invalid max_update"),
    (dict(max_update="auto", betas=(0.9, 0.5)), "Invalid max_update: 'auto' needs beta1\\*\\*2 < beta2"),
])
def test_invalid_options_are_refused(kwargs, match):
    for cls in (lbcomm.OneBitAdam, lbcomm.OneBitLamb):
        with pytest.raises(ValueError, match=match):
            make_opt(cls, _mlp().parameters(), **kwargs)
    for bad in ((2.0, 1.0), (-1.0, 1.0), (1.0,)):
        with pytest.raises(ValueError, match="Invalid coeff_range"):
            lbcomm.Lamb(_mlp().parameters(), coeff_range=bad)
    with pytest.raises(ValueError, match="Invalid factor_range"):
        lbcomm.OneBitLamb(_mlp().parameters(), factor_range=(0.0, 4.0))
    with pytest.raises(TypeError, match="comm must be a lbcomm.CommConfig"):
        lbcomm.OneBitAdam(_mlp().parameters(), comm={"block_size": 64})
    with pytest.raises(ValueError, match="same for all param groups"):
        model = _mlp()
        lbcomm.OneBitAdam([{"params": model[0].parameters(), "freeze_step": 3},
                           {"params": model[3].parameters()}], freeze_step=5)


def test_factor_threshold_is_a_param_group_option():
    """OneBitLamb's rarely tuned factor_threshold is set per param group, not in the constructor."""
    model = _mlp()
    opt = lbcomm.OneBitLamb([{"params": model.parameters(), "factor_threshold": 0.25}], freeze_step=7)
    assert opt.param_groups[0]["factor_threshold"] == 0.25
    assert lbcomm.OneBitLamb(_mlp().parameters()).param_groups[0]["factor_threshold"] == 0.1
    with pytest.raises(ValueError, match="factor_threshold"):
        lbcomm.OneBitLamb([{"params": _mlp().parameters(), "factor_threshold": -1.0}])
    with pytest.raises(TypeError):
        lbcomm.OneBitLamb(_mlp().parameters(), factor_threshold=0.2)


def test_set_momentum_mask_validates_its_input():
    model = _mlp()
    opt = lbcomm.OneBitAdam(model.parameters(), freeze_step=3)
    with pytest.raises(ValueError, match="bool tensor of shape"):
        opt.set_momentum_mask(model[0].weight, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="not a parameter"):
        opt.set_momentum_mask(nn.Parameter(torch.zeros(2)), None)


def test_freeze_is_logged(caplog):
    model = _mlp()
    opt = lbcomm.OneBitAdam(model.parameters(), freeze_step=2)
    with caplog.at_level(logging.INFO, logger="lbcomm"):
        _train(model, opt, 3)
    assert any("variance frozen after step 2" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("cls", [lbcomm.OneBitAdam, lbcomm.OneBitLamb, lbcomm.ZeroOneAdam])
def test_an_lr_rising_after_the_freeze_is_warned_about_once(cls, caplog):
    """A freeze inside the lr warmup is logged (once) when the lr has risen 1.5x since the
    first step after it (ZeroOneAdam: after var_freeze_step, the last variance update); a
    schedule that decays after the freeze is not."""
    option = "var_freeze_step" if cls is lbcomm.ZeroOneAdam else "freeze_step"

    def run(factors):
        model = _mlp()
        opt = cls(model.parameters(), lr=1e-3, **{option: 2})
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: factors[min(t, len(factors) - 1)])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lbcomm"):
            _train(model, opt, 8, scheduler=sched)
        return [r.getMessage() for r in caplog.records if "rose from" in r.getMessage()]

    rising = run([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])  # the first compressed step at 0.3
    assert len(rising) == 1 and "param group 0 rose from 0.0003 " in rising[0] and f"set {option} " in rising[0]
    assert run([1.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5]) == []
    assert run([0.1, 0.2, 0.3, 0.4, 0.44, 0.44, 0.44, 0.44]) == []  # under 1.5x


@pytest.mark.parametrize("cls", [lbcomm.OneBitAdam, lbcomm.OneBitLamb])
def test_exact_numel_is_validated(cls):
    model = _mlp()
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="exact_numel"):
            cls(model.parameters(), comm=lbcomm.CommConfig(exact_numel=bad))
    assert cls(model.parameters(), comm=lbcomm.CommConfig(exact_numel=4096)).comm.exact_numel == 4096
