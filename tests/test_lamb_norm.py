"""OneBitLamb's clean-norm estimate (lbcomm/optim/lamb_norm.py): the fused pass
(torch.ops.lbcomm.lamb_clean_pass_, csrc/lamb.cpp) and its torch fallback against a
plain-torch computation of what they promise, and the optimizer on two real gloo ranks
against the simulation (lbcomm.testing.optim) with passes of a few elements, so that the
staged ranges, the second pass for the sampled positions and the direction of a
parameter larger than the staging buffer run."""
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


def _expected(m, v, ml, theta, masked, bc1, bc2, eps, bound):
    """What the pass promises, from scratch: (the four sums, the edge's indices)."""
    root = torch.from_numpy(np.sqrt(v.numpy()))  # numpy's fp32 sqrt: IEEE's
    q = (root / bc2 ** 0.5 + eps) * bc1
    u0, y = m / q, ml / q
    edge = torch.zeros_like(m, dtype=torch.bool)
    if bound is not None:
        u0, y = u0.clamp(-bound, bound), y.clamp(-bound, bound)
        edge = u0.abs() >= bound * AT_BOUND
    if masked is not None:
        edge = edge | masked
    keep = ~edge
    sums = [float((y[keep].double() * u0[keep].double()).sum()), 0.0, 0.0, float(edge.sum())]
    if theta is not None:
        th = theta.double()
        sums[1], sums[2] = float(torch.dot(u0.double(), th)), float(torch.dot(th, th))
    return sums, edge.nonzero().view(-1)


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * 1e-2
    v = torch.rand(n, generator=g) * 1e-4
    v[:7] = 0.0
    ml = m + 3e-3 * torch.randn(n, generator=g)
    theta = torch.randn(n, generator=g)
    masked = torch.zeros(n, dtype=torch.bool)
    masked[3:40:3] = True
    return m, v, ml, theta, masked


PASSES = [K.clean_pass_torch] + ([torch.ops.lbcomm.lamb_clean_pass_] if K._CLEAN_OP else [])


@pytest.mark.parametrize("run", PASSES, ids=lambda f: getattr(f, "__name__", str(f)))
@pytest.mark.parametrize("bound", [None, 1.0, 0.05])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_theta", [False, True])
@pytest.mark.parametrize("ml_dtype", [torch.float32, torch.bfloat16])
def test_clean_pass_computes_its_sums_and_the_edge(run, bound, with_mask, with_theta, ml_dtype):
    """exp_avg_local in either dtype (OneBitLamb keeps bf16): widened exactly, as from scratch."""
    n, bc1, bc2, eps = 5003, 0.4, 0.02, 1e-8
    m, v, ml, theta, masked = _data(n, 3)
    ml = ml.to(ml_dtype)
    sums, edge = _expected(m, v, ml.float(), theta if with_theta else None, masked if with_mask else None, bc1, bc2, eps, bound)
    # two calls (the ranges of one parameter), positions numbered across them from acc[3]
    acc = torch.zeros(4, dtype=torch.float64)
    pos = torch.full((n,), -1, dtype=torch.int64)
    cut = 2048
    for lo, hi in ((0, cut), (cut, n)):
        run(acc, pos, m[lo:hi], v[lo:hi], ml[lo:hi], theta[lo:hi] if with_theta else None,
            masked[lo:hi] if with_mask else None, lo, 0, bc1, bc2 ** 0.5, eps, bound,
            0.0 if bound is None else bound * AT_BOUND)
    assert acc[3].item() == sums[3] == edge.numel()
    assert torch.equal(pos[:edge.numel()], edge)
    for got, want in zip(acc[:3].tolist(), sums[:3]):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-300)
    if bound == 0.05:
        assert edge.numel() > 100  # many coordinates at the bound: the edge is exercised
    # a window of the numbering: positions [skip, skip + cap) only, nothing else written
    if edge.numel() > 20:
        acc2 = torch.zeros(4, dtype=torch.float64)
        win = torch.full((7,), -1, dtype=torch.int64)
        run(acc2, win, m, v, ml, None, masked if with_mask else None, 0, 11, bc1, bc2 ** 0.5, eps, bound,
            0.0 if bound is None else bound * AT_BOUND)
        assert torch.equal(win, edge[11:18])


@pytest.mark.skipif(not K._CLEAN_OP, reason="lbcomm._C has no lamb_clean_pass_")
@pytest.mark.parametrize("ml_dtype", [torch.float32, torch.bfloat16])
def test_the_op_equals_the_torch_pass(ml_dtype):
    m, v, ml, theta, masked = _data(40000, 5)
    ml = ml.to(ml_dtype)
    out = []
    for run in PASSES:
        acc, pos = torch.zeros(4, dtype=torch.float64), torch.full((40000,), -1, dtype=torch.int64)
        run(acc, pos, m, v, ml, theta, masked, 0, 0, 0.3, 0.05, 1e-8, 1.0, AT_BOUND)
        out.append((acc, pos))
    assert torch.equal(out[0][1], out[1][1]) and out[0][0][3] == out[1][0][3]
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-12, atol=0.0)


RUN = dict(exact_numel=0, lr=1e-2, weight_decay=0.01, block_size=64, max_update=0.05)


def _small_stage_runs(rank, p):
    """Two recorded runs with passes and a staging buffer of 64 elements: every matrix spans
    several ranges, has more edge coordinates than one range holds (the positions' second
    pass) and its direction does not fit the staging buffer (``scratch_u``)."""
    F.STAGE = onebit.STAGE = 64
    return {k: _record(rank, p, "lamb", 12, 4, dict(RUN, norm_samples=k)) for k in (4, 10 ** 6)}


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
