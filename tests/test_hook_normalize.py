"""`onebit_hook` with normalize="warmup" on 2 real gloo ranks, against an
independent pure-torch reference (`lbcomm.testing.kernels.compressed_allreduce`):

* in the full-precision start the hook averages as a plain allreduce does;
* from ``start_iter`` on, every rank's bucket is w * compressed_allreduce(g / w), with w the
  RMS of the averaged gradients of iterations 0 .. start_iter-1 (DDP's first iteration in
  its initial bucket layout), floored at ``normalize_floor`` x the bucket's RMS of it;
  normalize=None is the published compression of g itself;
* a checkpoint taken before ``start_iter`` (the statistics) resumes bitwise; the weights are
  bf16, and a checkpoint whose weights are fp32 (written by hand) keeps them and resumes
  the same run bitwise;
* ``exact_numel``: the parameters of at most that many elements get the exact mean and keep
  zero error feedback, the others are compressed as above; a NaN in one of them on one rank
  makes the bucket NaN on every rank with the error feedback unchanged.

One spawn runs every scenario; the checks run in the test process.
"""
import math

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import pytest

from dist_util import run_ranks
from lbcomm.common import ring_allreduce_bytes
from lbcomm.testing import kernels as R
from lbcomm.config import CommConfig
from lbcomm.ddp import OneBitHookState, onebit_hook

P, START, STEPS, BLOCK = 2, 3, 6, 256
EXACT = 200  # the second bias and the last layer (48, 144, 3 elements) exact, the first weight (1152) compressed


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 3))


def _run(rank, steps, normalize="warmup", state=None, first=0, model_state=None, opt_state=None, exact_numel=0,
         nan_at=None):
    """(per-iteration (local bucket, reduced bucket), model, opt, hook state): one bucket.
    `nan_at`: the iteration at which rank 1 puts NaN into the last layer's bias gradient."""
    model = _model()
    if model_state is not None:
        model.load_state_dict(model_state)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    hook = OneBitHookState(START, normalize=normalize, comm=CommConfig(block_size=BLOCK, exact_numel=exact_numel))
    if state is not None:
        hook.load_state_dict(state)
    seen = []

    index = {id(q): i for i, q in enumerate(model.parameters())}

    errors = lambda: [u.compression.worker_error.clone() for u in hook.planner.units()] + \
        [u.compression.server_error.clone() for u in hook.planner.units()]  # noqa: E731

    def probe(st, bucket):  # DDP's first iteration has another bucket layout than the later ones
        order = [index[id(q)] for q in bucket.parameters()]
        if st.iter == nan_at and rank == 1:
            at = sum(q.numel() for q in bucket.parameters()[:order.index(3)])
            bucket.buffer()[at:at + 3] = float("nan")
        local, before = bucket.buffer().clone(), errors()
        return onebit_hook(st, bucket).then(lambda f: (seen.append((local, f.value().clone(), order, before,
                                                                    errors())), f.value())[1])

    ddp.register_comm_hook(hook, probe)
    for s in range(first, first + steps):
        g = torch.Generator().manual_seed(100 * s + rank)
        x = torch.randn(16, 24, generator=g)
        x = x * (torch.rand(24, generator=torch.Generator().manual_seed(7)) < 0.3)  # rarely active inputs
        y = torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return seen, model, opt, hook


def _scenarios(rank, p):
    out = {}
    for normalize in ("warmup", None):
        seen, model, _, hook = _run(rank, STEPS, normalize)
        out[normalize] = {"seen": seen, "params": [q.detach().clone() for q in model.parameters()],
                          "stats": hook.compression_stats()}
    seen, _, _, hook = _run(rank, STEPS, exact_numel=EXACT)
    out["exact"] = {"seen": seen, "stats": hook.compression_stats()}
    seen, _, _, hook = _run(rank, STEPS, exact_numel=EXACT, nan_at=STEPS - 1)
    out["exact_nan"] = {"seen": seen, "skipped": hook.skipped_calls}
    seen, _, _, hook = _run(rank, STEPS, exact_numel=10**6)  # every parameter: no compressed call at all
    out["all_exact"] = {"seen": seen, "stats": hook.compression_stats()}
    _, model, opt, hook = _run(rank, START - 1)  # stop before compression starts
    sd = hook.state_dict()
    _, model, _, _ = _run(rank, STEPS - START + 1, state=sd, first=START - 1,
                          model_state=model.state_dict(), opt_state=opt.state_dict())
    out["resumed"] = [q.detach().clone() for q in model.parameters()]
    out["saved_stats"] = len(sd["grad_stats"])
    # after the start: the saved weights are bf16; made fp32 in the state_dict
    # they are kept fp32 and give the same run (the kernels use a bf16 weight's exact fp32 value)
    _, model, opt, hook = _run(rank, START + 1)
    sd = hook.state_dict()
    units = sd["units"]
    saved = [e["weights"].dtype for e in units]
    for e in units:
        e["weights"] = e["weights"].float()
    _, model, _, hook = _run(rank, STEPS - START - 1, state=sd, first=START + 1,
                             model_state=model.state_dict(), opt_state=opt.state_dict())
    out["resumed_fp32"] = {"params": [q.detach().clone() for q in model.parameters()], "saved": saved,
                           "loaded": [u.weights.dtype for u in hook.planner.units()]}
    return out


def _relayout(flat, order, layout):
    """A bucket of the parameters `order` (their numbers in the model) in `layout`'s order."""
    numels = [q.numel() for q in _model().parameters()]
    pieces = dict(zip(order, flat.split([numels[i] for i in order])))
    return torch.cat([pieces[i] for i in layout])


def _expected(res, normalize, scenario=None):
    """Every iteration's reduced bucket by the reference, from the ranks' local buckets
    (scenario "exact": normalize="warmup" with exact_numel=EXACT)."""
    scenario = scenario or normalize
    seen = [res[r][scenario]["seen"] for r in range(P)]
    locals_ = [[seen[r][t][0] for r in range(P)] for t in range(STEPS)]
    averaged = [torch.stack(x).sum(0) / P for x in locals_[:START]]
    layout = seen[0][START][2]  # the compressed (rebuilt) bucket's parameters
    numels = [q.numel() for q in _model().parameters()]
    exact = torch.cat([torch.full((numels[i],), scenario == "exact" and numels[i] <= EXACT) for i in layout])
    w = None
    if normalize == "warmup":
        got = [_relayout(*seen[0][t][1:3], layout) for t in range(START)]  # what the statistics saw
        rms = torch.stack([g * g for g in got]).sum(0).div(len(got)).sqrt()
        w = torch.maximum(rms, 0.1 * rms.square().mean().sqrt())
        w = torch.where(w > 0, w, torch.ones_like(w)).to(torch.bfloat16).float()  # the hook keeps them in bf16
    n = locals_[0][0].numel()
    m = R.chunk_size(n, P)
    we, se = [torch.zeros(P, m) for _ in range(P)], [torch.zeros(m) for _ in range(P)]
    out = averaged
    for t in range(START, STEPS):
        xs = [x / w for x in locals_[t]] if w is not None else locals_[t]
        red, we, se = R.compressed_allreduce(xs, we, se, BLOCK)
        red = red * w if w is not None else red
        if exact.any():  # the exact mean, and no error feedback, on those coordinates
            red = torch.where(exact, torch.stack(locals_[t]).sum(0) / P, red)
            keep = torch.nn.functional.pad(~exact, (0, P * m - n)).view(P, m)
            we = [e * keep for e in we]
            se = [e * keep[r] for r, e in enumerate(se)]
        out.append(red)
    return out, w, exact


@pytest.fixture(scope="module")
def res():
    return run_ranks(_scenarios, P, timeout=300)


def test_hook_normalize_matches_reference_and_resumes_bitwise(res):
    for normalize in ("warmup", None):
        expected, w, _ = _expected(res, normalize)
        for r in range(P):
            for t in range(STEPS):
                got = res[r][normalize]["seen"][t][1]
                if t < START:  # full precision: the mean, in this iteration's layout
                    assert res[r][normalize]["seen"][t][2] == res[0][normalize]["seen"][t][2]
                torch.testing.assert_close(got, expected[t], rtol=1e-5, atol=1e-6 * float(expected[t].abs().max()),
                                           msg=lambda m: f"normalize={normalize}, rank {r}, iteration {t}: {m}")
                assert torch.equal(got, res[0][normalize]["seen"][t][1])  # replicas identical
        if w is not None:  # the weights differ from one coordinate to another (the floor bites on some)
            assert float(w.max() / w.min()) > 3 and bool((w == w.min()).any())
    # the two rules differ once compression starts, and not before
    a, b = res[0]["warmup"]["seen"], res[0][None]["seen"]
    assert all(torch.equal(a[t][1], b[t][1]) for t in range(START))
    assert not torch.equal(a[START][1], b[START][1])
    for r in range(P):
        fp32 = res[r]["resumed_fp32"]
        assert fp32["saved"] and all(d == torch.bfloat16 for d in fp32["saved"]), fp32["saved"]
        assert fp32["loaded"] and all(d == torch.float32 for d in fp32["loaded"]), fp32["loaded"]
        assert all(torch.equal(x, y) for x, y in zip(fp32["params"], res[r]["warmup"]["params"])), \
            f"rank {r}: resumed with fp32 weights differs from the straight run"
        assert res[r]["saved_stats"] == 4  # one entry per parameter
        assert all(torch.equal(x, y) for x, y in zip(res[r]["resumed"], res[r]["warmup"]["params"])), \
            f"rank {r}: resumed before start_iter differs from the straight run"
    assert math.isfinite(float(res[0]["warmup"]["seen"][-1][1].sum()))


def test_hook_exact_numel_matches_reference_and_skips_nan(res):
    expected, _, exact = _expected(res, "warmup", "exact")
    assert 0 < int(exact.sum()) < exact.numel()
    for r in range(P):
        for t in range(STEPS):
            got = res[r]["exact"]["seen"][t][1]
            torch.testing.assert_close(got, expected[t], rtol=1e-5, atol=1e-6 * float(expected[t].abs().max()),
                                       msg=lambda m: f"exact, rank {r}, iteration {t}: {m}")
            assert torch.equal(got, res[0]["exact"]["seen"][t][1])  # replicas identical
            if t >= START:  # the exact coordinates: the mean of the ranks' gradients, bitwise
                mean = (res[0]["exact"]["seen"][t][0] + res[1]["exact"]["seen"][t][0]) / P
                assert torch.equal(got[exact], mean[exact])
    # the exact bytes are counted: an fp32 ring allreduce of the exact elements per compressed call
    extra = res[0]["exact"]["stats"]["bytes_sent"] - res[0]["warmup"]["stats"]["bytes_sent"]
    assert extra == (STEPS - START) * int(ring_allreduce_bytes(4 * int(exact.sum()), P))
    # NaN in an exact parameter on rank 1: the bucket is NaN on every rank, the errors are unchanged
    for r in range(P):
        local, reduced, _, before, after = res[r]["exact_nan"]["seen"][STEPS - 1]
        assert bool(reduced.isnan().all()), f"rank {r}"
        assert all(torch.equal(a, b) for a, b in zip(before, after)), f"rank {r}: errors changed"
        assert res[r]["exact_nan"]["skipped"] == 1
        # and up to then the run equals the one without NaN
        for t in range(STEPS - 1):
            assert torch.equal(res[r]["exact_nan"]["seen"][t][1], res[r]["exact"]["seen"][t][1])


def test_hook_exact_numel_covering_every_parameter_is_a_plain_mean(res):
    for r in range(P):
        for t in range(START, STEPS):
            local = [res[q]["all_exact"]["seen"][t][0] for q in range(P)]
            assert torch.equal(res[r]["all_exact"]["seen"][t][1], (local[0] + local[1]) / P)
        stats = res[r]["all_exact"]["stats"]
        assert stats["compressed_calls"] == 0 and stats["bytes_sent"] == stats["bytes_uncompressed"]
