"""freeze_step="auto": the 1-bit optimizers freeze the variance once it has settled.

The decision is checked against an independent reference of the criterion (AdamW's
variance on the averaged gradients, its bias-corrected square root compared every WINDOW
steps), the run against the simulation with the decided step as a fixed freeze_step
(bitwise), on real gloo ranks; a resume in the middle of the warmup decides at the same
step; and a run that ends or is checkpointed before it ever compressed says so."""
import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import lbcomm
from dist_util import run_ranks, same as _same
from lbcomm.errors import NotCompressedWarning
from lbcomm.optim import freeze as AF
from lbcomm.testing import optim as SIM
from optim_util import _loss, _mlp, _quantize

STEPS = 150
KW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, comm=lbcomm.CommConfig(exact_numel=0, block_size=64))
# OneBitAdam as the simulation runs it (rescale_variance=False)
OWN = {"OneBitAdam": dict(options=lbcomm.OneBitOptions(rescale_variance=False)), "OneBitLamb": {}}


def _reference_freeze(params0, grads, betas=(0.9, 0.999)):
    """The criterion, written out: AdamW's variance on the mean gradients (every coordinate:
    this model has fewer than SAMPLE), sqrt(v^) compared every WINDOW steps; the first check
    from MIN_STEP on whose relative change is at most TOL (the lr is constant here)."""
    b2 = betas[1]
    v = [torch.zeros_like(p, dtype=torch.float64) for p in params0]
    prev, prev_step = None, 0
    for t, per_rank in enumerate(grads, start=1):
        mean = [sum(g[i].double() for g in per_rank) / len(per_rank) for i in range(len(params0))]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, mean)]
        if t - prev_step < AF.WINDOW:
            continue
        d = torch.cat([(vi / (1 - b2 ** t)).sqrt().reshape(-1) for vi in v])
        if prev is not None:
            change = float((d - prev).abs().sum() / prev.sum()) * AF.WINDOW / (t - prev_step)
            if t >= AF.MIN_STEP and change <= AF.TOL:
                return t, change
        prev, prev_step = d, t
    return None, None


def _run(rank, p, cls_name, steps, save_at=None, load=None):
    """Train with quantized local grads (their mean is exact in any order); returns grads,
    params, the decided step, and the state dict at `save_at`."""
    cls = getattr(lbcomm, cls_name)
    model = _mlp(seed=1)
    params0 = [q.detach().clone() for q in model.parameters()]
    opt = cls(model.parameters(), freeze_step="auto", **KW, **OWN[cls_name])
    start = 0
    if load is not None:
        model.load_state_dict(load["model"][rank])
        opt.load_state_dict(load["opt"][rank])
        start = load["step"]
    grads, params, saved = [], [], None
    for t in range(start, steps):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        for q in model.parameters():
            q.grad.copy_(_quantize(q.grad))
        grads.append([q.grad.clone() for q in model.parameters()])
        opt.step()
        params.append([q.detach().clone() for q in model.parameters()])
        if save_at is not None and t + 1 == save_at:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": copy.deepcopy(opt.state_dict())}
    return {"params0": params0, "grads": grads, "params": params, "decided": opt.frozen_after,
            "frozen": opt.frozen, "saved": saved, "status": opt.compression_stats()["status"]}


def _suite(rank, p):
    out = {name: _run(rank, p, name, STEPS, save_at=25) for name in ("OneBitAdam", "OneBitLamb")}
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_suite, 2, timeout=240)


@pytest.mark.parametrize("name", ["OneBitAdam", "OneBitLamb"])
def test_auto_freeze_decides_as_the_reference_on_every_rank(two_ranks, name):
    recs = [r[name] for r in two_ranks]
    grads = [[recs[r]["grads"][t] for r in range(2)] for t in range(STEPS)]
    want, change = _reference_freeze(recs[0]["params0"], grads)
    assert want is not None and want < STEPS, "the reference never settled: the test's run is too short"
    assert all(r["decided"] == want for r in recs), ([r["decided"] for r in recs], want, change)
    assert all(r["status"] == "compressing" for r in recs)


def test_auto_freeze_run_equals_the_simulation_with_that_fixed_step(two_ranks):
    recs = [r["OneBitAdam"] for r in two_ranks]
    grads = [[recs[r]["grads"][t] for r in range(2)] for t in range(STEPS)]
    kw = {k: v for k, v in KW.items() if k != "comm"}
    history = SIM.simulate_onebit_adam(recs[0]["params0"], grads, freeze_step=recs[0]["decided"], exact_numel=0,
                                       block_size=64, rescale_variance=False, **kw)
    for t in range(STEPS):
        assert _same(recs[1]["params"][t], recs[0]["params"][t]), f"the ranks differ at step {t + 1}"
        worst = max((a - b).abs().max().item() for a, b in zip(history[t], recs[0]["params"][t]))
        assert worst == 0.0, f"step {t + 1}: max |optimizer - simulation| = {worst}"


def _resume(rank, p, saved):
    return _run(rank, p, "OneBitAdam", STEPS, load={**saved, "step": 25})


def test_a_resume_mid_warmup_freezes_at_the_same_step_bitwise(two_ranks):
    recs = [r["OneBitAdam"] for r in two_ranks]
    assert recs[0]["decided"] > 25  # the checkpoint is from before the decision
    saved = {"model": [r["saved"]["model"] for r in recs], "opt": [r["saved"]["opt"] for r in recs]}
    resumed = run_ranks(_resume, 2, saved, timeout=240)
    for r in range(2):
        assert resumed[r]["decided"] == recs[r]["decided"]
        for t in range(25, STEPS):
            assert _same(resumed[r]["params"][t - 25], recs[r]["params"][t]), f"rank {r} differs at step {t + 1}"


def _zeroone(rank, p):
    model = _mlp(seed=1)
    opt = lbcomm.ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step="auto", var_update_scaler=4,
                             comm=lbcomm.CommConfig(block_size=64))
    for t in range(STEPS):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
    return opt.local_steps_started, opt.frozen_after, [q.detach().clone() for q in model.parameters()]


def test_zeroone_var_freeze_step_auto_starts_the_local_steps_on_every_rank():
    (started0, at0, p0), (started1, at1, p1) = run_ranks(_zeroone, 2, timeout=240)
    assert started0 and started1 and at0 == at1 and AF.MIN_STEP <= at0 < STEPS
    assert _same(p0, p1)


def _before_freeze(rank, p):
    model = _mlp(seed=1)
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=1000)
    for t in range(3):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sent = opt.bytes_per_step()
        opt.state_dict()
        opt.state_dict()  # said once
    return sent, opt.compression_stats()["status"], [(w.category, str(w.message)) for w in caught]


def test_before_the_freeze_bytes_stats_and_checkpoints_say_why_nothing_is_compressed():
    sent, status, caught = run_ranks(_before_freeze, 2)[0]
    assert sent is None
    assert status == "warmup: step 3 of freeze_step=1000; full-precision averaging until then"
    assert all(c is NotCompressedWarning for c, _ in caught), caught
    msgs = [m for _, m in caught]
    assert len(msgs) == 2, msgs
    assert msgs[0] == ("OneBitAdam.bytes_per_step() is None: nothing is compressed yet (warmup: step 3 of "
                       "freeze_step=1000; full-precision averaging until then)")
    assert msgs[1].startswith("OneBitAdam: a checkpoint was saved after 3 steps without ever compressing")
    assert msgs[1].endswith("If the run is shorter than freeze_step, set it below the run's length, or to 'auto'")


SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, lbcomm
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    torch.manual_seed(1 + dist.get_rank())  # each rank its own batches
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    dist.destroy_process_group()
""")


def test_a_run_that_ends_before_the_freeze_says_so(tmp_path):
    script = tmp_path / "short.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("NotCompressedWarning: OneBitAdam: the run ended after 3 steps without ever "
                            "compressing (warmup: step 3 of freeze_step=100") == 2, res.stderr


@pytest.mark.parametrize("bad", ["Auto", 0, True, 2.5])
def test_bad_freeze_steps_are_refused(bad):
    with pytest.raises(ValueError, match="freeze_step"):
        lbcomm.OneBitAdam(_mlp().parameters(), freeze_step=bad)
    with pytest.raises(ValueError, match="var_freeze_step"):
        lbcomm.ZeroOneAdam(_mlp().parameters(), var_freeze_step=bad)


def test_one_rank_freezes_by_the_same_rule():
    model = _mlp(seed=1)
    opt = lbcomm.OneBitLamb(model.parameters(), lr=1e-2, freeze_step="auto")
    for t in range(STEPS):
        opt.zero_grad()
        _loss(model, 0, t).backward()
        opt.step()
    assert opt.frozen and AF.MIN_STEP <= opt.frozen_after <= STEPS
    assert opt.compression_stats()["status"].startswith("one rank: nothing to communicate")
