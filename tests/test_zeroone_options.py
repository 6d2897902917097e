"""ZeroOneAdam as a drop-in torch optimizer: the first step's formula on one rank, the state
dict and option checks, var_decay, low-precision parameters, and rescale_variance's
optimizer and hook paths on two ranks against the simulation in lbcomm.testing.zeroone."""
import copy

import pytest
import torch
import torch.distributed as dist

import lbcomm
from lbcomm.testing.zeroone import simulate_zero_one_adam
from dist_util import run_ranks, same as _same
from optim_util import make_opt
from zeroone_util import RUNS, SCHED, _backward, _loss, _mlp, _params


def test_one_rank_first_step_is_the_plain_formula():
    model = _mlp(seed=3)
    w0 = _params(model)
    opt = lbcomm.ZeroOneAdam(model.parameters(), lr=1e-2, weight_decay=0.1, var_freeze_step=5)
    opt.zero_grad()
    _loss(model, 0, 0).backward()
    g = [q.grad.clone() for q in model.parameters()]
    opt.step()
    for w, gi, q in zip(w0, g, model.parameters()):
        m, v = 0.1 * gi, 0.001 * gi * gi
        expect = w * (1 - 1e-2 * 0.1) - 1e-2 * (m / 0.1) / ((v / 0.001).sqrt() + 1e-8)
        torch.testing.assert_close(q.detach(), expect, rtol=1e-5, atol=1e-7)
    assert opt.comm_stats()["bytes_sent"] == 0 and opt.frozen and not opt.local_steps_started


def test_state_dict_before_the_first_step_and_validation():
    model = _mlp()
    opt = lbcomm.ZeroOneAdam(model.parameters(), var_freeze_step=3, var_update_scaler=1, local_step_scaler=1)
    # never the hierarchical reduction: "auto" is flat (also under multi-node torchrun), and a
    # Topology of several nodes is refused
    assert opt._onebit.flat_only
    nodes = object.__new__(lbcomm.Topology)
    nodes.nodes, nodes.local_size, nodes.node, nodes.local_rank, nodes.intra_node = 2, 2, 0, 0, "group"
    with pytest.raises(ValueError, match="flat compressed reduction only"):
        lbcomm.ZeroOneAdam(model.parameters(), comm=lbcomm.CommConfig(topology=nodes))
    sd = opt.state_dict()
    assert sd["lbcomm"]["layout"] is None
    opt.load_state_dict(sd)
    for t in range(8):
        _backward(model, opt, 0, t)
        opt.step()
    assert opt.local_steps_started and opt.sync_interval == 4  # syncs at 4 and 6, the next at 10
    with pytest.raises(ValueError, match="saved by OneBitAdam and is being loaded into ZeroOneAdam"):
        opt.load_state_dict(lbcomm.OneBitAdam(model.parameters(), freeze_step=2).state_dict())
    for kw, match in [(dict(var_freeze_step=0), "Invalid var_freeze_step"),
                      (dict(local_step_clipper=0), "Invalid local_step_clipper"),
                      (dict(var_update_scaler=1.5), "Invalid var_update_scaler"),
                      (dict(max_update="warmup"), "'warmup' is not supported"),
                      (dict(var_decay="steps"), "Invalid var_decay"),
                      (dict(block_size=100), "Invalid block_size"),
                      (dict(lr=-1.0), "Invalid learning rate")]:
        with pytest.raises(ValueError, match=match):
            make_opt(lbcomm.ZeroOneAdam, model.parameters(), **kw)


def test_var_decay_changes_the_run_and_resumes_bitwise():
    """var_decay="time" changes the run (variance steps 1 2 4 6 of SCHED: gaps of 2); the
    option round-trips through the state dict, and a resumed run continues bitwise."""
    def run(decay, load_from=None, steps=10, start=0):
        model = _mlp(seed=9)
        opt = lbcomm.ZeroOneAdam(model.parameters(), lr=1e-2, **SCHED, **({} if decay is None else
                                                                          {"var_decay": decay}))
        if load_from is not None:
            model.load_state_dict(load_from[0])
            opt.load_state_dict(load_from[1])
        for t in range(start, start + steps):
            _backward(model, opt, 0, t)
            opt.step()
        return model, opt

    update, time_ = run("update")[0], run("time")[0]
    assert not _same(_params(update), _params(time_))
    model, opt = run("update", steps=3)  # before the variance updates at steps 4 and 6
    sd = copy.deepcopy(opt.state_dict())
    assert all(g["var_decay"] == "update" for g in sd["param_groups"])
    resumed = run(None, load_from=(copy.deepcopy(model.state_dict()), sd), steps=7, start=3)[0]
    assert _same(_params(resumed), _params(update))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_state_through_the_local_stage(dtype):
    model = _mlp(seed=4).to(dtype)
    opt = lbcomm.ZeroOneAdam(model.parameters(), lr=1e-2, **SCHED)
    for t in range(14):
        opt.zero_grad()
        x = torch.randn(16, 12, dtype=dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
    st = opt.state[model[0].weight]
    assert opt.local_steps_started and st["anchor"].dtype == torch.float32 and st["exp_avg"].dtype == torch.float32
    assert torch.equal(st["anchor"].to(dtype), model[0].weight.detach())  # after the sync at step 14
    assert all(torch.isfinite(q.float()).all() for q in model.parameters())


def _two_ranks_rescale(rank, p):
    """The run with rescale_variance through the optimizer's own averaging and through
    lbcomm's warmup hook (which averages the first step, after handing over the local
    gradients), recording the local gradients."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw = dict(RUNS["rescale"]["kw"])
    out = {}
    for how in ("optimizer", "hook"):
        model = _mlp(seed=3)
        p0 = _params(model)
        opt = make_opt(lbcomm.ZeroOneAdam, model.parameters(), **SCHED, **kw)
        net = model
        if how == "hook":
            net = DDP(model)
            net.register_comm_hook(lbcomm.ddp.WarmupAverage(opt), lbcomm.ddp.warmup_average_hook)
        hist, grads = [], []
        for t in range(20):
            opt.zero_grad()
            _loss(net, rank, t).backward()
            grads.append([q.grad.clone() for q in model.parameters()])
            opt.step()
            hist.append(_params(model))
        out[how] = dict(hist=hist, grads=grads, p0=p0, ref=opt._vectors["grad_sq_frozen"].clone(),
                        ema=opt._vectors["grad_sq"].clone())
    dist.barrier()
    return out


def test_two_ranks_rescale_variance_optimizer_and_hook_paths_match_the_simulation():
    """Two ranks: a sum of two ranks' norms has one result whatever the order, so both
    paths are bitwise the simulation's (the hook's first step averaged the gradients: the
    simulation gets the local ones the optimizer path recorded)."""
    res = run_ranks(_two_ranks_rescale, 2, timeout=240)
    steps = len(res[0]["optimizer"]["hist"])
    grads = [[res[r]["optimizer"]["grads"][t] for r in range(2)] for t in range(steps)]
    sim = simulate_zero_one_adam(res[0]["optimizer"]["p0"], grads, **SCHED, **RUNS["rescale"]["kw"])
    for how in ("optimizer", "hook"):
        assert bool((res[0][how]["ref"] > 0).all()), how  # tracked on both paths
        for t in range(steps):
            for r in range(2):
                assert _same(res[r][how]["hist"][t], sim[t][r]), f"{how}, rank {r}, step {t + 1}"
    assert torch.equal(res[0]["hook"]["ema"], res[0]["optimizer"]["ema"])
    plain = simulate_zero_one_adam(res[0]["optimizer"]["p0"], grads, **SCHED,
                                   **dict(RUNS["rescale"]["kw"], rescale_variance=False))
    assert max((a - b).abs().max().item() for a, b in zip(plain[-1][0], sim[-1][0])) > 1e-5


def test_rescale_variance_option_is_checked():
    with pytest.raises(ValueError, match="rescale_variance"):
        lbcomm.ZeroOneAdam(_mlp().parameters(), options=lbcomm.OneBitOptions(rescale_variance="yes"))


@pytest.mark.parametrize("cls", ["ZeroOneAdam", "OneBitAdam"])
def test_checkpoint_saved_before_rescale_variance_continues_unscaled(cls, caplog):
    """A state dict saved before the option existed (no rescale_variance in its groups, no
    statistics in its state) continues as it was trained, with a warning: bitwise the
    unscaled run."""
    def train(model, opt, start, stop):
        for t in range(start, stop):
            _backward(model, opt, 0, t)
            opt.step()

    make = (lambda params, **kw: lbcomm.ZeroOneAdam(params, lr=1e-2, **SCHED, **kw)) if cls == "ZeroOneAdam" else (
        lambda params, **kw: lbcomm.OneBitAdam(params, lr=1e-2, freeze_step=4, **kw))
    model = _mlp(seed=4)
    opt = make(model.parameters(), options=lbcomm.OneBitOptions(rescale_variance=False))
    train(model, opt, 0, 12)
    sd = copy.deepcopy(opt.state_dict())
    for group in sd["param_groups"]:
        del group["rescale_variance"]
    for st in sd["state"].values():
        del st["grad_sq"], st["grad_sq_frozen"]
    clone = copy.deepcopy(model)
    opt2 = make(clone.parameters())
    with caplog.at_level("WARNING", logger="lbcomm"):
        opt2.load_state_dict(sd)
    assert "predates rescale_variance" in caplog.text and opt2.param_groups[0]["rescale_variance"] is False
    train(model, opt, 12, 20)
    train(clone, opt2, 12, 20)
    assert _same(_params(model), _params(clone))
