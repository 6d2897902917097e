"""OneBitAdam, Lamb and OneBitLamb against torch.optim.AdamW, against the
plain-torch simulation in lbcomm.optim.reference, and as drop-in torch optimizers.

The multi-rank checks run in ONE spawn of four real gloo processes (`four_ranks`, module
scope); every test below reads its part of the result."""
import copy
import dataclasses
import inspect
import logging
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lbcomm
from lbcomm.common import ring_allreduce_bytes
from lbcomm.optim import reference as SIM
from dist_util import run_ranks, same as _same

OPTS = {"adam": lbcomm.OneBitAdam, "lamb": lbcomm.OneBitLamb}
COMM_FIELDS = {f.name for f in dataclasses.fields(lbcomm.CommConfig)}


def make_opt(cls, params, **kw):
    """An optimizer from one flat dict of options, the form the simulations in
    lbcomm.optim.reference take: the CommConfig fields go into ``comm``, the options a
    param group sets into the one group."""
    comm = {k: kw.pop(k) for k in list(kw) if k in COMM_FIELDS}
    group = {k: kw.pop(k) for k in list(kw) if k in cls.GROUP_OPTIONS}
    if group:
        params = [{"params": list(params), **group}]
    return cls(params, comm=lbcomm.CommConfig(**comm), **kw)


# ---------------------------------------------------------------------- models and data
def _mlp(seed=0, d_in=12, d_h=24, d_out=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, d_h), nn.LayerNorm(d_h), nn.Tanh(), nn.Linear(d_h, d_h), nn.Tanh(),
                         nn.Linear(d_h, d_out))


def _batch(rank, step, n=32, d_in=12, d_out=5):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, d_in, generator=g)
    y = (x[:, :d_out] + 0.3 * torch.randn(n, d_out, generator=g)).argmax(1)
    return x, y


def _loss(model, rank, step):
    x, y = _batch(rank, step)
    return F.cross_entropy(model(x), y)


def _quantize(g):
    """Gradients on a 2^-16 grid: their sum over ranks is exact in any order, so the
    warmup mean does not depend on gloo's summation order."""
    return (g * 65536).round_() / 65536


class _SparseNet(nn.Module):
    """Coordinates that never see a gradient: embedding rows >= 25 are never looked up,
    and input features 0 and 1 are always zero. And one that sees only rounding noise:
    `shift` is added to every logit, to which softmax is invariant (like an attention key
    bias); its gradient is ~1e-8, its variance ~1e-14 of the others."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(40, 6)
        self.lin = nn.Linear(6 + 4, 3)
        self.shift = nn.Parameter(torch.zeros(1))

    def forward(self, ids, feats):
        return self.lin(torch.cat([self.emb(ids), feats], dim=1)) + self.shift


def _sparse_batch(rank, step, n=32):
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    ids = torch.randint(0, 25, (n,), generator=g)
    feats = torch.randn(n, 4, generator=g)
    feats[:, :2] = 0.0
    return ids, feats, torch.randint(0, 3, (n,), generator=g)


def _flat_state(sd):
    """The per-parameter state of an optimizer state dict, in the saved layout's order:
    tensors concatenated per name ("buffers"), fp32 scalars stacked per name ("vectors")."""
    state, layout = sd["state"], sd["lbcomm"]["layout"] or []
    names = list(state[layout[0]]) if layout else []
    cat = {n: [state[k][n] for k in layout] for n in names}
    return {"buffers": {n: torch.cat([t.reshape(-1) for t in ts]) for n, ts in cat.items() if ts[0].dim() > 0},
            "vectors": {n: torch.stack(ts) for n, ts in cat.items() if ts[0].dim() == 0}}


def _snapshot(model, opt):
    sd = opt.state_dict()
    comp = sd["lbcomm"]["compression"]
    return {
        "params": [q.detach().clone() for q in model.parameters()],
        **_flat_state(sd),
        "errors": None if comp is None else (comp["worker_error"].clone(), comp["server_error"].clone()),
        "global_step": sd["lbcomm"]["global_step"],
    }


# ---------------------------------------------------------------------- the 4-rank suite
def _warmup_vs_full_precision(rank, p):
    """OneBitAdam vs torch AdamW on allreduced grads; OneBitLamb vs Lamb; 60 warmup steps."""
    kw = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    model = _mlp()
    ref = copy.deepcopy(model)
    opt = lbcomm.OneBitAdam(model.parameters(), freeze_step=1000, **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    lamb_model, lamb_ref = _mlp(), _mlp()
    lamb = lbcomm.OneBitLamb(lamb_model.parameters(), freeze_step=1000, **kw)
    lamb_plain = lbcomm.Lamb(lamb_ref.parameters(), **kw)
    adam_diff, lamb_diff, losses = [], [], []
    for t in range(60):
        for mdl, o in ((model, opt), (ref, ref_opt), (lamb_model, lamb), (lamb_ref, lamb_plain)):
            o.zero_grad()
            loss = _loss(mdl, rank, t)
            loss.backward()
            if mdl is model:
                losses.append(loss.item())
        for q in ref.parameters():
            dist.all_reduce(q.grad)
            q.grad.div_(p)
        for o in (opt, ref_opt, lamb, lamb_plain):
            o.step()
        adam_diff.append(max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())))
        lamb_diff.append(max((a - b).abs().max().item()
                             for a, b in zip(lamb_model.parameters(), lamb_ref.parameters())))
    assert not opt.frozen and not lamb.frozen
    return {"adam": adam_diff, "lamb": lamb_diff, "losses": losses}


def _record(rank, p, name, steps, freeze, kw):
    """Train with quantized local grads; record them and the params after each step."""
    model = _mlp(seed=1)
    params0 = [q.detach().clone() for q in model.parameters()]
    opt = make_opt(OPTS[name], model.parameters(), freeze_step=freeze, **kw)
    grads, params = [], []
    for t in range(steps):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        for q in model.parameters():
            q.grad.copy_(_quantize(q.grad))
        grads.append([q.grad.clone() for q in model.parameters()])
        opt.step()
        params.append([q.detach().clone() for q in model.parameters()])
    return {"params0": params0, "grads": grads, "params": params, "numel": sum(q.numel() for q in params0),
            "bytes": opt.bytes_per_step()}


# exact_numel=0: this model is small enough for the default (4096) to average all of it exactly
SIM_RUNS = {
    "adam": dict(name="adam", steps=24, freeze=6,
                 kw=dict(rescale_variance=False, exact_numel=0, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                          weight_decay=0.01, block_size=64)),
    "adam_single_scale": dict(name="adam", steps=16, freeze=4,
                              kw=dict(rescale_variance=False, exact_numel=0, lr=1e-2, weight_decay=0.0, block_size=None,
                                       bias_correction=False)),
    "lamb": dict(name="lamb", steps=24, freeze=6,
                 kw=dict(exact_numel=0, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, block_size=64)),
    "lamb_single_scale": dict(name="lamb", steps=16, freeze=4,
                              kw=dict(exact_numel=0, lr=2e-2, weight_decay=0.0, block_size=None)),
    # max_update (docs/concepts.md, "Robustness"): the defaults above are 1.0 (both); these pin
    # the other forms, and a bound tight enough to clamp many coordinates
    "adam_published": dict(name="adam", steps=16, freeze=4,
                           kw=dict(rescale_variance=False, exact_numel=0, lr=1e-2, weight_decay=0.01, block_size=64,
                                max_update=None)),
    "adam_tight": dict(name="adam", steps=16, freeze=4,
                       kw=dict(rescale_variance=False, exact_numel=0, lr=1e-2, weight_decay=0.01, block_size=64,
                                max_update=0.05)),
    # the capped decode (the default) off: max_update clamps the step only
    "adam_tight_uncapped": dict(name="adam", steps=16, freeze=4,
                                kw=dict(rescale_variance=False, exact_numel=0, lr=1e-2, weight_decay=0.01,
                                        block_size=64, max_update=0.05, capped_decode=False)),
    "adam_warmup": dict(name="adam", steps=16, freeze=4,
                        kw=dict(rescale_variance=False, exact_numel=0, lr=1e-2, weight_decay=0.01, block_size=64,
                                max_update="warmup")),
    "lamb_published": dict(name="lamb", steps=16, freeze=4,
                           kw=dict(exact_numel=0, lr=1e-2, weight_decay=0.01, block_size=64, max_update=None,
                                   trust_ratio="frozen")),
    # trust_ratio="frozen": the warmup's average coefficient and the variance factor f
    "lamb_frozen": dict(name="lamb", steps=24, freeze=6,
                        kw=dict(exact_numel=0, lr=1e-2, eps=1e-6, weight_decay=0.01, block_size=64,
                                trust_ratio="frozen")),
    "lamb_max": dict(name="lamb", steps=16, freeze=4,
                     kw=dict(exact_numel=0, lr=1e-2, weight_decay=0.01, block_size=64, trust_ratio="max")),
    "lamb_tight": dict(name="lamb", steps=16, freeze=4,
                       kw=dict(exact_numel=0, lr=1e-2, weight_decay=0.01, block_size=64, max_update=0.05)),
    "lamb_tight_uncapped": dict(name="lamb", steps=16, freeze=4,
                                kw=dict(exact_numel=0, lr=1e-2, weight_decay=0.01, block_size=64, max_update=0.05,
                                        capped_decode=False)),
    # the live ratio's norm: 4 sampled coordinates of the many that max_update=0.05 clamps
    # (a drawn subset, not all of them), and the decoded direction's norm (norm_samples=0)
    "lamb_sampled": dict(name="lamb", steps=16, freeze=4,
                         kw=dict(exact_numel=0, lr=1e-2, weight_decay=0.01, block_size=64, max_update=0.05,
                                 norm_samples=4)),
    "lamb_decoded_norm": dict(name="lamb", steps=16, freeze=4,
                              kw=dict(exact_numel=0, lr=1e-2, weight_decay=0.01, block_size=64, norm_samples=0)),
    "lamb_warmup": dict(name="lamb", steps=16, freeze=4,
                        kw=dict(exact_numel=0, lr=1e-2, weight_decay=0.01, block_size=64, max_update="warmup")),
    # exact_numel: the biases, LayerNorm and the 5 x 24 head (<= 200 elements) averaged exactly,
    # the 24 x 12 and 24 x 24 matrices compressed
    "adam_exact": dict(name="adam", steps=16, freeze=4,
                       kw=dict(rescale_variance=False, lr=1e-2, weight_decay=0.01, block_size=64, exact_numel=200)),
    "lamb_exact": dict(name="lamb", steps=16, freeze=4,
                       kw=dict(lr=1e-2, weight_decay=0.01, block_size=64, exact_numel=200)),
    # rescale_variance (OneBitAdam's default; the runs above pin it off so that they stay
    # bitwise): the four ranks' squared norms are summed in gloo's order, not the
    # simulation's, so this run is compared to fp32 rounding (two ranks, bitwise:
    # tests/test_rescale_variance.py)
    "adam_rescale": dict(name="adam", steps=24, freeze=6,
                         kw=dict(exact_numel=0, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                  block_size=64)),
}


def _masking(rank, p, override, threshold=1e-10, max_update=None):
    """max_update=None by default: the mask is what keeps the published update safe."""
    model = _SparseNet()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, weight_decay=0.0, freeze_step=4,
                            comm=lbcomm.CommConfig(mask_threshold=threshold, max_update=max_update, exact_numel=0))
    if override:  # train every coordinate: the mask that the automatic one replaces
        for q in model.parameters():
            opt.set_momentum_mask(q, torch.ones_like(q, dtype=torch.bool))
    for t in range(12):
        ids, feats, y = _sparse_batch(rank, t)
        opt.zero_grad()
        F.cross_entropy(model(ids, feats), y).backward()
        opt.step()
    m_emb = opt.state[model.emb.weight]["exp_avg"]
    return {
        "unused_rows_moved": (model.emb.weight[25:] - init["emb.weight"][25:]).abs().max().item(),
        "zero_feature_moved": (model.lin.weight[:, 6:8] - init["lin.weight"][:, 6:8]).abs().max().item(),
        "used_moved": (model.emb.weight[:25] - init["emb.weight"][:25]).abs().max().item(),
        "momentum_unused": m_emb[25:].abs().max().item(),
        "shift_moved": (model.shift - init["shift"]).abs().max().item(),
        "shift_variance": opt.state[model.shift]["exp_avg_sq"].item(),
        "finite": all(bool(torch.isfinite(q).all()) for q in model.parameters()),
    }


def _nonfinite(rank, p, policy):
    """Inject NaN (warmup, step 2, rank 1) and Inf (compression, step 6, rank 2)."""
    model = _mlp(seed=2)
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=4, comm=lbcomm.CommConfig(nonfinite=policy))
    out = {"skipped": [], "raised": [], "unchanged": [], "params_equal_after": None}
    for t in range(9):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        if (t == 1 and rank == 1) or (t == 5 and rank == 2):
            next(model.parameters()).grad[0, 0] = float("nan") if t == 1 else float("inf")
        before = _snapshot(model, opt)
        try:
            opt.step()
            out["raised"].append(False)
        except lbcomm.NonFiniteError:
            out["raised"].append(True)
        out["skipped"].append(opt.last_step_skipped)
        if opt.last_step_skipped:
            out["unchanged"].append(_same(before, _snapshot(model, opt)))
    out["params"] = [q.detach().clone() for q in model.parameters()]
    out["global_step"] = opt.global_step
    out["skipped_steps"] = opt.skipped_steps
    return out


def _hook_style(rank, p):
    """What a DDP hook does: average the grads itself during the warmup and set
    grads_averaged; no communication after the freeze (the optimizer compresses)."""
    mine, theirs = _mlp(seed=4), _mlp(seed=4)
    # rescale_variance off: averaged by a hook other than lbcomm's, the local norms are unknown
    # (tests/test_rescale_variance.py checks that warning)
    kw = dict(lr=1e-2, freeze_step=5, comm=lbcomm.CommConfig(block_size=64), rescale_variance=False)
    opt, hooked = lbcomm.OneBitAdam(mine.parameters(), **kw), lbcomm.OneBitAdam(theirs.parameters(), **kw)
    hooked.grads_averaged = True
    diffs, frozen = [], []
    for t in range(10):
        for mdl, o in ((mine, opt), (theirs, hooked)):
            o.zero_grad()
            _loss(mdl, rank, t).backward()
            for q in mdl.parameters():  # exact sums: the two ways of averaging agree bitwise
                q.grad.copy_(_quantize(q.grad))
        frozen.append(hooked.frozen)
        if not hooked.frozen:
            for q in theirs.parameters():
                dist.all_reduce(q.grad)
                q.grad.div_(p)
        opt.step()
        hooked.step()
        diffs.append(_max_diff(mine, theirs))
    return {"diffs": diffs, "frozen": frozen}


def _four_rank_suite(rank, p):
    torch.manual_seed(0)
    return {
        "warmup": _warmup_vs_full_precision(rank, p),
        "sim": {k: _record(rank, p, r["name"], r["steps"], r["freeze"], r["kw"]) for k, r in SIM_RUNS.items()},
        "mask": {"auto": _masking(rank, p, False), "override": _masking(rank, p, True),
                 "override_bounded": _masking(rank, p, True, max_update=1.0),
                 "exact_zero_only": _masking(rank, p, False, threshold=0.0)},
        "nonfinite": {pol: _nonfinite(rank, p, pol) for pol in ("skip", "raise")},
        "hook": _hook_style(rank, p),
    }


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_four_rank_suite, 4, timeout=240)


def test_onebit_adam_warmup_equals_adamw_on_averaged_grads(four_ranks):
    for res in four_ranks:
        assert len(res["warmup"]["adam"]) == 60
        assert max(res["warmup"]["adam"]) <= 1e-6, res["warmup"]["adam"]
    losses = four_ranks[0]["warmup"]["losses"]
    assert sum(losses[-5:]) < sum(losses[:5])  # a real training run


def test_onebit_lamb_warmup_equals_lamb(four_ranks):
    for res in four_ranks:
        assert max(res["warmup"]["lamb"]) <= 1e-6, res["warmup"]["lamb"]


@pytest.mark.parametrize("run", [k for k in SIM_RUNS if k != "adam_rescale"])
def test_four_ranks_match_the_simulation_bitwise(four_ranks, run):
    cfg = SIM_RUNS[run]
    recs = [r["sim"][run] for r in four_ranks]
    for t in range(cfg["steps"]):  # every rank holds the same parameters after every step
        for r in range(1, 4):
            assert _same(recs[r]["params"][t], recs[0]["params"][t]), f"rank {r} differs at step {t + 1}"
    grads = [[recs[r]["grads"][t] for r in range(4)] for t in range(cfg["steps"])]
    kw = dict(cfg["kw"])
    simulate = SIM.simulate_onebit_adam if cfg["name"] == "adam" else SIM.simulate_onebit_lamb
    history = simulate(recs[0]["params0"], grads, freeze_step=cfg["freeze"], **kw)
    for t in range(cfg["steps"]):
        worst = max((a - b).abs().max().item() for a, b in zip(history[t], recs[0]["params"][t]))
        assert worst == 0.0, f"step {t + 1}: max |optimizer - simulation| = {worst}"
    # the compression stage really moved the parameters, differently from the warmup alone
    last_warm = recs[0]["params"][cfg["freeze"] - 1]
    assert max((a - b).abs().max().item() for a, b in zip(recs[0]["params"][-1], last_warm)) > 1e-3


def test_four_ranks_rescale_variance_matches_the_simulation(four_ranks):
    cfg = SIM_RUNS["adam_rescale"]
    recs = [r["sim"]["adam_rescale"] for r in four_ranks]
    for t in range(cfg["steps"]):
        for r in range(1, 4):
            assert _same(recs[r]["params"][t], recs[0]["params"][t]), f"rank {r} differs at step {t + 1}"
    grads = [[recs[r]["grads"][t] for r in range(4)] for t in range(cfg["steps"])]
    history = SIM.simulate_onebit_adam(recs[0]["params0"], grads, freeze_step=cfg["freeze"], **cfg["kw"])
    for t in range(cfg["steps"]):
        for a, b in zip(history[t], recs[0]["params"][t]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    # the warmup is the pinned run's bit for bit; the compression stage is not
    pinned = four_ranks[0]["sim"]["adam"]["params"]
    assert _same(recs[0]["params"][cfg["freeze"] - 1], pinned[cfg["freeze"] - 1])
    assert max((a - b).abs().max().item() for a, b in zip(recs[0]["params"][-1], pinned[-1])) > 1e-5


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_a_tight_max_update_changes_the_run(four_ranks, name):
    """The bitwise comparison above covers clamped coordinates: with max_update=0.05 the
    parameters end elsewhere than with the published rule, on every rank alike."""
    tight, published = four_ranks[0]["sim"][f"{name}_tight"], four_ranks[0]["sim"][f"{name}_published"]
    assert max((a - b).abs().max().item() for a, b in zip(tight["params"][-1], published["params"][-1])) > 1e-4
    freeze = SIM_RUNS[f"{name}_tight"]["freeze"]  # the warmup is not affected
    assert _same(tight["params"][freeze - 1], published["params"][freeze - 1])


def test_the_live_ratios_norm_estimate_is_in_the_bitwise_comparison(four_ranks):
    """OneBitLamb's live ratio divides by an estimate of the uncompressed direction's norm:
    the run with 4 sampled coordinates (equal to its simulation bitwise, above) ends
    elsewhere than the simulation that averages every clamped coordinate exactly, or with
    the decoded norm (norm_samples=0), or with a step bound at the lr (the estimate may then
    only lower the coefficient); the decoded-norm run ends elsewhere than the default."""
    cfg, rec = SIM_RUNS["lamb_sampled"], four_ranks[0]["sim"]["lamb_sampled"]
    grads = [[four_ranks[r]["sim"]["lamb_sampled"]["grads"][t] for r in range(4)] for t in range(cfg["steps"])]

    def gap(**kw):
        hist = SIM.simulate_onebit_lamb(rec["params0"], grads, freeze_step=cfg["freeze"], **dict(cfg["kw"], **kw))
        return max((a - b).abs().max().item() for a, b in zip(hist[-1], rec["params"][-1]))

    assert gap() == 0.0
    assert gap(norm_samples=10 ** 6) > 1e-6  # more clamped coordinates than 4: the draw is a subset
    assert gap(norm_samples=0) > 1e-6
    assert gap(norm_step_bound=cfg["kw"]["lr"]) > 1e-6
    decoded, default = four_ranks[0]["sim"]["lamb_decoded_norm"], four_ranks[0]["sim"]["lamb_max"]
    assert max((a - b).abs().max().item() for a, b in zip(decoded["params"][-1], default["params"][-1])) > 1e-5
    # what it sends: one fp64 allreduce of (samples + 1) per parameter, in bytes_per_step
    sent = rec["bytes"]
    assert sent["norm_estimate"] == ring_allreduce_bytes(8 * 5 * len(rec["params0"]), 4)
    assert sent["total"] == sent["compressed"] + sent["exact"] + sent["agreement"] + sent["norm_estimate"]
    assert decoded["bytes"]["norm_estimate"] == 0


def test_the_capped_decode_is_in_the_bitwise_comparison(four_ranks):
    """capped_decode changes the compression stage (not the warmup), and the bitwise
    comparison sees it: a simulation without the cap misses the default run. OneBitLamb's
    changes its run too."""
    capped, plain = four_ranks[0]["sim"]["adam_tight"], four_ranks[0]["sim"]["adam_tight_uncapped"]
    cfg = SIM_RUNS["adam_tight"]
    assert _same(capped["params"][cfg["freeze"] - 1], plain["params"][cfg["freeze"] - 1])
    assert max((a - b).abs().max().item() for a, b in zip(capped["params"][-1], plain["params"][-1])) > 1e-5
    lamb, lamb_plain = four_ranks[0]["sim"]["lamb_tight"], four_ranks[0]["sim"]["lamb_tight_uncapped"]
    assert max((a - b).abs().max().item() for a, b in zip(lamb["params"][-1], lamb_plain["params"][-1])) > 1e-5
    grads = [[four_ranks[r]["sim"]["adam_tight"]["grads"][t] for r in range(4)] for t in range(cfg["steps"])]
    history = SIM.simulate_onebit_adam(capped["params0"], grads, freeze_step=cfg["freeze"],
                                       **dict(cfg["kw"], capped_decode=False))
    assert max((a - b).abs().max().item() for a, b in zip(history[-1], capped["params"][-1])) > 1e-6


def test_max_update_keeps_unmasked_zero_variance_coordinates_in_place(four_ranks):
    """Without the mask the published update moves never-seen coordinates by m / eps; with
    max_update=1.0 no coordinate moves more than lr per compressed step (8 steps, lr 1e-2)."""
    for res in four_ranks:
        bounded = res["mask"]["override_bounded"]
        assert bounded["finite"]
        assert bounded["unused_rows_moved"] <= 8 * 1e-2 * (1 + 1e-5)
        assert bounded["zero_feature_moved"] <= 8 * 1e-2 * (1 + 1e-5)


def test_simulation_detects_a_wrong_block_size(four_ranks):
    """The bitwise comparison above can fail: a simulation with another block size differs."""
    cfg = SIM_RUNS["adam"]
    recs = [r["sim"]["adam"] for r in four_ranks]
    grads = [[recs[r]["grads"][t] for r in range(4)] for t in range(cfg["steps"])]
    kw = dict(cfg["kw"], block_size=128)
    history = SIM.simulate_onebit_adam(recs[0]["params0"], grads, freeze_step=cfg["freeze"], **kw)
    worst = max((a - b).abs().max().item() for a, b in zip(history[-1], recs[0]["params"][-1]))
    assert worst > 1e-6


def test_zero_variance_coordinates_are_masked(four_ranks):
    for res in four_ranks:
        auto = res["mask"]["auto"]
        assert auto["finite"]
        assert auto["unused_rows_moved"] == 0.0 and auto["zero_feature_moved"] == 0.0
        assert auto["momentum_unused"] == 0.0
        assert auto["used_moved"] > 1e-3
        # rounding-noise gradients (softmax-invariant shift) are masked by the default threshold
        assert 0 < auto["shift_variance"] and auto["shift_moved"] < 1e-3
        # without the mask (user override: everything trained) the same coordinates jump by m / eps
        over = res["mask"]["override"]
        assert over["unused_rows_moved"] > 1.0 or not over["finite"]
        # the exact-zero mask rule alone: unused rows stay, the shift jumps by noise / eps
        exact = res["mask"]["exact_zero_only"]
        assert exact["unused_rows_moved"] == 0.0 and exact["shift_moved"] > 1.0


def test_nonfinite_steps_are_skipped_on_every_rank_with_state_untouched(four_ranks):
    for pol in ("skip", "raise"):
        recs = [r["nonfinite"][pol] for r in four_ranks]
        for res in recs:
            expected = [t in (1, 5) for t in range(9)]
            assert res["skipped"] == expected
            assert res["raised"] == (expected if pol == "raise" else [False] * 9)
            assert res["unchanged"] == [True, True]
            assert res["global_step"] == 7 and res["skipped_steps"] == 2
        for res in recs[1:]:
            assert _same(res["params"], recs[0]["params"])
        assert all(bool(torch.isfinite(q).all()) for q in recs[0]["params"])


def test_grads_averaged_by_a_hook_skip_the_optimizers_allreduce(four_ranks):
    for res in four_ranks:
        hook = res["hook"]
        assert hook["frozen"] == [False] * 5 + [True] * 5
        assert max(hook["diffs"]) == 0.0, hook["diffs"]


# ---------------------------------------------------------------------- one process
def _train(model, opt, steps, start=0, closure=False, scheduler=None):
    losses = []
    for t in range(start, start + steps):
        def closure_fn(t=t):
            opt.zero_grad()
            loss = _loss(model, 0, t)
            loss.backward()
            return loss

        if closure:
            losses.append(opt.step(closure_fn).item())
        else:
            losses.append(closure_fn().item())
            opt.step()
        if scheduler is not None:
            scheduler.step()
    return losses


def _max_diff(m1, m2):
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(m1.parameters(), m2.parameters()))


def test_param_groups_schedulers_and_closures_match_adamw():
    model, ref = _mlp(), _mlp()
    groups = lambda m: [{"params": list(m[0].parameters()), "lr": 5e-3, "weight_decay": 0.0},  # noqa: E731
                        {"params": [q for layer in list(m)[1:] for q in layer.parameters()]}]
    opt = lbcomm.OneBitAdam(groups(model), lr=2e-3, weight_decay=0.1, freeze_step=500)
    ref_opt = torch.optim.AdamW(groups(ref), lr=2e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=10, gamma=0.5)
    losses = _train(model, opt, 50, closure=True, scheduler=sched)
    _train(ref, ref_opt, 50, closure=True, scheduler=ref_sched)
    assert _max_diff(model, ref) <= 1e-6
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3 / 32) and losses[-1] < losses[0]
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float32


def test_params_without_grads_and_frozen_params_match_adamw():
    model, ref = _mlp(), _mlp()
    for m in (model, ref):
        m[3].weight.requires_grad_(False)  # frozen
    extra, ref_extra = nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(7))
    ref_extra.data.copy_(extra.data)
    opt = lbcomm.OneBitAdam(list(model.parameters()) + [extra], lr=1e-2, weight_decay=0.1, freeze_step=500)
    ref_opt = torch.optim.AdamW(list(ref.parameters()) + [ref_extra], lr=1e-2, weight_decay=0.1)
    frozen0 = model[3].weight.detach().clone()
    for t in range(30):
        for m, e, o in ((model, extra, opt), (ref, ref_extra, ref_opt)):
            o.zero_grad()
            loss = _loss(m, 0, t)
            if t % 3 == 0:  # the extra param gets a grad only every third step
                loss = loss + (e ** 2).sum()
            loss.backward()
            if t % 5 == 4:  # and the last layer's bias sometimes none at all
                m[5].bias.grad = None
            o.step()
    assert _max_diff(model, ref) <= 1e-6 and (extra - ref_extra).abs().max().item() <= 1e-6
    assert torch.equal(model[3].weight, frozen0)
    assert model[3].weight not in opt.state
    assert opt.state[extra]["step"].item() == 10 and opt.state[model[5].bias]["step"].item() == 24


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_low_precision_params_keep_fp32_state(dtype, name):
    torch.manual_seed(0)
    p32 = torch.randn(64, 33)
    p_low = nn.Parameter(p32.to(dtype))
    ref = nn.Parameter(p_low.detach().float())
    make = (lambda ps: lbcomm.OneBitAdam(ps, lr=1e-2, freeze_step=3)) if name == "adam" else \
        (lambda ps: lbcomm.OneBitLamb(ps, lr=1e-2, weight_decay=0.01, freeze_step=3))
    opt, ref_opt = make([p_low]), make([ref])
    for t in range(6):
        g = torch.randn(64, 33).to(dtype)
        p_low.grad, ref.grad = g, g.float()
        ref.data.copy_(p_low.detach().float())  # same start: the fp32 result rounded is the low-precision one
        start = ref.detach().clone()
        opt.step()
        ref_opt.step()
        assert p_low.dtype == dtype
        assert torch.equal(p_low.detach(), ref.detach().to(dtype)), t
        assert not torch.equal(start, ref.detach())
    for key, val in opt.state[p_low].items():
        assert val.dtype == torch.float32, key
    assert torch.equal(opt.state[p_low]["exp_avg"], ref_opt.state[ref]["exp_avg"])


def test_one_rank_past_freeze_equals_adamw_with_frozen_variance():
    lr, b1, b2, eps, wd, freeze = 3e-3, 0.9, 0.999, 1e-8, 0.02, 12
    model, ref = _mlp(), _mlp()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, freeze_step=freeze,
                            rescale_variance=False,  # the published update (the formula below)
                            comm=lbcomm.CommConfig(max_update=None))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    _train(model, opt, freeze)
    _train(ref, ref_opt, freeze)
    assert opt.frozen and opt.compression_state is None and _max_diff(model, ref) <= 1e-6
    state = {q: (ref_opt.state[q]["exp_avg"], ref_opt.state[q]["exp_avg_sq"]) for q in ref.parameters()}
    for t in range(freeze + 1, freeze + 41):
        _train(model, opt, 1, start=t - 1)
        ref.zero_grad()
        _loss(ref, 0, t - 1).backward()
        with torch.no_grad():
            for q in ref.parameters():
                m, v = state[q]
                m.lerp_(q.grad, 1 - b1)
                denom = (v.sqrt() / math.sqrt(1 - b2 ** freeze)).add_(eps)  # v and its correction frozen
                q.mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
        assert _max_diff(model, ref) <= 1e-6, t
    assert torch.equal(opt.state[model[0].weight]["exp_avg_sq"], state[ref[0].weight][1])


def test_past_freeze_missing_grads_and_eps_changes_match_the_formula():
    """The compression stage reads grads straight from .grad (None counts as zero) and
    caches sqrt(v^) + eps; a changed eps must be picked up."""
    lr, b1, b2, wd, freeze = 3e-3, 0.9, 0.999, 0.02, 5
    model, ref = _mlp(), _mlp()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=lr, betas=(b1, b2), eps=1e-8, weight_decay=wd, freeze_step=freeze,
                            rescale_variance=False,  # the published update (the formula below)
                            comm=lbcomm.CommConfig(max_update=None))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(b1, b2), eps=1e-8, weight_decay=wd)
    _train(model, opt, freeze)
    _train(ref, ref_opt, freeze)
    state = {q: (ref_opt.state[q]["exp_avg"], ref_opt.state[q]["exp_avg_sq"]) for q in ref.parameters()}
    eps = 1e-8
    for t in range(freeze + 1, freeze + 21):
        if t == freeze + 8:
            eps = 1e-3
            opt.param_groups[0]["eps"] = eps
        for mod in (model, ref):
            mod.zero_grad()
            _loss(mod, 0, t - 1).backward()
            if t % 3 == 0:
                mod[5].bias.grad = None
        opt.step()
        with torch.no_grad():
            for q in ref.parameters():
                m, v = state[q]
                m.lerp_(torch.zeros_like(q) if q.grad is None else q.grad, 1 - b1)
                denom = (v.sqrt() / math.sqrt(1 - b2 ** freeze)).add_(eps)
                q.mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
        assert _max_diff(model, ref) == 0, t


@pytest.mark.parametrize("fraction", [0.001, 0.5])
def test_masked_coordinates_stay_put_past_the_freeze(fraction):
    """Sparse masks are zeroed through an index list, dense ones with masked_fill."""
    model = _mlp()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, weight_decay=0.0, freeze_step=3)
    w = model[3].weight
    keep = torch.rand(w.shape, generator=torch.Generator().manual_seed(1)) >= fraction
    keep.view(-1)[0] = False
    opt.set_momentum_mask(w, keep)
    _train(model, opt, 3)
    before = w.detach().clone()
    _train(model, opt, 5, start=3)
    assert torch.equal(w[~keep], before[~keep])
    assert bool((w[keep] != before[keep]).all())
    assert torch.equal(opt.state[w]["exp_avg"][~keep], torch.zeros(int((~keep).sum())))


def test_lamb_matches_the_simulation_on_one_rank():
    model = _mlp()
    params0 = [q.detach().clone() for q in model.parameters()]
    opt = lbcomm.Lamb(model.parameters(), lr=1e-2, weight_decay=0.01)
    grads = []
    for t in range(20):
        opt.zero_grad()
        _loss(model, 0, t).backward()
        grads.append([[q.grad.clone() for q in model.parameters()]])
        opt.step()
    history = SIM.simulate_lamb(params0, grads, lr=1e-2, weight_decay=0.01)
    assert all(torch.equal(a, b) for a, b in zip(history[-1], model.parameters()))


@pytest.mark.parametrize("name", ["lamb", "onebit_lamb"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lamb_coefficients_stay_finite_for_zero_norms(name, wd):
    zero_param = nn.Parameter(torch.zeros(5, 4))  # ||p|| = 0
    still = nn.Parameter(torch.randn(6))  # its gradient is always zero: zero momentum, ||u|| = 0 without wd
    moving = nn.Parameter(torch.randn(8))
    params = [zero_param, still, moving]
    opt = lbcomm.Lamb(params, lr=1e-2, weight_decay=wd) if name == "lamb" else \
        lbcomm.OneBitLamb(params, lr=1e-2, weight_decay=wd, freeze_step=3)
    still0, moving0 = still.detach().clone(), moving.detach().clone()
    for t in range(8):
        opt.zero_grad()
        (moving.sum() * (t + 1) + (zero_param * 0).sum() + (still * 0).sum()).backward()
        opt.step()
        for q in params:
            assert torch.isfinite(q).all(), (t, q)
        for st in opt.state.values():
            for key, val in st.items():
                assert torch.isfinite(val).all(), (t, key)
    if wd == 0:
        assert torch.equal(still, still0) and torch.equal(zero_param, torch.zeros(5, 4))
    assert (moving - moving0).abs().min().item() > 1e-3


def test_nonfinite_on_one_rank_raises_or_skips_with_state_untouched():
    for policy in ("raise", "skip"):
        model = _mlp()
        opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm=lbcomm.CommConfig(nonfinite=policy))
        for t in range(4):
            opt.zero_grad()
            _loss(model, 0, t).backward()
            if t in (1, 3):  # one in the warmup, one after the freeze
                model[0].weight.grad[1, 1] = float("nan")
            before = _snapshot(model, opt)
            if policy == "raise" and t in (1, 3):
                with pytest.raises(lbcomm.NonFiniteError, match="state is unchanged"):
                    opt.step()
            else:
                opt.step()
            assert opt.last_step_skipped == (t in (1, 3))
            if t in (1, 3):
                assert _same(before, _snapshot(model, opt))
        assert opt.global_step == 2 and opt.skipped_steps == 2


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
        assert torch.equal(opt2.state[q]["exp_avg_local"], opt2.state[q]["exp_avg"])
    _train(clone, opt2, 2, start=5)


def test_the_estimated_norm_is_bounded_by_the_peak_lr():
    """The live ratio's norm: the estimate's root, never below 0.1 ||u||, and under
    norm_step_bound tau never below ||u|| / max(1, tau / lr_peak): the bound is set by the
    largest lr of the compression stage and stays as the schedule decays the lr."""
    est = lbcomm.OneBitLamb._estimated_norm
    un = torch.tensor([2.0])
    sq = torch.tensor(0.01, dtype=torch.float64)  # an estimate far below ||u||
    assert est(sq, un, {"lr": 0.01, "norm_step_bound": None}).item() == pytest.approx(0.2)  # 0.1 ||u||
    assert est(sq, un, {"lr": 0.01, "norm_step_bound": 0.1}).item() == pytest.approx(0.2)  # factor 10
    assert est(sq, un, {"lr": 0.01, "norm_step_bound": 0.05}).item() == pytest.approx(0.4)  # factor 5
    # decayed from a peak of 0.05: the factor stays 2, not 10
    assert est(sq, un, {"lr": 0.01, "lr_peak": 0.05, "norm_step_bound": 0.1}).item() == pytest.approx(1.0)
    # a run at an lr of tau or more divides by the decoded norm (or the estimate, if larger)
    assert est(sq, un, {"lr": 0.2, "norm_step_bound": 0.1}).item() == pytest.approx(2.0)
    assert est(torch.tensor(9.0, dtype=torch.float64), un, {"lr": 0.2, "norm_step_bound": 0.1}).item() == 3.0


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
    assert lbcomm.OneBitAdam(model.parameters()).rank_local_buffers() == {}
    a, b = local.clone() + 1, local.clone() - 3
    opt.load_rank_local_buffers({"exp_avg_local": a})
    assert torch.equal(local, a)
    opt.load_rank_local_buffers({"exp_avg_local": a}, all_ranks=[{"exp_avg_local": a}, {"exp_avg_local": b}])
    assert torch.equal(local, (a + b) / 2)
    with caplog.at_level(logging.WARNING, logger="lbcomm"):
        opt.load_rank_local_buffers(None)
    assert torch.equal(local, opt._flat["exp_avg"]) and any("rank-local" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="another model or layout"):
        opt.load_rank_local_buffers({"exp_avg_local": torch.zeros(3)})


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
    for cls, n in ((lbcomm.OneBitAdam, 9), (lbcomm.OneBitLamb, 12), (lbcomm.ZeroOneAdam, 13), (lbcomm.Lamb, 8),
                   (lbcomm.Lars, 9)):  # params and comm included
        assert len(inspect.signature(cls).parameters) == n, cls


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


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_warmup_bound_is_recorded_at_the_freeze_and_checkpointed(name):
    """max_update="warmup": U_p = max |m^ / (sqrt(v^) + eps)| of each tensor after the last
    warmup step, kept per parameter; a resumed optimizer continues bitwise with it."""
    b1, b2, eps, freeze = 0.9, 0.999, 1e-8, 3
    kw = dict(lr=1e-2, betas=(b1, b2), eps=eps, freeze_step=freeze, comm=lbcomm.CommConfig(max_update="warmup"))
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


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_exact_numel_takes_effect(four_ranks, name):
    """The exact runs equal their simulation bitwise (above); the same gradients with every
    parameter compressed end elsewhere, so the exact averaging did something."""
    cfg, key = SIM_RUNS[f"{name}_exact"], f"{name}_exact"
    recs = [r["sim"][key] for r in four_ranks]
    grads = [[recs[r]["grads"][t] for r in range(4)] for t in range(cfg["steps"])]
    simulate = SIM.simulate_onebit_adam if name == "adam" else SIM.simulate_onebit_lamb
    compressed = simulate(recs[0]["params0"], grads, freeze_step=cfg["freeze"], **dict(cfg["kw"], exact_numel=0))
    assert max((a - b).abs().max().item() for a, b in zip(compressed[-1], recs[0]["params"][-1])) > 1e-6


@pytest.mark.parametrize("cls", [lbcomm.OneBitAdam, lbcomm.OneBitLamb])
def test_exact_numel_is_validated(cls):
    model = _mlp()
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="exact_numel"):
            cls(model.parameters(), comm=lbcomm.CommConfig(exact_numel=bad))
    assert cls(model.parameters(), comm=lbcomm.CommConfig(exact_numel=4096)).comm.exact_numel == 4096
