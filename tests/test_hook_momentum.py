"""`onebit_hook` with momentum= and normalize="adaptive" on 2 real gloo ranks,
against a plain re-computation with the pure-torch reference allreduce
(`lbcomm.testing.kernels.compressed_allreduce`), step by step:

* every rank compresses x_r = g_r + mu m_r (its own momentum, started from the momentum of
  the averaged gradients over the full-precision start) divided by w, and the hook returns
  m^_t - mu m^_{t-1} with m^ the decoded mean (times w);
* w comes from an EMA of the ranks' mean squares of x, factored per matrix into rows x
  columns (w = sqrt(r / sum r) sqrt(c)^T), started from the start's averaged gradients, floored at 0.1 x its RMS; the
  error feedback is rescaled by w_old / w_new whenever w changes;
* a checkpoint taken after compression started resumes bitwise; NaN on one rank skips the
  bucket on both ranks and leaves every state untouched (the run equals one without that
  iteration).
"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_util import run_ranks
from lbcomm.testing import kernels as R
from lbcomm.config import CommConfig
from lbcomm.ddp import OneBitHookState, onebit_hook
from test_hook_normalize import _model, _relayout

P, START, STEPS, BLOCK, MU, BETA = 2, 3, 7, 256, 0.9, 0.99
OPTS = dict(normalize="adaptive", momentum=MU, normalize_beta=BETA, comm=CommConfig(block_size=BLOCK, exact_numel=0))


def _batch(s, rank):
    g = torch.Generator().manual_seed(100 * s + rank)
    x = torch.randn(16, 24, generator=g)
    x = x * (torch.rand(24, generator=torch.Generator().manual_seed(7)) < 0.3)  # rarely active inputs
    return x, torch.randint(0, 3, (16,), generator=g)


def _run(rank, steps, first=0, resume=None, nan_at=None, drop=None):
    """(per-iteration (local bucket, reduced bucket, order), model, opt, hook). nan_at: the
    iteration at which rank 1's loss is NaN (the step is skipped, as GradScaler would);
    drop: an iteration left out altogether."""
    model = _model()
    if resume is not None:
        model.load_state_dict(resume[0])
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=MU)
    hook = OneBitHookState(START, **OPTS)
    if resume is not None:
        opt.load_state_dict(resume[1])
        hook.load_state_dict(resume[2])
    seen = []
    index = {id(q): i for i, q in enumerate(model.parameters())}

    def probe(st, bucket):
        local, order = bucket.buffer().clone(), [index[id(q)] for q in bucket.parameters()]
        return onebit_hook(st, bucket).then(lambda f: (seen.append((local, f.value().clone(), order)),
                                                       f.value())[1])

    ddp.register_comm_hook(hook, probe)
    for s in range(first, first + steps):
        if s == drop:
            continue
        x, y = _batch(s, rank)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        if s == nan_at and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        if all(bool(torch.isfinite(q.grad).all()) for q in model.parameters()):
            opt.step()
    return seen, model, opt, hook


def _scenarios(rank, p):
    seen, model, _, hook = _run(rank, STEPS)
    out = {"seen": seen, "params": [q.detach().clone() for q in model.parameters()],
           "bytes": hook.compression_stats()["bytes_sent"]}
    mid = START + 2
    _, model, opt, hook = _run(rank, mid)
    ckpt = (model.state_dict(), opt.state_dict(), hook.state_dict())
    _, model, _, _ = _run(rank, STEPS - mid, first=mid, resume=ckpt)
    out["resumed"] = [q.detach().clone() for q in model.parameters()]
    seen_nan, model, _, hook = _run(rank, STEPS + 1, nan_at=START + 1)
    out["nan"] = [q.detach().clone() for q in model.parameters()]
    out["nan_bucket"] = seen_nan[START + 1][1]
    out["nan_skipped"] = hook.skipped_calls
    _, model, _, _ = _run(rank, STEPS + 1, drop=START + 1)
    out["dropped"] = [q.detach().clone() for q in model.parameters()]
    return out


def _squares(x, shapes):
    """Rows and columns of x^2 per matrix, x^2 for vectors (an independent re-statement)."""
    out, at = [], 0
    for shp in shapes:
        n = int(torch.tensor(shp).prod())
        v = (x[at:at + n] ** 2)
        at += n
        out += [v.view(shp[0], -1).sum(1), v.view(shp[0], -1).sum(0)] if len(shp) == 2 else [v]
    return torch.cat(out)


def _weights(stats, shapes):
    out, at = [], 0
    for shp in shapes:
        if len(shp) == 2:
            r, c = stats[at:at + shp[0]], stats[at + shp[0]:at + shp[0] + shp[1]]
            at += shp[0] + shp[1]
            out.append(((r / r.sum()).sqrt()[:, None] * c.sqrt()[None, :]).reshape(-1))
        else:
            out.append(stats[at:at + shp[0]].sqrt())
            at += shp[0]
    w = torch.cat(out)
    return torch.maximum(w, 0.1 * w.square().mean().sqrt())


def _expected(res):
    layout = res[0]["seen"][START][2]
    shapes = [tuple(q.shape) for q in _model().parameters()]
    shapes = [shapes[i] for i in layout]
    avg = [_relayout(*res[0]["seen"][t][1:], layout) for t in range(START)]  # the start's averaged gradients
    mom = avg[0].clone()
    for g in avg[1:]:
        mom = torch.add(g, mom, alpha=MU)
    ema = _squares(torch.stack(avg).square().sum(0).div(START).sqrt(), shapes)
    local, decoded, w_old = [mom.clone() for _ in range(P)], mom.clone(), None
    n = avg[0].numel()
    m = R.chunk_size(n, P)
    we, se = [torch.zeros(P, m) for _ in range(P)], [torch.zeros(m) for _ in range(P)]
    out = []
    for t in range(START, STEPS):
        xs = [torch.add(res[r]["seen"][t][0], local[r], alpha=MU) for r in range(P)]
        total = _squares(xs[0], shapes)
        for x in xs[1:]:  # 2 ranks: a + b, whatever order the reduction takes
            total = total + _squares(x, shapes)
        ema = torch.add(total / P * (1 - BETA), ema, alpha=BETA)
        w = _weights(ema, shapes)
        if w_old is not None:
            ratio = w_old / w
            for r in range(P):
                we[r].view(-1)[:n] *= ratio
                lo = min(n, r * m)
                se[r][:min(n, lo + m) - lo] *= ratio[lo:lo + m]
        red, we, se = R.compressed_allreduce([x / w for x in xs], we, se, BLOCK)
        dec = red * w
        out.append(dec - MU * decoded)
        decoded, local, w_old = dec, xs, w
    return out, w


def test_hook_momentum_adaptive_matches_reference_resumes_and_skips():
    res = run_ranks(_scenarios, P, timeout=240)
    expected, w = _expected(res)
    for r in range(P):
        for t in range(START, STEPS):
            got, want = res[r]["seen"][t][1], expected[t - START]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()),
                                       msg=lambda msg: f"rank {r}, iteration {t}: {msg}")
            assert torch.equal(got, res[0]["seen"][t][1])  # replicas identical
        assert all(torch.equal(a, b) for a, b in zip(res[r]["resumed"], res[r]["params"])), \
            f"rank {r}: resumed after the start differs from the straight run"
        assert bool(res[r]["nan_bucket"].isnan().all()) and res[r]["nan_skipped"] == 1
        assert all(torch.equal(a, b) for a, b in zip(res[r]["nan"], res[r]["dropped"])), \
            f"rank {r}: a skipped NaN bucket changed some state"
    assert float(w.max() / w.min()) > 3  # the weights differ between coordinates
    # the statistics' allreduce is counted: 2 matrices (rows + columns) and 2 biases, 4 B each, a ring of 2
    stats_bytes = 4 * ((48 + 24) + 48 + (3 + 48) + 3)
    assert res[0]["bytes"] > (STEPS - START) * stats_bytes


def test_hook_momentum_options_are_checked():
    import pytest
    for bad in (dict(momentum=1.0), dict(momentum=-0.1), dict(momentum=True), dict(normalize="always"),
                dict(normalize_beta=1.0), dict(normalize_beta=-1)):
        with pytest.raises(ValueError):
            OneBitHookState(**bad)
    assert OneBitHookState(momentum=0, normalize="adaptive").momentum == 0.0


def test_hook_momentum_elastic_redistribution():
    """Another world size: every new rank's momentum is the mean of the saved ranks' (the
    mean momentum is what the ranks compress together); the shared state is kept."""
    from lbcomm.compressed import chunk_size
    from lbcomm.compressed import CompressionState
    from lbcomm.ddp.units import redistribute_units
    n, old = 10, 2
    m = chunk_size(n, old)
    shared = {"decoded": torch.arange(n, dtype=torch.float32), "ema": torch.ones(7)}
    sds = []
    for r in range(old):
        comp = {"numel": n, "world_size": old, "rank": r, "block_size": 32, "worker_error": torch.full((old, m), r + 1.0),
                "server_error": torch.full((m,), 10.0 * (r + 1))}
        tr = {"momentum": MU, "adaptive": True, "local": torch.full((n,), 2.0 * r), **shared}
        sds.append([{"params": [0, 1], "shapes": [(2, 3), (4,)], "compression": comp, "weights": torch.ones(n),
                     "transform": tr}])
    for rank in range(3):
        (unit,) = redistribute_units(sds, 3, rank, CompressionState.redistribute)
        assert torch.equal(unit["transform"]["local"], torch.full((n,), 1.0))
        assert torch.equal(unit["transform"]["decoded"], shared["decoded"])
        assert unit["compression"]["world_size"] == 3 and torch.equal(unit["weights"], torch.ones(n))
