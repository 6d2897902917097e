"""OneBitOptions: the 1-bit optimizers' compression-stage math in its own object, out of
CommConfig. The 0.2 form (the fields in CommConfig) still works with a FutureWarning and
gives bitwise the same run; both forms at once, or an option an optimizer does not have,
is refused; every optimizer constructor stays at 12 parameters or fewer."""
import inspect
import warnings

import pytest
import torch

import lbcomm
from lbcomm.config import MOVED_TO_OPTIONS, split_settings
from optim_util import _mlp, _train

ONE_BIT = (lbcomm.OneBitAdam, lbcomm.OneBitLamb, lbcomm.ZeroOneAdam)


@pytest.mark.parametrize("cls", [*ONE_BIT, lbcomm.Lamb, lbcomm.Lars, lbcomm.DecentLaM, lbcomm.DmSGD])
def test_constructors_have_at_most_12_parameters(cls):
    assert len(inspect.signature(cls.__init__).parameters) - 1 <= 12  # without self


def test_commconfig_holds_communication_only():
    comm = repr(lbcomm.CommConfig())
    assert not any(name in comm for name in ("max_update", "capped_decode", "mask_threshold"))
    assert split_settings(dict(block_size=64, max_update=None, lr=1.0)) == (
        {"block_size": 64}, {"max_update": None}, {"lr": 1.0})


@pytest.mark.parametrize("cls", ONE_BIT)
def test_the_02_form_warns_and_trains_bitwise_as_options(cls):
    freeze = {"var_freeze_step": 3, "var_update_scaler": 1} if cls is lbcomm.ZeroOneAdam else {"freeze_step": 3}
    runs = []
    for form in ("options", "comm"):
        model = _mlp(seed=1)
        if form == "options":
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the 0.3 form warns about nothing
                opt = cls(model.parameters(), lr=1e-2, **freeze, options=lbcomm.OneBitOptions(max_update=0.05,
                                                                                              mask_threshold=0.0))
        else:
            with pytest.warns(FutureWarning, match=r"options=lbcomm.OneBitOptions\(mask_threshold=0.0, max_update=0.05"):
                comm = lbcomm.CommConfig(max_update=0.05, mask_threshold=0.0)
            opt = cls(model.parameters(), lr=1e-2, **freeze, comm=comm)
        assert opt.options == lbcomm.OneBitOptions(max_update=0.05, mask_threshold=0.0)
        assert opt.comm.moved_options() == {}  # what the optimizer keeps is communication only
        _train(model, opt, 8)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_both_forms_at_once_are_refused():
    with pytest.warns(FutureWarning):
        comm = lbcomm.CommConfig(capped_decode=False)
    with pytest.raises(TypeError, match="capped_decode in options"):
        lbcomm.OneBitAdam(_mlp().parameters(), comm=comm, options=lbcomm.OneBitOptions())


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_update=0.0), "Invalid max_update: 0.0"),
    (dict(capped_decode="yes"), "Invalid capped_decode"),
    (dict(mask_threshold=1.0), "Invalid mask_threshold"),
    (dict(rescale_variance=1), "Invalid rescale_variance"),
    (dict(bias_correction=None), "Invalid bias_correction"),
])
def test_invalid_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lbcomm.OneBitOptions(**kwargs)
    if set(kwargs) <= set(MOVED_TO_OPTIONS):  # the 0.2 form checks them as well
        with pytest.raises(ValueError, match=match):
            lbcomm.CommConfig(**kwargs)


def test_options_must_be_onebitoptions_and_fit_the_optimizer():
    with pytest.raises(TypeError, match="options must be a lbcomm.OneBitOptions"):
        lbcomm.OneBitAdam(_mlp().parameters(), options={"max_update": None})
    with pytest.raises(ValueError, match="OneBitLamb scales its frozen variance"):
        lbcomm.OneBitLamb(_mlp().parameters(), options=lbcomm.OneBitOptions(rescale_variance=False))
    with pytest.raises(ValueError, match="'warmup' is not supported by ZeroOneAdam"):
        lbcomm.ZeroOneAdam(_mlp().parameters(), options=lbcomm.OneBitOptions(max_update="warmup"))


def test_options_reach_the_param_groups_and_the_checkpoint():
    """bias_correction and rescale_variance stay per-group hyperparameters (a 0.2 checkpoint's
    groups load unchanged; a group may still set them)."""
    opt = lbcomm.OneBitAdam(_mlp().parameters(), options=lbcomm.OneBitOptions(bias_correction=False))
    assert opt.param_groups[0]["bias_correction"] is False and opt.param_groups[0]["rescale_variance"] is True
    assert opt.state_dict()["param_groups"][0]["bias_correction"] is False
