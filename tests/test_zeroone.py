"""ZeroOneAdam (0/1 Adam) against the plain-torch simulation in lbcomm.testing.optim,
step by step on 4 real gloo ranks, and as a drop-in torch optimizer.

The multi-rank checks run in ONE spawn of four processes (`four_ranks`, module scope);
every test below reads its part of the result."""
import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lbcomm
from lbcomm.testing.zeroone import simulate_zero_one_adam
from dist_util import run_ranks, same as _same
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


def _record(rank, p, cfg):
    model = _mlp(seed=1)
    params0 = _params(model)
    opt, sched = _make(model, cfg)
    grads, params, kinds, stats = [], [], [], []
    for t in range(cfg["steps"]):
        _backward(model, opt, rank, t, cfg.get("dead_inputs", False))
        grads.append([q.grad.clone() for q in model.parameters()])
        opt.step()
        if sched is not None:
            sched.step()
        params.append(_params(model))
        kinds.append(opt._last_kind)
        stats.append(opt.comm_stats())
    call_bytes = opt.compression_state.bytes_per_call(checked=True)
    return {"call_bytes": call_bytes, "masked": opt.masked_coordinates, "params0": params0, "grads": grads,
            "params": params, "kinds": kinds, "stats": stats,
            "numel": sum(q.numel() for q in params0)}


def _resume(rank, p):
    """Save mid local-step interval, load into a fresh optimizer (through torch.save), and
    run both on; also a round trip of the state dict."""
    cfg = RUNS["rescale"]  # rescale_variance's statistics are checkpointed too
    model = _mlp(seed=5)
    opt, _ = _make(model, cfg)
    save_at = 15  # after step 15: the interval 14 -> 18 is half done
    for t in range(save_at):
        _backward(model, opt, rank, t)
        opt.step()
    s = opt._schedule
    mid = s["local"] and s["next_sync"] > opt.global_step + 1 and opt.global_step > SYNCS[3]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    clone = copy.deepcopy(model)
    # hyperparameters come from the state dict; the communication settings are the run's (block_size 64)
    opt2 = lbcomm.ZeroOneAdam(clone.parameters(), lr=1.0, var_freeze_step=1000, comm=opt.comm)
    opt2.load_state_dict(torch.load(buf, weights_only=False))
    round_trip = _same(opt2.state_dict(), opt.state_dict())
    diffs = []
    for t in range(save_at, save_at + 10):
        for mdl, o in ((model, opt), (clone, opt2)):
            _backward(mdl, o, rank, t)
            o.step()
        diffs.append(_same(_snapshot(model, opt), _snapshot(clone, opt2)))
    return {"mid": mid, "round_trip": round_trip, "same_after": diffs, "params": _params(model)}


def _nonfinite(rank, p, policy):
    """NaN on rank 1 at a variance step (2), Inf on rank 2 at a 1-bit step (5), NaN on rank 3
    at a local step (11), Inf on rank 0 at a sync step (14); each step is then retried with
    clean gradients."""
    model = _mlp(seed=2)
    opt = lbcomm.ZeroOneAdam(model.parameters(), lr=1e-2, comm=lbcomm.CommConfig(nonfinite=policy, block_size=64),
                             **SCHED)
    bad = {1: (1, "nan"), 4: (2, "inf"), 10: (3, "nan"), 13: (0, "inf")}  # steps taken so far -> rank, value
    out = {"raised": [], "skipped": [], "unchanged": [], "kinds": []}
    t = 0
    while opt.global_step < 14:  # ends right after the sync at step 14
        _backward(model, opt, rank, t)
        target = bad.pop(opt.global_step, None)
        if target is not None and target[0] == rank:
            next(model.parameters()).grad[0, 0] = float(target[1])
        before = _snapshot(model, opt)
        try:
            opt.step()
            out["raised"].append(False)
        except lbcomm.NonFiniteError:
            out["raised"].append(True)
        out["skipped"].append(opt.last_step_skipped)
        if opt.last_step_skipped:
            out["unchanged"].append(_same(before, _snapshot(model, opt)))
            out["kinds"].append(opt._last_kind)
        t += 1
    out["params"] = _params(model)
    out["skipped_steps"] = opt.skipped_steps
    return out


def _first_steps_vs_adamw(rank, p):
    """The first var_update_scaler steps are variance steps: AdamW on the averaged grads."""
    kw = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    model, ref = _mlp(seed=6), _mlp(seed=6)
    opt = lbcomm.ZeroOneAdam(model.parameters(), var_freeze_step=100, var_update_scaler=6, **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    diffs = []
    for t in range(6):
        for mdl, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _loss(mdl, rank, t).backward()
        for q in ref.parameters():
            dist.all_reduce(q.grad)
            q.grad.div_(p)
        opt.step()
        ref_opt.step()
        diffs.append(max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())))
    return {"diffs": diffs, "kinds_variance": opt.comm_stats()["variance_steps"]}


def _suite(rank, p):
    torch.manual_seed(0)
    return {
        "sim": {k: _record(rank, p, cfg) for k, cfg in RUNS.items()},
        "resume": _resume(rank, p),
        "nonfinite": {pol: _nonfinite(rank, p, pol) for pol in ("skip", "raise")},
        "adamw": _first_steps_vs_adamw(rank, p),
    }


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_suite, 4, timeout=240)


@pytest.mark.parametrize("run", [k for k in RUNS if k not in ("exact", "rescale")])
def test_four_ranks_match_the_simulation_bitwise(four_ranks, run):
    cfg = RUNS[run]
    recs = [r["sim"][run] for r in four_ranks]
    steps = cfg["steps"]
    grads = [[recs[r]["grads"][t] for r in range(4)] for t in range(steps)]
    kw = {k: v for k, v in cfg["kw"].items()}
    if cfg["groups"]:
        lrs, wds = [1e-2] * 4 + [5e-3] * 4, [0.0] * 4 + [0.1] * 4
        kw["lr"] = lambda step, i: lrs[i] * (_lr_factor(step - 1) if cfg["sched"] else 1.0)
        kw["weight_decay"] = wds
    history = simulate_zero_one_adam(recs[0]["params0"], grads, **SCHED, **kw)
    for t in range(steps):
        for r in range(4):
            worst = max((a - b).abs().max().item() for a, b in zip(history[t][r], recs[r]["params"][t]))
            assert worst == 0.0, f"rank {r}, step {t + 1} ({recs[r]['kinds'][t]}): max |optimizer - sim| = {worst}"
    kinds = recs[0]["kinds"]
    assert [t + 1 for t, k in enumerate(kinds) if k == "variance"] == [1, 2, 4, 6]
    assert [t + 1 for t, k in enumerate(kinds) if k == "onebit"] == [3, 5, 7, 8]
    assert [t + 1 for t, k in enumerate(kinds) if k == "sync"] == [s for s in SYNCS if s <= steps]
    for t in range(steps):  # replicas: identical after every step but local ones, which differ
        same = all(_same(recs[r]["params"][t], recs[0]["params"][t]) for r in range(1, 4))
        assert same == (kinds[t] != "local"), f"step {t + 1} ({kinds[t]}): replicas identical = {same}"
    if cfg.get("dead_inputs"):  # the zero-variance mask was in play
        assert recs[0]["masked"] == 24 * 2
    # the local stage really moved the parameters
    assert max((a - b).abs().max().item() for a, b in zip(recs[0]["params"][-1], recs[0]["params"][7])) > 1e-3


def test_exact_numel_matches_the_simulation(four_ranks):
    """exact_numel: the small parameters' momentum is the exact mean (the 1-bit steps' from
    the mean gradient, bitwise as the simulation's; a sync's from the mean of the ranks'
    inputs, to fp32 rounding), and the run ends away from the all-compressed one."""
    cfg = RUNS["exact"]
    recs = [r["sim"]["exact"] for r in four_ranks]
    steps = cfg["steps"]
    grads = [[recs[r]["grads"][t] for r in range(4)] for t in range(steps)]
    history = simulate_zero_one_adam(recs[0]["params0"], grads, **SCHED, **cfg["kw"])
    first_sync = SYNCS[0]
    for t in range(steps):
        for r in range(4):
            if t + 1 < first_sync:
                worst = max((a - b).abs().max().item() for a, b in zip(history[t][r], recs[r]["params"][t]))
                assert worst == 0.0, f"rank {r}, step {t + 1}: max |optimizer - sim| = {worst}"
            for a, b in zip(history[t][r], recs[r]["params"][t]):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    kinds = recs[0]["kinds"]
    for t in range(steps):  # replicas identical after every step but local ones
        same = all(_same(recs[r]["params"][t], recs[0]["params"][t]) for r in range(1, 4))
        assert same == (kinds[t] != "local"), f"step {t + 1} ({kinds[t]}): replicas identical = {same}"
    compressed = simulate_zero_one_adam(recs[0]["params0"], grads, **SCHED, **dict(cfg["kw"], exact_numel=0))
    assert max((a - b).abs().max().item() for a, b in zip(compressed[-1][0], recs[0]["params"][-1])) > 1e-6


def test_rescale_variance_matches_the_simulation(four_ranks):
    """rescale_variance (the default): every step but the variance steps scales v^ by the
    change of the ranks' mean squared gradient norm since the last variance step; to fp32
    rounding against the simulation (gloo's order of the four-rank sum), ranks identical."""
    cfg = RUNS["rescale"]
    recs = [r["sim"]["rescale"] for r in four_ranks]
    steps = cfg["steps"]
    grads = [[recs[r]["grads"][t] for r in range(4)] for t in range(steps)]
    history = simulate_zero_one_adam(recs[0]["params0"], grads, **SCHED, **cfg["kw"])
    for t in range(steps):
        for r in range(4):
            for a, b in zip(history[t][r], recs[r]["params"][t]):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    kinds = recs[0]["kinds"]
    for t in range(steps):
        same = all(_same(recs[r]["params"][t], recs[0]["params"][t]) for r in range(1, 4))
        assert same == (kinds[t] != "local"), f"step {t + 1} ({kinds[t]}): replicas identical = {same}"
    # the variance steps 1 and 2 are the pinned run's bit for bit; the rescale moves the rest
    pinned = four_ranks[0]["sim"]["default"]["params"]
    assert _same(recs[0]["params"][1], pinned[1])
    assert max((a - b).abs().max().item() for a, b in zip(recs[0]["params"][-1], pinned[-1])) > 1e-5
    # the statistic rides in every step's one collective: a local step's agreement carries
    # one fp32 per parameter more (8 parameters), still one round
    p, n_params = 4, len(recs[0]["params0"])
    ring = lambda nbytes: int(round(2 * (p - 1) / p * nbytes))  # noqa: E731
    prev = 0
    for kind, st in zip(kinds, recs[0]["stats"]):
        if kind == "local":
            assert st["bytes_sent"] - prev == ring(4 * (1 + n_params))
        prev = st["bytes_sent"]


def test_comm_stats_count_what_each_kind_of_step_sends(four_ranks):
    rec = four_ranks[0]["sim"]["default"]
    n, p = rec["numel"], 4
    prev = {"bytes_sent": 0, "rounds": 0}
    per_kind = {}
    for kind, st in zip(rec["kinds"], rec["stats"]):
        per_kind.setdefault(kind, []).append((st["bytes_sent"] - prev["bytes_sent"], st["rounds"] - prev["rounds"]))
        prev = st
    ring = lambda nbytes: int(round(2 * (p - 1) / p * nbytes))  # noqa: E731
    # local steps: the 4-byte finiteness agreement only
    assert set(per_kind["local"]) == {(ring(4), 1)}
    # syncs: the agreement, one all-to-all and one all-gather of ~n/8 bytes (+ block scales)
    assert len(set(per_kind["sync"])) == 1
    sync_bytes, sync_rounds = per_kind["sync"][0]
    assert sync_rounds == 3 and sync_bytes == rec["call_bytes"] + ring(4) and sync_bytes > 1.5 * n / 8
    # 1-bit steps cost the same, but the first (a layout handshake, the averaged-grads probe)
    assert per_kind["onebit"][1:] == [(sync_bytes, 3)] * 3 and per_kind["onebit"][0][0] > sync_bytes
    # variance steps: the fp32 gradient allreduce (+ 8 has-grad flags; the first also
    # carries the averaged-grads probe, 2 floats per rank, and is followed by the check that
    # every rank holds the same parameters, 2 floats per rank in an allreduce of its own)
    assert per_kind["variance"][1:] == [(ring(4 * (n + 8)), 1)] * 3
    assert per_kind["variance"][0] == (ring(4 * (n + 8 + 2 * p)) + ring(4 * 2 * p), 2)
    last = rec["stats"][-1]
    assert (last["variance_steps"], last["onebit_steps"], last["sync_steps"], last["local_steps"]) == (4, 4, 7, 13)


def test_first_steps_are_adamw_on_the_averaged_gradients(four_ranks):
    for res in four_ranks:
        assert res["adamw"]["kinds_variance"] == 6
        assert max(res["adamw"]["diffs"]) <= 1e-6, res["adamw"]["diffs"]


def test_resume_mid_interval_is_bitwise_exact(four_ranks):
    for res in four_ranks:
        r = res["resume"]
        assert r["mid"], "the checkpoint was not taken inside a local-step interval"
        assert r["round_trip"]
        assert all(r["same_after"]), r["same_after"]


def test_nonfinite_steps_are_skipped_on_every_rank(four_ranks):
    for pol in ("skip", "raise"):
        res = [r["nonfinite"][pol] for r in four_ranks]
        for r in res:
            assert r["skipped"] == res[0]["skipped"] and sum(r["skipped"]) == 4 and r["skipped_steps"] == 4
            assert r["raised"] == (r["skipped"] if pol == "raise" else [False] * len(r["skipped"]))
            assert all(r["unchanged"]), r["unchanged"]
            assert r["kinds"] == ["variance", "onebit", "local", "sync"]
            assert _same(r["params"], res[0]["params"])  # replicas identical after the sync
            assert all(torch.isfinite(q).all() for q in r["params"])


# ---------------------------------------------------------------------- one process
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
