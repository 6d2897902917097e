"""Shared by the ZeroOneAdam tests (test_zeroone.py, test_zeroone_options.py): the small
model and its deterministic data, the schedule and the runs compared to the simulation in
lbcomm.testing.zeroone, and snapshots. Not a test module: importing it collects nothing."""
import copy

import torch
import torch.nn.functional as F
from torch import nn

import lbcomm
from optim_util import make_opt


def _mlp(seed=0, d_in=12, d_h=24, d_out=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, d_h), nn.LayerNorm(d_h), nn.Tanh(), nn.Linear(d_h, d_h), nn.Tanh(),
                         nn.Linear(d_h, d_out))


def _loss(model, rank, step, n=32, d_in=12, d_out=5, dead_inputs=False):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, d_in, generator=g)
    if dead_inputs:  # features 10, 11 always zero: their first-layer weights never see a gradient (masked)
        x[:, 10:] = 0.0
    y = (x[:, :d_out] + 0.3 * torch.randn(n, d_out, generator=g)).argmax(1)
    return F.cross_entropy(model(x), y)


def _quantize(g):
    """Gradients on a 2^-16 grid: their sum over ranks is exact in any order."""
    return (g * 65536).round_() / 65536


def _backward(model, opt, rank, t, dead_inputs=False):
    opt.zero_grad()
    _loss(model, rank, t, dead_inputs=dead_inputs).backward()
    for q in model.parameters():
        q.grad.copy_(_quantize(q.grad))


def _params(model):
    return [q.detach().clone() for q in model.parameters()]


def _snapshot(model, opt):
    """Parameters and everything in the optimizer's state dict (compression errors too)
    but the counters of skipped steps and of traffic (a skipped step has communicated; a
    resumed compression state checks its layout once more)."""
    sd = copy.deepcopy(opt.state_dict())
    del sd["lbcomm"]["zero_one"]["bytes_sent"], sd["lbcomm"]["zero_one"]["rounds"], sd["lbcomm"]["skipped_steps"]
    return {"params": _params(model), "sd": sd}


# schedule of these runs (var_freeze_step 8, var_update_scaler 2, local_step_scaler 2,
# local_step_clipper 4): variance steps 1 2 4 6; 1-bit steps 3 5 7 8; local stage from
# step 9: syncs at 9 10 12 14 18 22 26 30, local steps in between
SCHED = dict(var_freeze_step=8, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
SYNCS = [9, 10, 12, 14, 18, 22, 26, 30]
# exact_numel=0 (every parameter compressed; the default, 4096, averages this whole model
# exactly) except in "exact". rescale_variance off except in "rescale": the four ranks'
# squared gradient norms are summed in gloo's order, not the simulation's, so that run is
# compared to fp32 rounding (two ranks, bitwise: test_two_ranks_rescale_variance_...)
RUNS = {
    "default": dict(steps=28, groups=False, sched=False,
                    kw=dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, block_size=64, exact_numel=0,
                            rescale_variance=False)),
    # the published formulas, an lr schedule and two param groups with their own lr and wd
    "published_groups_scheduler": dict(steps=24, groups=True, sched=True,
                                       kw=dict(lr=1e-2, weight_decay=0.0, block_size=None, bias_correction=False,
                                               max_update=None, var_decay="update", exact_numel=0,
                                               rescale_variance=False)),
    "auto_bound_masked": dict(steps=16, groups=False, sched=False, dead_inputs=True,
                       kw=dict(lr=2e-2, weight_decay=0.05, block_size=64, max_update="auto", exact_numel=0,
                               rescale_variance=False)),
    # the biases, the LayerNorm and the 24 x 5 head (<= 200 elements) averaged exactly, the
    # 24 x 12 and 24 x 24 matrices compressed. A sync averages the exact coordinates' inputs
    # with an allreduce whose four-rank sum runs in gloo's order, not the simulation's: this
    # run is compared to fp32 rounding (test_exact_numel_matches_the_simulation)
    "exact": dict(steps=28, groups=False, sched=False,
                  kw=dict(lr=1e-2, weight_decay=0.01, block_size=64, exact_numel=200, rescale_variance=False)),
    "rescale": dict(steps=28, groups=False, sched=False,
                    kw=dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, block_size=64, exact_numel=0)),
}


def _lr_factor(t):  # LambdaLR: the factor of the step after t scheduler steps
    return 1.0 / (1 + 0.05 * t)


def _make(model, cfg):
    if cfg["groups"]:
        ps = list(model.parameters())
        params = [{"params": ps[:4]}, {"params": ps[4:], "lr": 5e-3, "weight_decay": 0.1}]
    else:
        params = model.parameters()
    opt = make_opt(lbcomm.ZeroOneAdam, params, **SCHED, **cfg["kw"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor) if cfg["sched"] else None
    return opt, sched

