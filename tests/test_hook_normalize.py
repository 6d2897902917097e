"""`onebit_hook` with normalize="warmup" (issue 16) on 2 real gloo ranks, against an
independent pure-torch reference (`lbcomm.reference.compressed_allreduce`):

* in the full-precision start the hook averages as a plain allreduce does;
* from ``start_iter`` on, every rank's bucket is w * compressed_allreduce(g / w), with w the
  RMS of the averaged gradients of iterations 0 .. start_iter-1 (DDP's first iteration in
  its initial bucket layout), floored at ``normalize_floor`` x the bucket's RMS of it;
  normalize=None is the published compression of g itself;
* a checkpoint taken before ``start_iter`` (the statistics) resumes bitwise.

One spawn runs every scenario; the checks run in the test process.
"""
import math

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_util import run_ranks
from lbcomm import reference as R
from lbcomm.ddp import OneBitHookState, onebit_hook

P, START, STEPS, BLOCK = 2, 3, 6, 256


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 3))


def _run(rank, steps, normalize="warmup", state=None, first=0, model_state=None, opt_state=None):
    """(per-iteration (local bucket, reduced bucket), model, opt, hook state): one bucket."""
    model = _model()
    if model_state is not None:
        model.load_state_dict(model_state)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    hook = OneBitHookState(None, start_iter=START, block_size=BLOCK, normalize=normalize)
    if state is not None:
        hook.load_state_dict(state)
    seen = []

    index = {id(q): i for i, q in enumerate(model.parameters())}

    def probe(st, bucket):  # DDP's first iteration has another bucket layout than the later ones
        local, order = bucket.buffer().clone(), [index[id(q)] for q in bucket.parameters()]
        return onebit_hook(st, bucket).then(lambda f: (seen.append((local, f.value().clone(), order)),
                                                       f.value())[1])

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
        seen, model, _, _ = _run(rank, STEPS, normalize)
        out[normalize] = {"seen": seen, "params": [q.detach().clone() for q in model.parameters()]}
    _, model, opt, hook = _run(rank, START - 1)  # stop before compression starts
    sd = hook.state_dict()
    _, model, _, _ = _run(rank, STEPS - START + 1, state=sd, first=START - 1,
                          model_state=model.state_dict(), opt_state=opt.state_dict())
    out["resumed"] = [q.detach().clone() for q in model.parameters()]
    out["saved_stats"] = len(sd["grad_stats"])
    return out


def _relayout(flat, order, layout):
    """A bucket of the parameters `order` (their numbers in the model) in `layout`'s order."""
    numels = [q.numel() for q in _model().parameters()]
    pieces = dict(zip(order, flat.split([numels[i] for i in order])))
    return torch.cat([pieces[i] for i in layout])


def _expected(res, normalize):
    """Every iteration's reduced bucket by the reference, from the ranks' local buckets."""
    locals_ = [[res[r][normalize]["seen"][t][0] for r in range(P)] for t in range(STEPS)]
    averaged = [torch.stack(x).sum(0) / P for x in locals_[:START]]
    w = None
    if normalize == "warmup":
        layout = res[0][normalize]["seen"][START][2]  # the compressed (rebuilt) bucket's parameters
        got = [_relayout(*res[0][normalize]["seen"][t][1:], layout) for t in range(START)]  # what the statistics saw
        rms = torch.stack([g * g for g in got]).sum(0).div(len(got)).sqrt()
        w = torch.maximum(rms, 0.1 * rms.square().mean().sqrt())
        w = torch.where(w > 0, w, torch.ones_like(w))
    n = locals_[0][0].numel()
    m = R.chunk_size(n, P)
    we, se = [torch.zeros(P, m) for _ in range(P)], [torch.zeros(m) for _ in range(P)]
    out = averaged
    for t in range(START, STEPS):
        xs = [x / w for x in locals_[t]] if w is not None else locals_[t]
        red, we, se = R.compressed_allreduce(xs, we, se, BLOCK)
        out.append(red * w if w is not None else red)
    return out, w


def test_hook_normalize_matches_reference_and_resumes_bitwise():
    res = run_ranks(_scenarios, P, timeout=240)
    for normalize in ("warmup", None):
        expected, w = _expected(res, normalize)
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
        assert res[r]["saved_stats"] == 4  # one entry per parameter
        assert all(torch.equal(x, y) for x, y in zip(res[r]["resumed"], res[r]["warmup"]["params"])), \
            f"rank {r}: resumed before start_iter differs from the straight run"
    assert math.isfinite(float(res[0]["warmup"]["seen"][-1][1].sum()))
