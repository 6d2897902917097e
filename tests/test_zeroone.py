"""ZeroOneAdam (0/1 Adam) against the plain-torch simulation in lbcomm.testing.zeroone,
step by step on 4 real gloo ranks.

The multi-rank checks run in ONE spawn of four processes (`four_ranks`, module scope);
every test below reads its part of the result. The one-process and two-rank checks (the
options, the first step's formula, resume, low precision, rescale_variance's two paths) are
in test_zeroone_options.py."""
import copy
import io

import pytest
import torch
import torch.distributed as dist

import lbcomm
from lbcomm.testing.zeroone import simulate_zero_one_adam
from dist_util import run_ranks, same as _same
from zeroone_util import RUNS, SCHED, SYNCS, _backward, _loss, _lr_factor, _make, _mlp, _params, _snapshot


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
