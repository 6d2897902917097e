"""OneBitAdam and OneBitLamb on four real gloo ranks: against torch.optim.AdamW and Lamb in
the warmup, bitwise against the plain-torch simulation (lbcomm.testing.optim), masking,
non-finite steps and hook-averaged gradients.

The checks run in ONE spawn of four processes (`four_ranks`, module scope; the run is in
optim_four_ranks.py); every test below reads its part of the result, and a part that failed
fails only the tests that read it."""
import pytest
import torch

from lbcomm.common import ring_allreduce_bytes
from lbcomm.testing import optim as SIM
from dist_util import run_ranks, same as _same
from optim_four_ranks import SIM_RUNS, _four_rank_suite, guarded


@pytest.fixture(scope="module")
def four_ranks():
    return guarded(run_ranks(_four_rank_suite, 4, timeout=240))


def test_onebit_adam_warmup_equals_adamw_on_averaged_grads(four_ranks):
    for res in four_ranks:
        assert len(res["warmup"]["adam"]) == 60
        assert max(res["warmup"]["adam"]) <= 1e-6, res["warmup"]["adam"]
    losses = four_ranks[0]["warmup"]["losses"]
    assert sum(losses[-5:]) < sum(losses[:5])  # a real training run


def test_onebit_lamb_warmup_equals_lamb(four_ranks):
    for res in four_ranks:
        assert max(res["warmup"]["lamb"]) <= 1e-6, res["warmup"]["lamb"]


# The runs whose live ratio takes the estimated clean norm: its fp32 allreduce sums the four
# ranks' values in gloo's order, the simulation in rank order, so these meet it to that
# rounding, two ulps of a parameter near 1 (tests/test_lamb_norm.py: two ranks, where the
# order cannot matter); the others bitwise
ESTIMATED = {k for k, c in SIM_RUNS.items() if c["name"] == "lamb" and c["kw"].get("trust_ratio", "max") != "frozen"
             and c["kw"].get("norm_samples", 256) > 0}
ESTIMATE_TOL = 2.4e-7


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
        tol = ESTIMATE_TOL if run in ESTIMATED else 0.0
        assert worst <= tol, f"step {t + 1}: max |optimizer - simulation| = {worst}"
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
    the run with 4 sampled coordinates (equal to its simulation to rounding, above) ends
    elsewhere than the simulation that averages every clamped coordinate exactly, or with
    the decoded norm (norm_samples=0), or with a step bound at the lr (the estimate may then
    only lower the coefficient); the decoded-norm run ends elsewhere than "max"'s."""
    cfg, rec = SIM_RUNS["lamb_sampled"], four_ranks[0]["sim"]["lamb_sampled"]
    grads = [[four_ranks[r]["sim"]["lamb_sampled"]["grads"][t] for r in range(4)] for t in range(cfg["steps"])]

    def gap(**kw):
        hist = SIM.simulate_onebit_lamb(rec["params0"], grads, freeze_step=cfg["freeze"], **dict(cfg["kw"], **kw))
        return max((a - b).abs().max().item() for a, b in zip(hist[-1], rec["params"][-1]))

    assert gap() <= ESTIMATE_TOL
    assert gap(norm_samples=10 ** 6) > 1e-6  # more clamped coordinates than 4: the draw is a subset
    assert gap(norm_samples=0) > 1e-6
    assert gap(norm_step_bound=cfg["kw"]["lr"]) > 1e-6
    decoded, floor = four_ranks[0]["sim"]["lamb_decoded_norm"], four_ranks[0]["sim"]["lamb_max"]
    assert max((a - b).abs().max().item() for a, b in zip(decoded["params"][-1], floor["params"][-1])) > 1e-5
    # what it sends: one fp32 allreduce per parameter of 1 + samples at the edge + samples
    # drawn uniformly (the default trust_ratio, "aligned"), in bytes_per_step
    sent = rec["bytes"]
    assert sent["norm_estimate"] == ring_allreduce_bytes(4 * 9 * len(rec["params0"]), 4)
    assert sent["total"] == sent["compressed"] + sent["exact"] + sent["agreement"] + sent["norm_estimate"]
    assert decoded["bytes"]["norm_estimate"] == 0
    # compression_stats counts what the compressed calls sent: the step's own agreement
    # replaces the reducer's, so no agreement bytes per call there
    stats = rec["stats"]
    assert stats["compressed_calls"] == cfg["steps"] - cfg["freeze"]
    assert stats["bytes_sent"] == stats["compressed_calls"] * sent["compressed"]


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


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_exact_numel_takes_effect(four_ranks, name):
    """The exact runs equal their simulation (above); the same gradients with every
    parameter compressed end elsewhere, so the exact averaging did something."""
    cfg, key = SIM_RUNS[f"{name}_exact"], f"{name}_exact"
    recs = [r["sim"][key] for r in four_ranks]
    grads = [[recs[r]["grads"][t] for r in range(4)] for t in range(cfg["steps"])]
    simulate = SIM.simulate_onebit_adam if name == "adam" else SIM.simulate_onebit_lamb
    compressed = simulate(recs[0]["params0"], grads, freeze_step=cfg["freeze"], **dict(cfg["kw"], exact_numel=0))
    assert max((a - b).abs().max().item() for a, b in zip(compressed[-1], recs[0]["params"][-1])) > 1e-6
