"""The 4-rank run that tests/test_optim_ranks.py reads: one spawn of four real gloo processes
(`four_rank_suite`), each part of it run on its own. A part that raises is recorded with
its traceback, and `guarded` turns a rank's result into dicts that fail only the tests that
read that part: one broken part does not fail the tests of the others."""
import copy
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lbcomm
from dist_util import same as _same
from optim_util import OPTS, _SparseNet, _loss, _max_diff, _mlp, _quantize, _snapshot, _sparse_batch, make_opt


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


def _record(rank, p, name, steps, freeze, kw, d_h=24):
    """Train with quantized local grads; record them and the params after each step (d_h:
    the MLP's hidden units)."""
    model = _mlp(seed=1, d_h=d_h)
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
            "bytes": opt.bytes_per_step(), "stats": opt.compression_stats()}


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
                            comm=lbcomm.CommConfig(exact_numel=0),
                            options=lbcomm.OneBitOptions(mask_threshold=threshold, max_update=max_update))
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
    kw = dict(lr=1e-2, freeze_step=5, comm=lbcomm.CommConfig(block_size=64),
              options=lbcomm.OneBitOptions(rescale_variance=False))
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


FAILED = "__failed__"  # a part's record when it raised: {FAILED: its traceback}


def _part(fn, *args, **kwargs):
    """fn(*args, **kwargs), or the traceback when it raises (the same on every rank when the failure
    is in lbcomm's own checks, so the ranks stay in step for the next part)."""
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - reported by the tests that read this part
        return {FAILED: traceback.format_exc()}


def _four_rank_suite(rank, p):
    torch.manual_seed(0)
    return {
        "warmup": _part(_warmup_vs_full_precision, rank, p),
        "sim": {k: _part(_record, rank, p, r["name"], r["steps"], r["freeze"], r["kw"]) for k, r in SIM_RUNS.items()},
        "mask": {"auto": _part(_masking, rank, p, False), "override": _part(_masking, rank, p, True),
                 "override_bounded": _part(_masking, rank, p, True, max_update=1.0),
                 "exact_zero_only": _part(_masking, rank, p, False, threshold=0.0)},
        "nonfinite": {pol: _part(_nonfinite, rank, p, pol) for pol in ("skip", "raise")},
        "hook": _part(_hook_style, rank, p),
    }


class _Parts(dict):
    """One rank's results (or a group of its parts): reading a part that failed fails the
    reading test with that rank's traceback."""

    def __init__(self, rank: int, where: str, data):
        super().__init__(data)
        self.rank, self.where = rank, where

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if isinstance(value, dict) and FAILED in value:
            pytest.fail(f"the 4-rank part {self.where}[{key!r}] failed on rank {self.rank}:\n{value[FAILED]}",
                        pytrace=False)
        return value


def guarded(results):
    """The ranks' results of `_four_rank_suite`, each part behind a check of its record."""
    return [_Parts(r, "", {k: _Parts(r, f"[{k!r}]", v) if k in ("sim", "mask", "nonfinite") else v
                           for k, v in res.items()}) for r, res in enumerate(results)]
