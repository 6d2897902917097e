"""The optimizer core's structure (lbcomm.optim.base / onebit / flat / functional): torch's
per-parameter state and state-dict hooks, options kept in the param groups, the 1-bit
machinery as one component held by the optimizers that compress (no diamond, one level of
lbcomm base class), the compact mask and the finiteness pre-check."""
import copy

import pytest
import torch

import lbcomm
from lbcomm.optim import BaseOptimizer, OneBitStage
from optim_util import _mlp, _train


def test_the_optimizers_compose_the_onebit_stage():
    """One level of lbcomm base class, no diamond; the 1-bit machinery is a component."""
    import lbcomm.optim as O

    assert not hasattr(O, "FlatOptimizer") and not hasattr(O, "OneBitOptimizer")
    for cls in (lbcomm.OneBitAdam, lbcomm.OneBitLamb, lbcomm.ZeroOneAdam, lbcomm.Lamb, lbcomm.Lars):
        assert cls.__bases__ == (BaseOptimizer,), cls
    for cls in (lbcomm.OneBitAdam, lbcomm.OneBitLamb, lbcomm.ZeroOneAdam):
        assert isinstance(cls(_mlp().parameters())._onebit, OneBitStage)
    lamb = lbcomm.Lamb(_mlp().parameters())
    assert lamb._onebit is None and not lamb.frozen
    assert not hasattr(lamb, "set_momentum_mask") and not hasattr(lamb, "compression_state")
    opt = lbcomm.OneBitLamb(_mlp().parameters(), coeff_range=(0.01, 3.0), coeff_beta=0.5)
    assert opt.param_groups[0]["coeff_range"] == (0.01, 3.0) and opt.param_groups[0]["coeff_beta"] == 0.5


def test_warmup_hook_contract():
    """frozen (read-only), grads_averaged (settable), note_local_grads (a no-op where unused)."""
    model = _mlp()
    for cls in (lbcomm.OneBitAdam, lbcomm.OneBitLamb, lbcomm.ZeroOneAdam, lbcomm.Lamb):
        opt = cls(model.parameters())
        assert opt.frozen is False and opt.grads_averaged is False
        opt.grads_averaged = True
        assert opt.grads_averaged is True
        with pytest.raises(AttributeError):
            opt.frozen = True
        opt.note_local_grads(list(model.parameters()), [torch.ones_like(q) for q in model.parameters()])


def test_state_dict_carries_torch_per_parameter_state():
    model = _mlp()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=3)
    _train(model, opt, 5)
    sd = opt.state_dict()
    params = list(model.parameters())
    assert set(sd["state"]) == set(range(len(params)))
    for k, q in enumerate(params):
        st = sd["state"][k]
        assert {"exp_avg", "exp_avg_sq", "step"} <= set(st)
        assert st["exp_avg"].shape == q.shape and st["step"].item() == 5
        assert torch.equal(st["exp_avg"], opt.state[q]["exp_avg"])
    assert "buffers" not in sd["lbcomm"] and sd["lbcomm"]["version"] == 2
    # what tools do with torch optimizers: read the moments per parameter
    assert opt.state[params[0]]["exp_avg_sq"].data_ptr() != 0


def test_global_options_come_back_from_the_state_dict():
    """freeze_step lives in the param groups: a checkpoint's value wins over the constructor's."""
    model = _mlp()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=4)
    _train(model, opt, 2)
    clone = copy.deepcopy(model)
    opt2 = lbcomm.OneBitAdam(clone.parameters(), lr=1e-2, freeze_step=1000)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(clone, opt2, 2, start=2)
    assert opt2.frozen and opt2.global_step == 4


def test_backend_is_validated():
    with pytest.raises(ValueError, match="Invalid backend"):
        lbcomm.OneBitAdam(_mlp().parameters(), comm=lbcomm.CommConfig(backend="nccl"))


@pytest.mark.parametrize("fraction, kind", [(0.001, torch.int64), (0.5, torch.bool)])
def test_mask_is_an_index_list_when_few_coordinates_are_masked(fraction, kind):
    model = _mlp()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    w = model[3].weight
    keep = torch.rand(w.shape, generator=torch.Generator().manual_seed(1)) >= fraction
    keep.view(-1)[0] = False
    opt.set_momentum_mask(w, keep)
    _train(model, opt, 3)
    assert opt.masked_coordinates == int((~keep).sum())
    assert opt.state_dict()["lbcomm"]["mask"].dtype == kind


def test_finite_gradients_whose_sum_overflows_are_not_skipped():
    """The pre-check's per-parameter sum overflows to inf; the exact count then says finite."""
    model = _mlp()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm=lbcomm.CommConfig(nonfinite="raise"))
    _train(model, opt, 2)
    opt.zero_grad()
    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    model[0].weight.grad[0, :2] = 3e38  # finite, but their sum is not
    opt.step()
    assert not opt.last_step_skipped and opt.global_step == 3
    model[0].weight.grad[0, 0] = float("inf")
    with pytest.raises(lbcomm.NonFiniteError, match="local gradients"):
        opt.step()
    assert opt.global_step == 3 and all(torch.isfinite(q).all() for q in model.parameters())
