"""lbcomm.stats: the noise-scale estimators against exact values from every rank's gathered
gradients (plain loop, the 1-bit optimizers in warmup and compression stage, DDP hooks),
AdaScale's gain and resume, and the batch-size controller's decisions."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from lbcomm.stats import (AdaScale, BatchSizeController, GradientNoiseScale, adascale_gain, noise_estimates)

from dist_util import run_ranks


# ---------------------------------------------------------------------- reference (plain torch)
def reference_estimates(per_rank, local_batch):
    """(|G|^2, tr(Sigma)) from every rank's flat local gradient, written out from the
    definitions: mean of the local squared norms, squared norm of the mean."""
    g = torch.stack([x.double() for x in per_rank])
    local = (g * g).sum(1).mean()
    mean = g.mean(0)
    glob = (mean * mean).sum()
    b, B = local_batch, local_batch * g.shape[0]
    return float((B * glob - b * local) / (B - b)), float((local - glob) / (1 / b - 1 / B))


def reference_sketch(per_rank, local_batch, k, seed, draw):
    """The same estimates from the coordinate sample that lbcomm.stats draws at `draw`."""
    n = per_rank[0].numel()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + draw)
    idx = torch.randint(0, n, (k,), generator=gen).sort().values
    return reference_estimates([x[idx] * math.sqrt(n / k) for x in per_rank], local_batch)


def test_estimators_unbiased():
    """Monte Carlo: per-sample gradients G + noise with known covariance; the mean of the
    unsmoothed estimates over many draws is |G|^2 and tr(Sigma)."""
    gen = torch.Generator().manual_seed(0)
    n, p, b, trials = 16, 4, 3, 4000
    G = torch.randn(n, generator=gen, dtype=torch.float64)
    sd = torch.rand(n, generator=gen, dtype=torch.float64) * 2
    samples = G + sd * torch.randn(trials, p, b, n, generator=gen, dtype=torch.float64)
    local = samples.mean(2)  # each rank's gradient over its b samples
    lsq = (local ** 2).sum(-1).mean(-1)
    gsq = (local.mean(1) ** 2).sum(-1)
    g2, tr = noise_estimates(lsq, gsq, b, b * p)
    se_g, se_t = g2.std() / trials ** 0.5, tr.std() / trials ** 0.5
    assert abs(float(g2.mean()) - float(G @ G)) < 4 * se_g
    assert abs(float(tr.mean()) - float((sd ** 2).sum())) < 4 * se_t
    with pytest.raises(ValueError, match="at least 2 ranks"):
        noise_estimates(1.0, 1.0, 8, 8)


def test_sketch_unbiased():
    """The coordinate sample's squared norm is |g|^2 in expectation, over all parameters."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(300, generator=gen) * 3, None, torch.randn(7, 11, generator=gen), torch.randn(50)]
    exact = sum(float(g.double().square().sum()) for g in grads if g is not None)
    s = GradientNoiseScale(4, sketch_size=64)
    vals = torch.tensor([float(s.measure(grads, exact=False)[1]) for _ in range(3000)], dtype=torch.float64)
    assert abs(float(vals.mean()) - exact) < 4 * float(vals.std()) / 3000 ** 0.5
    v = s.measure(grads, exact=False)
    # the sample alone is read: its squared norm stands for the local one too
    assert v.numel() == 66 and float(v[0]) == float(v[1]) == pytest.approx(float(v[2:].square().sum()), rel=1e-6)
    big = GradientNoiseScale(4, sketch_size=10_000)  # more slots than coordinates: all of them, exactly
    w = big.measure(grads, exact=False)
    assert float(w[1]) == pytest.approx(exact, rel=1e-5) and w.numel() == 2 + 300 + 77 + 50


def test_gain_and_adascale_resume():
    # gain: 1 with no noise, s with no signal, the formula in between, monotone in the batch
    assert adascale_gain(1.0, 0.0, 32, 128) == 1.0
    assert adascale_gain(0.0, 5.0, 32, 128) == 4.0
    assert adascale_gain(2.0, 64.0, 32, 128) == pytest.approx((2 + 2) / (0.5 + 2))
    assert adascale_gain(-1.0, 64.0, 32, 128) == 4.0
    gains = [adascale_gain(1.0, 100.0, 32, B) for B in (32, 64, 128, 256)]
    assert gains[0] == 1.0 and all(a < b for a, b in zip(gains, gains[1:])) and gains[-1] <= 8

    def make(model_state=None):
        torch.manual_seed(0)
        model = nn.Linear(5, 3)
        if model_state is not None:
            model.load_state_dict(model_state)
        stats = GradientNoiseScale(8, beta=0.9)
        opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), stats, base_batch=8, batch=32)
        return model, stats, opt

    def run(split):
        model, stats, opt = make()
        gen = torch.Generator().manual_seed(3)
        gains = []
        for step in range(10):
            if step == split:  # a fresh process: new objects from the checkpoint
                sd = {k: v for k, v in opt.state_dict().items()}
                model, stats, opt = make({k: v.clone() for k, v in model.state_dict().items()})
                opt.load_state_dict(sd)
            x = torch.randn(32, 5, generator=gen)
            opt.zero_grad()
            model(x).square().mean().backward()
            # constructed statistics: 4 ranks whose local squared norms exceed the global one
            gsq = sum(float(p.grad.square().sum()) for p in model.parameters())
            stats.observe(torch.tensor([gsq * (1.5 + 0.1 * step)]), 4, gsq)
            opt.step()
            gains.append(opt.gain)
        return model.weight.detach().clone(), opt.scale_invariant_steps, gains, stats.noise_scale

    w0, tau0, gains0, ns0 = run(split=None)
    w1, tau1, gains1, ns1 = run(split=4)
    assert torch.equal(w0, w1) and tau0 == tau1 and gains0 == gains1 and ns0 == ns1
    assert all(1.0 < g <= 4.0 for g in gains0) and tau0 == pytest.approx(sum(gains0))


def test_batch_controller_decisions():
    stats = GradientNoiseScale(4, beta=0.0)  # no smoothing: each observation is the estimate

    def feed(grad_sq, trace, world=4):
        b = stats.local_batch
        B = b * world
        # invert the estimators: local = |G|^2 + tr/b, global = |G|^2 + tr/B
        stats.observe(torch.tensor([grad_sq + trace / b]), world, grad_sq + trace / B)

    ctl = BatchSizeController(stats, micro_batch=4, world_size=4, eta=1.0, max_batch=256, max_growth=4.0)
    assert ctl.global_batch == 16 and ctl.update() == 16  # nothing observed: the test passes
    feed(1.0, 10.0)  # tr/B = 0.625 <= 1: passes
    assert ctl.norm_test() and ctl.update() == 16 and ctl.accumulation_steps == 1
    feed(1.0, 40.0)  # wants ceil(40) -> 48 (3 accumulation steps of 4 x 4)
    assert stats.grad_sq == pytest.approx(1.0) and stats.trace_sigma == pytest.approx(40.0)
    assert not ctl.norm_test() and ctl.update() == 48 and ctl.accumulation_steps == 3 and stats.local_batch == 12
    feed(0.5, 1000.0)  # wants 2000: limited to 4x = 192
    assert ctl.update() == 192 and ctl.accumulation_steps == 12
    feed(0.1, 1e6)  # wants far more: limited by max_batch 256
    assert ctl.update() == 256 and ctl.accumulation_steps == 16
    feed(1.0, 1.0)  # passes easily: never shrinks
    assert ctl.update() == 256
    assert ctl.history == [(3, 48), (4, 192), (5, 256)]
    ctl2 = BatchSizeController(GradientNoiseScale(4), micro_batch=4, world_size=4)
    ctl2.load_state_dict(ctl.state_dict())
    assert ctl2.global_batch == 256 and ctl2.stats.local_batch == 64


# ---------------------------------------------------------------------- 4 gloo ranks
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _local_grad(model, x, y):
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _gather(flat):
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def _ranks_check(rank, p):
    import lbcomm
    from lbcomm.ddp import OneBitHookState, onebit_hook
    from lbcomm.stats import StatsHookState, allreduce_gradients_, stats_hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    b = 5
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(b, 6, generator=gen), torch.randn(b, 3, generator=gen)) for _ in range(6)]
    out = {"plain": [], "onebit": [], "ddp_exact": [], "ddp_sketch": []}

    # (1) a plain loop: allreduce_gradients_ averages the grads and measures exactly
    model = _model()
    stats = GradientNoiseScale(b, beta=0.5)
    for x, y in batches[:3]:
        ref = reference_estimates(_gather(_local_grad(model, x, y)), b)
        allreduce_gradients_(model.parameters(), stats)
        out["plain"].append((stats.last["grad_sq"], stats.last["trace_sigma"]) + ref)
        with torch.no_grad():
            for q in model.parameters():
                q -= 0.1 * q.grad

    # (2) OneBitAdam: warmup (exact) then the compression stage (coordinate sample of 40 of 163)
    model, twin = _model(), _model()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    stats = opt.gradient_stats = GradientNoiseScale(b, sketch_size=40, seed=7)
    for x, y in batches:
        twin.load_state_dict(model.state_dict())
        local = _gather(_local_grad(twin, x, y))
        draw = stats.draws + 1
        exact = not opt.frozen
        _local_grad(model, x, y)
        opt.step()
        ref = reference_estimates(local, b) if exact else reference_sketch(local, b, 40, 7, draw)
        out["onebit"].append((exact, stats.last["grad_sq"], stats.last["trace_sigma"]) + ref
                             + reference_estimates(local, b))

    # (3) DDP: torch's allreduce hook (exact), and onebit_hook after start_iter (sample >= bucket: exact values)
    for key, exact in (("ddp_exact", True), ("ddp_sketch", False)):
        model, twin = _model(), _model()
        ddp = DDP(model)
        stats = GradientNoiseScale(b, sketch_size=10_000)
        if exact:
            hook_state = StatsHookState(stats, allreduce_hook, None, exact=True)
        else:
            hook_state = StatsHookState(stats, onebit_hook, OneBitHookState(2),
                                        exact=False)
        ddp.register_comm_hook(hook_state, stats_hook)
        sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for x, y in batches[:4]:
            twin.load_state_dict(model.state_dict())
            local = _gather(_local_grad(twin, x, y))
            sgd.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            sgd.step()
            hook_state.flush()  # the next backward would fold this step in; read it now
            out[key].append((stats.last["grad_sq"], stats.last["trace_sigma"]) + reference_estimates(local, b))
    return out


def test_estimates_match_gathered_gradients():
    res = run_ranks(_ranks_check, 4, timeout=120)
    for rank_out in res:
        for got_g, got_t, ref_g, ref_t in rank_out["plain"]:
            assert got_g == pytest.approx(ref_g, rel=1e-4, abs=1e-7) and got_t == pytest.approx(ref_t, rel=1e-4)
        stages = [row[0] for row in rank_out["onebit"]]
        assert stages == [True, True, False, False, False, False]
        for exact, got_g, got_t, ref_g, ref_t, _, _ in rank_out["onebit"]:
            assert got_g == pytest.approx(ref_g, rel=1e-4, abs=1e-6) and got_t == pytest.approx(ref_t, rel=1e-4)
        for key in ("ddp_exact", "ddp_sketch"):
            assert len(rank_out[key]) == 4
            for got_g, got_t, ref_g, ref_t in rank_out[key]:
                assert got_g == pytest.approx(ref_g, rel=1e-4, abs=1e-6) and got_t == pytest.approx(ref_t, rel=1e-4)
    for key in ("plain", "onebit", "ddp_exact", "ddp_sketch"):  # every rank holds the same statistics
        assert res[0][key] == res[3][key]
