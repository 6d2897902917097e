"""OneBitLamb's clean-norm estimate (lbcomm/optim/lamb_norm.py): the fused pass
(torch.ops.lbcomm.lamb_clean_pass_, csrc/lamb.cpp) and its torch fallback against a
plain-torch computation of what they promise, the search for the sampled edge coordinates
(lamb_edge_find_) likewise, and the optimizer on two real gloo ranks against the
simulation (lbcomm.testing.optim) with passes of a few elements, so that the staged
ranges, the search across them and the direction of a parameter larger than the staging
buffer run."""
import numpy as np
import pytest
import torch

import lbcomm.optim.functional as F
import lbcomm.optim.onebit as onebit
from lbcomm.optim import kernels as K
from lbcomm.testing import optim as SIM
from dist_util import run_ranks
from optim_four_ranks import _record

AT_BOUND = 1 - 1e-5


def _expected(m, v, ml, masked, bc1, bc2, eps, bound):
    """What the pass promises, from scratch: (its two sums, the edge's indices)."""
    root = np.sqrt(v.numpy())  # numpy's fp32 sqrt and division: IEEE's
    r = torch.from_numpy(np.float32(1) / ((root * np.float32(1 / bc2 ** 0.5) + np.float32(eps)) * np.float32(bc1)))
    u0, y = m * r, ml * r
    edge = torch.zeros_like(m, dtype=torch.bool)
    if bound is not None:
        u0, y = u0.clamp(-bound, bound), y.clamp(-bound, bound)
        edge = u0.abs() >= bound * AT_BOUND
    if masked is not None:
        edge = edge | masked
    keep = ~edge
    sums = [float((y[keep].double() * u0[keep].double()).sum()), float(edge.sum())]
    return sums, edge.nonzero().view(-1)


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * 1e-2
    v = torch.rand(n, generator=g) * 1e-4
    v[:7] = 0.0
    ml = m + 3e-3 * torch.randn(n, generator=g)
    masked = torch.zeros(n, dtype=torch.bool)
    masked[3:40:3] = True
    return m, v, ml, masked


PASSES = [K.clean_pass_torch] + ([torch.ops.lbcomm.lamb_clean_pass_] if K._CLEAN_OP else [])
FINDS = [K.edge_find_torch] + ([torch.ops.lbcomm.lamb_edge_find_] if K._CLEAN_OP else [])


def _advanced(ml, g, w):
    """ml + w (g - ml), fp32 roundings one op at a time, in ml's dtype: from scratch, in numpy."""
    a = ml.float().numpy()
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, as in torch
        out = torch.from_numpy(((g.numpy() - a) * np.float32(w) + a).astype(np.float32))
    return out.to(ml.dtype)


def _blocks(edge, n):
    """Per block of K.EDGE_BLOCK elements, its flags set (edge: bool, n of them)."""
    pad = torch.zeros(-(-n // K.EDGE_BLOCK) * K.EDGE_BLOCK, dtype=torch.int64)
    pad[:n] = edge.long()
    return pad.view(-1, K.EDGE_BLOCK).sum(1)


@pytest.mark.parametrize("run", PASSES, ids=lambda f: getattr(f, "__name__", str(f)))
@pytest.mark.parametrize("bound", [None, 1.0, 0.05])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("ml_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_grad", [False, True])
@pytest.mark.parametrize("every", [1, 3])
def test_clean_pass_computes_its_sums_and_the_edge(run, bound, with_mask, ml_dtype, with_grad, every):
    """exp_avg_local in either dtype (OneBitLamb keeps bf16), advanced by a gradient first or
    not: widened exactly, as from scratch; the per-block edge counts of each range. every
    = 3: the runs of 512 elements 0, 3, 6, ... of each range alone (ml advanced there only,
    the rest counted 0)."""
    n, bc1, bc2, eps, w = 5003, 0.4, 0.02, 1e-8, 0.1
    m, v, ml, masked = _data(n, 3)
    ml = ml.to(ml_dtype)
    g = ml.float() + 1e-2 * torch.randn(n, generator=torch.Generator().manual_seed(9))
    cut = 2048
    cov = torch.cat([(torch.arange(k) // 512) % every == 0 for k in (cut, n - cut)])  # runs of 512
    want_ml = torch.where(cov, _advanced(ml, g, w).float(), ml.float()).to(ml_dtype) if with_grad else ml.clone()
    sums, edge = _expected(m[cov], v[cov], want_ml.float()[cov], masked[cov] if with_mask else None, bc1, bc2, eps,
                           bound)
    edge = cov.nonzero().view(-1)[edge]
    # two calls (the ranges of one parameter), acc summed across them
    acc = torch.zeros(2, dtype=torch.float64)
    counts = []
    for lo, hi in ((0, cut), (cut, n)):
        c = torch.full((-(-(hi - lo) // K.EDGE_BLOCK),), -1, dtype=torch.int64)
        run(acc, c, m[lo:hi], v[lo:hi], ml[lo:hi], g[lo:hi] if with_grad else None, w,
            masked[lo:hi] if with_mask else None, bc1, bc2 ** 0.5, eps, bound,
            0.0 if bound is None else bound * AT_BOUND, every)
        counts.append(c)
    assert torch.equal(ml, want_ml)
    assert acc[1].item() == sums[1] == edge.numel()
    on = torch.zeros(n, dtype=torch.bool)
    on[edge] = True
    assert torch.equal(counts[0], _blocks(on[:cut], cut)) and torch.equal(counts[1], _blocks(on[cut:], n - cut))
    assert acc[0].item() == pytest.approx(sums[0], rel=1e-12, abs=1e-300)
    if bound == 0.05:
        assert edge.numel() > 100  # many coordinates at the bound: the edge is exercised


ADVANCES = [K._advance_torch] + ([torch.ops.lbcomm.lamb_advance_local_] if K._CLEAN_OP else [])


@pytest.mark.parametrize("advance", ADVANCES, ids=lambda f: getattr(f, "__name__", str(f)))
@pytest.mark.parametrize("ml_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_grad", [False, True])
def test_advance_local_is_the_update_from_scratch(advance, ml_dtype, with_grad):
    """ml + w (g - ml) rounded op by op, then to ml's dtype (bf16: to nearest even), g None as
    zeros; a NaN stays NaN and an infinity an infinity."""
    n, w = 4099, 0.1
    gen = torch.Generator().manual_seed(2)
    ml = (torch.randn(n, generator=gen) * 1e-2).to(ml_dtype)
    ml[5], ml[6] = float("nan"), float("inf")
    g = torch.randn(n, generator=gen) * 1e-2
    want = _advanced(ml, g if with_grad else torch.zeros(n), w)
    advance(ml, g if with_grad else None, w)
    nan = want.isnan()
    assert torch.equal(ml.isnan(), nan) and torch.equal(ml[~nan], want[~nan])


@pytest.mark.parametrize("find", FINDS, ids=lambda f: getattr(f, "__name__", str(f)))
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("every", [1, 4])
def test_edge_find_gives_the_drawn_edge_coordinates(find, with_mask, every):
    """Draws in any order, repeated ones and both ends included, against the edge's indices
    from scratch (every = 4: of the runs the pass covered); a draw past the edge, or below
    0, is refused by the op."""
    n, bc1, bc2, eps, bound = 5003, 0.4, 0.02, 1e-8, 0.05
    m, v, ml, masked = _data(n, 4)
    masked = masked if with_mask else None
    cov = K.sampled_runs(n, every)
    edge = _expected(m[cov], v[cov], ml[cov], None if masked is None else masked[cov], bc1, bc2, eps, bound)[1]
    edge = cov.nonzero().view(-1)[edge]
    acc, counts = torch.zeros(2, dtype=torch.float64), torch.empty(-(-n // K.EDGE_BLOCK), dtype=torch.int64)
    args = (bc1, bc2 ** 0.5, eps, bound, bound * AT_BOUND)
    K.lamb_clean_pass_(acc, counts, m, v, ml, None, 0.0, masked, *args, every)
    draws = torch.randint(edge.numel(), (300,), generator=torch.Generator().manual_seed(1))
    draws = torch.cat([draws, torch.tensor([0, edge.numel() - 1, 0]), draws[:5]])
    out = torch.full_like(draws, -1)
    find(out, draws, counts, m, v, masked, *args)
    assert torch.equal(out, edge[draws])
    if find is not K.edge_find_torch:
        with pytest.raises(ValueError, match="past"):
            find(out[:1], torch.tensor([edge.numel()]), counts, m, v, masked, *args)
        with pytest.raises(ValueError, match=">= 0"):
            find(out[:2], torch.tensor([5, -1]), counts, m, v, masked, *args)


@pytest.mark.skipif(not K._CLEAN_OP, reason="lbcomm._C has no lamb_clean_pass_")
@pytest.mark.parametrize("ml_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("every", [1, 7])
def test_the_op_equals_the_torch_pass(ml_dtype, every):
    m, v, ml, masked = _data(40000, 5)
    ml = ml.to(ml_dtype)
    g = torch.randn(40000, generator=torch.Generator().manual_seed(6)) * 1e-2
    out = []
    for run in PASSES:
        acc, counts, own = torch.zeros(2, dtype=torch.float64), torch.empty(-(-40000 // K.EDGE_BLOCK), dtype=torch.int64), ml.clone()
        run(acc, counts, m, v, own, g, 0.1, masked, 0.3, 0.05, 1e-8, 1.0, AT_BOUND, every)
        out.append((acc, counts, own))
    assert torch.equal(out[0][1], out[1][1]) and torch.equal(out[0][2], out[1][2]) and out[0][0][1] == out[1][0][1]
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-12, atol=0.0)


@pytest.mark.skipif(not K._CLEAN_OP, reason="lbcomm._C has no lamb_clean_pass_")
def test_the_op_refuses_every_below_one():
    m, v, ml, masked = _data(300, 1)
    acc, counts = torch.zeros(2, dtype=torch.float64), torch.empty(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="every must be >= 1"):
        torch.ops.lbcomm.lamb_clean_pass_(acc, counts, m, v, ml, None, 0.1, None, 0.3, 0.05, 1e-8, 1.0, AT_BOUND, 0)


@pytest.mark.parametrize("n", [1, 511, 131072, 131073, 589824, 3145728, 10 ** 8 + 7])
def test_pass_every_keeps_the_covered_runs_within_the_budget(n):
    """The least k whose covered runs (0, k, 2k, ... of 512 elements) number at most the
    budget's runs; a parameter within the budget, or on a sharded state, is covered whole."""
    from lbcomm.optim.lamb_norm import PASS_BUDGET, pass_every

    runs, k = -(-n // 512), pass_every(n, False)
    assert -(-runs // k) <= PASS_BUDGET // 512 and (k == 1 or -(-runs // (k - 1)) > PASS_BUDGET // 512)
    assert (k == 1) == (n <= PASS_BUDGET)
    assert pass_every(n, True) == 1


RUN = dict(exact_numel=0, lr=1e-2, weight_decay=0.01, block_size=64, max_update=0.05)


def _small_stage_runs(rank, p):
    """Two recorded runs with passes and a staging buffer of 64 elements: every matrix spans
    several ranges (the sampled edge coordinates found across them) and its direction
    does not fit the staging buffer (``scratch_u``); and one of a wider model with a pass
    budget of 1024 elements, so that its 64 x 64 matrix is sampled, two of its eight runs
    of 512 covered ("sampled")."""
    from lbcomm.optim import lamb_norm

    F.STAGE = onebit.STAGE = 64
    runs = {k: _record(rank, p, "lamb", 12, 4, dict(RUN, norm_samples=k)) for k in (4, 10 ** 6)}
    for k in (4, 10 ** 6):
        runs["live", k] = _record(rank, p, "lamb", 12, 4, dict(RUN, norm_samples=k, trust_ratio="live"))
    lamb_norm.PASS_BUDGET = SAMPLED_BUDGET
    runs["sampled"] = _record(rank, p, "lamb", 12, 4, dict(RUN, norm_samples=4), d_h=64)
    runs["live", "sampled"] = _record(rank, p, "lamb", 12, 4, dict(RUN, norm_samples=4, trust_ratio="live"), d_h=64)
    return runs


SAMPLED_BUDGET = 1024


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_small_stage_runs, 2, timeout=240)


@pytest.mark.parametrize("k", [4, 10 ** 6])
def test_two_ranks_match_the_simulation(two_ranks, k):
    """With two ranks the fp32 mean is the same in any order: the optimizer meets the
    simulation up to the fp64 sums' order (the fp32 values sent round alike almost always),
    and a simulation with another rule misses it by far more."""
    recs = [r[k] for r in two_ranks]
    grads = [[recs[r]["grads"][t] for r in range(2)] for t in range(12)]

    def gap(**kw):
        hist = SIM.simulate_onebit_lamb(recs[0]["params0"], grads, freeze_step=4, **{**RUN, "norm_samples": k, **kw})
        return max((a - b).abs().max().item() for a, b in zip(hist[-1], recs[0]["params"][-1]))

    assert gap() <= 1e-7
    assert gap(norm_samples=0) > 1e-5
    assert gap(norm_samples=2 if k == 4 else 4) > 1e-6


def test_a_sampled_pass_matches_the_simulation(two_ranks):
    """Parameters above the pass budget: the pass covers every k-th block, the same ones as
    the simulation's, and its sums stand for the whole parameter; the simulation that covers
    everything misses the run by far more."""
    recs = [r["sampled"] for r in two_ranks]
    grads = [[recs[r]["grads"][t] for r in range(2)] for t in range(12)]

    def gap(budget):
        hist = SIM.simulate_onebit_lamb(recs[0]["params0"], grads, freeze_step=4, **{**RUN, "norm_samples": 4},
                                        pass_budget=budget)
        return max((a - b).abs().max().item() for a, b in zip(hist[-1], recs[0]["params"][-1]))

    assert gap(SAMPLED_BUDGET) <= 1e-7
    assert gap(10 ** 6) > 1e-6


@pytest.mark.parametrize("k", [4, 10 ** 6, "sampled"])
def test_both_live_rules_match_the_simulation(two_ranks, k):
    """The default trust_ratio, "aligned" (the norm of u's length along the clean
    direction, its ratio from uniform draws of the covered coordinates: all of them with
    10^6 samples, every k-th run under a pass budget), and "live" (the clean norm) each
    meet their simulation, and miss the other rule's by far more."""
    budget = SAMPLED_BUDGET if k == "sampled" else 1 << 17
    samples = 4 if k == "sampled" else k
    for rule, key in (("aligned", k), ("live", ("live", k))):
        recs = [r[key] for r in two_ranks]
        grads = [[recs[r]["grads"][t] for r in range(2)] for t in range(12)]

        def gap(other):
            hist = SIM.simulate_onebit_lamb(recs[0]["params0"], grads, freeze_step=4, pass_budget=budget,
                                            **{**RUN, "norm_samples": samples, "trust_ratio": other})
            return max((a - b).abs().max().item() for a, b in zip(hist[-1], recs[0]["params"][-1]))

        assert gap(rule) <= 1e-7, rule
        assert gap("live" if rule == "aligned" else "aligned") > 1e-6, rule


def test_aligned_sends_the_uniform_draws_too(two_ranks):
    """The estimate's allreduce carries norm_samples more values per parameter under
    "aligned" than under "live" (bytes_per_step reports them)."""
    aligned, live = two_ranks[0][4]["bytes"]["norm_estimate"], two_ranks[0]["live", 4]["bytes"]["norm_estimate"]
    assert aligned > live > 0


@pytest.mark.parametrize("off", [{"norm_samples": 0}, {"trust_ratio": "frozen"}])
def test_exp_avg_local_is_kept_only_while_the_estimate_is_on(off):
    """Nothing reads exp_avg_local while a group's estimate is off, so it stays as the freeze
    left it; switched on again, the group restarts it from the momentum and advances it by
    the step's gradient, as at the freeze (one rank: the update runs, no estimate)."""
    import lbcomm
    from lbcomm.optim.lamb_norm import TRACKED

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    opt = lbcomm.OneBitLamb([{"params": net.parameters(), **off}], lr=1e-3, freeze_step=2)
    gen = torch.Generator().manual_seed(1)

    def step():
        for q in net.parameters():
            q.grad = torch.randn(q.shape, generator=gen)
        opt.step()

    for _ in range(3):
        step()
    assert opt.frozen
    frozen = [opt.state[q]["exp_avg_local"].clone() for q in net.parameters()]
    for _ in range(3):
        step()
    assert all(torch.equal(opt.state[q]["exp_avg_local"], f) for q, f in zip(net.parameters(), frozen))
    assert opt.param_groups[0][TRACKED] is False
    opt.param_groups[0].update(norm_samples=256, trust_ratio="max")
    step()
    for q in net.parameters():
        want = opt.state[q]["exp_avg"].to(torch.bfloat16)  # the momentum after the step, as the restart copies it
        K.advance_local_(want.view(-1), q.grad.reshape(-1), 0.1)
        assert torch.equal(opt.state[q]["exp_avg_local"], want)
    assert opt.param_groups[0][TRACKED] is True
    before = [opt.state[q]["exp_avg_local"].clone() for q in net.parameters()]
    step()  # on: advanced from where it was, no restart
    for q, b in zip(net.parameters(), before):
        K.advance_local_(b.view(-1), q.grad.reshape(-1), 0.1)
        assert torch.equal(opt.state[q]["exp_avg_local"], b)
