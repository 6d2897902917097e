"""OneBitAdam and OneBitLamb state dicts: exact round trips in process, before the first step,
every hyperparameter, the rank-local buffers, the warmup bound, and older checkpoints."""
import copy
import inspect
import logging
import math

import pytest
import torch
from torch import nn

import lbcomm
from lbcomm.config import COMM_FIELDS
from dist_util import same as _same
from optim_util import OPTS, _max_diff, _mlp, _snapshot, _train


def test_state_dict_round_trip_is_exact_in_process():
    for name in ("adam", "lamb"):
        model = _mlp()
        opt = OPTS[name](model.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=5)
        _train(model, opt, 8)
        sd = copy.deepcopy(opt.state_dict())
        clone = copy.deepcopy(model)
        opt2 = OPTS[name](clone.parameters(), lr=1.0, weight_decay=0.5, freeze_step=5)
        opt2.load_state_dict(sd)
        assert opt2.frozen and opt2.global_step == 8 and opt2.param_groups[0]["lr"] == 1e-2
        assert torch.equal(opt2.state[clone[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
        _train(model, opt, 6, start=8)
        _train(clone, opt2, 6, start=8)
        assert _max_diff(model, clone) == 0.0
        assert _same(_snapshot(model, opt)["buffers"], _snapshot(clone, opt2)["buffers"])
    with pytest.raises(ValueError, match="not saved by an lbcomm optimizer"):
        opt2.load_state_dict(torch.optim.AdamW(clone.parameters()).state_dict())


def test_onebit_lamb_checkpoint_without_the_local_momentum(caplog):
    """A checkpoint saved before OneBitLamb kept each rank's own momentum (no
    exp_avg_local) loads with it started from the reduced momentum, and says so."""
    model = _mlp()
    opt = lbcomm.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=3)
    _train(model, opt, 5)
    sd = copy.deepcopy(opt.state_dict())
    assert all("exp_avg_local" in st for st in sd["state"].values())
    for st in sd["state"].values():
        del st["exp_avg_local"]
    clone = copy.deepcopy(model)
    opt2 = lbcomm.OneBitLamb(clone.parameters(), lr=1e-2, freeze_step=3)
    with caplog.at_level(logging.WARNING, logger="lbcomm"):
        opt2.load_state_dict(sd)
    assert any("no exp_avg_local" in r.getMessage() for r in caplog.records)
    for q in clone.parameters():
        assert torch.equal(opt2.state[q]["exp_avg_local"], opt2.state[q]["exp_avg"].bfloat16())
    _train(clone, opt2, 2, start=5)


def test_rank_local_buffers_round_trip(caplog):
    """What a framework callback saves per rank beside rank 0's optimizer state: OneBitLamb's
    exp_avg_local after the freeze (nothing before, nothing for OneBitAdam); restored as
    saved, as the mean of every saved rank's (another world size), or started from the
    momentum with a warning when the checkpoint has none."""
    model = _mlp()
    opt = lbcomm.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=3)
    _train(model, opt, 2)
    assert opt.rank_local_buffers() == {}
    _train(model, opt, 3, start=2)
    local = opt.rank_local_buffers()["exp_avg_local"]
    assert local.numel() == sum(q.numel() for q in model.parameters())
    assert local.dtype == torch.bfloat16  # a statistic's input: 2 bytes per parameter
    assert lbcomm.OneBitAdam(model.parameters()).rank_local_buffers() == {}
    a, b = local.clone() + 1, local.clone() - 3
    opt.load_rank_local_buffers({"exp_avg_local": a})
    assert torch.equal(local, a)
    opt.load_rank_local_buffers({"exp_avg_local": a}, all_ranks=[{"exp_avg_local": a}, {"exp_avg_local": b}])
    assert torch.equal(local, ((a.float() + b.float()) / 2).bfloat16())  # averaged in fp32, rounded once
    with caplog.at_level(logging.WARNING, logger="lbcomm"):
        opt.load_rank_local_buffers(None)
    assert torch.equal(local, opt._flat["exp_avg"].bfloat16()) and any("rank-local" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="another model or layout"):
        opt.load_rank_local_buffers({"exp_avg_local": torch.zeros(3)})


def test_state_dict_before_the_first_step_and_add_param_group():
    model = _mlp()
    opt = lbcomm.OneBitAdam(list(model.parameters())[:2], lr=1e-2, freeze_step=10)
    sd = opt.state_dict()
    assert sd["lbcomm"]["layout"] is None
    opt.load_state_dict(sd)
    _train(model, opt, 3)
    opt.add_param_group({"params": list(model.parameters())[2:], "lr": 1e-3})
    _train(model, opt, 3, start=3)
    assert opt.state[model[5].weight]["step"].item() == 3 and opt.state[model[0].weight]["step"].item() == 6
    _train(model, opt, 5, start=6)
    assert opt.frozen
    with pytest.raises(RuntimeError, match="after the freeze"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})


def test_every_hyperparameter_round_trips_through_the_state_dict():
    """Hyperparameters live in the param groups (as in torch); communication settings in
    the optimizer's CommConfig, not in the state dict."""
    opt = lbcomm.OneBitLamb(_mlp().parameters(), freeze_step=7, coeff_range=(0.1, 5.0), factor_range=(0.25, 2.0),
                            comm=lbcomm.CommConfig(block_size=None, nonfinite="raise"))
    group = opt.state_dict()["param_groups"][0]
    for key in ("lr", "betas", "eps", "weight_decay", "freeze_step", "coeff_range", "trust_ratio", "coeff_beta",
                "factor_range", "factor_threshold", "bias_correction"):
        assert key in group, key
    assert group["coeff_range"] == (0.1, 5.0) and group["factor_range"] == (0.25, 2.0)
    assert not COMM_FIELDS & set(group)
    assert opt.comm.block_size is None and opt.comm.nonfinite == "raise"
    for cls, n in ((lbcomm.OneBitAdam, 8), (lbcomm.OneBitLamb, 12), (lbcomm.ZeroOneAdam, 12), (lbcomm.Lamb, 8),
                   (lbcomm.Lars, 9)):  # params, comm and options included
        assert len(inspect.signature(cls).parameters) == n, cls


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_warmup_bound_is_recorded_at_the_freeze_and_checkpointed(name):
    """max_update="warmup": U_p = max |m^ / (sqrt(v^) + eps)| of each tensor after the last
    warmup step, kept per parameter; a resumed optimizer continues bitwise with it."""
    b1, b2, eps, freeze = 0.9, 0.999, 1e-8, 3
    kw = dict(lr=1e-2, betas=(b1, b2), eps=eps, freeze_step=freeze, options=lbcomm.OneBitOptions(max_update="warmup"))
    model = _mlp()
    opt = OPTS[name](model.parameters(), **kw)
    _train(model, opt, freeze - 1)
    assert all(float(opt.state[q]["max_update_bound"]) == -1.0 for q in model.parameters())  # not recorded yet
    _train(model, opt, 1, start=freeze - 1)
    assert opt.frozen
    for q in model.parameters():
        st = opt.state[q]
        d = (st["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** freeze)).add_(eps)
        expected = ((st["exp_avg"] / (1 - b1 ** freeze)) / d).abs().max()
        assert torch.equal(st["max_update_bound"], expected)
        assert 0 < float(expected) < 7.3  # below Adam's largest possible |m^ / sqrt(v^)| at these betas
    sd = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    twin_opt = OPTS[name](twin.parameters(), **kw)
    twin_opt.load_state_dict(sd)
    _train(model, opt, 4, start=freeze)
    _train(twin, twin_opt, 4, start=freeze)
    assert _max_diff(model, twin) == 0.0
    for q, t in zip(model.parameters(), twin.parameters()):
        assert torch.equal(opt.state[q]["max_update_bound"], twin_opt.state[t]["max_update_bound"])


def test_onebit_lamb_trust_ratio_is_validated_and_old_checkpoints_keep_the_frozen_rule():
    with pytest.raises(ValueError, match="trust_ratio"):
        lbcomm.OneBitLamb(_mlp().parameters(), trust_ratio="average")
    model, twin = _mlp(), _mlp()
    opt = lbcomm.OneBitLamb(model.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=3, trust_ratio="frozen")
    _train(model, opt, 5)
    sd = copy.deepcopy(opt.state_dict())
    for group in sd["param_groups"]:  # saved before the option existed
        del group["trust_ratio"]
    twin.load_state_dict(model.state_dict())
    twin_opt = lbcomm.OneBitLamb(twin.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=3)
    twin_opt.load_state_dict(sd)
    _train(model, opt, 4, start=5)
    _train(twin, twin_opt, 4, start=5)
    assert _max_diff(model, twin) == 0.0
