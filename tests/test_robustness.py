"""Regression guard for the compression stage's robustness (docs/concepts.md, "Robustness").

Short runs of the suite's tasks (bench/tasks.py) on 4 real gloo ranks, real optimizers,
at learning rates where the published 1-bit Adam / 1-bit LAMB blow up while AdamW / LAMB
converge: coordinates of rarely active input features and of rarely seen embedding rows
have a frozen variance far below their block's, and sign compression gives them the
block's magnitude.

Tests named ``test_integration_*`` check the rule (``max_update``) through the PUBLIC
optimizer API, with the defaults (max_update=1.0 for both ``lbcomm.OneBitAdam`` and
``lbcomm.OneBitLamb``) and with max_update=None, the published algorithm, whose blow-up
they must still see (so the guard can fail).

Bounds at the first compressed step:
    OneBitAdam:  |dp_i| <= lr (1 + wd |p_i|)
    OneBitLamb:  |dp_i| <= lr max_coeff factor_max (1 + wd |p_i|)
"""
import math
from types import SimpleNamespace

import pytest
import torch

from dist_util import run_ranks

# (task, method, lr, extra options): lrs at which the published rule blows up on these tasks
# (bench/suite.py --quick on main: first compressed updates of 1e3-1e5 lr; NaN on dead_relu at
# every lr and on zipf_embed at the largest lrs, where AdamW / Lamb do best)
CASES = [
    ("rare_features", "onebit_adam", 0.03, None),
    ("rare_features", "onebit_lamb", 0.1, None),
    ("rare_features", "onebit_adam", 0.03, {"max_update": None, "exact_numel": 0}),  # the published algorithm
    ("dead_relu", "adamw", 0.03, None),
    ("dead_relu", "onebit_adam", 0.03, None),
    ("dead_relu", "lamb", 0.1, None),
    ("dead_relu", "onebit_lamb", 0.1, None),
    ("zipf_embed", "adamw", 0.03, None),
    ("zipf_embed", "onebit_adam", 0.03, None),
    ("zipf_embed", "lamb", 0.1, None),
    ("zipf_embed", "onebit_lamb", 0.1, None),
    ("dead_relu", "zeroone", 0.03, None),  # 0/1 Adam: its variance steps after 1-bit steps are bounded too
    ("zipf_embed", "zeroone", 0.03, None),
]


def _runs(rank, world, cases):
    from bench import suite
    from bench import tasks as T

    out = []
    for name, method, lr, extra in cases:
        task = T.make_task(name, quick=True)
        a = SimpleNamespace(onebit_options=extra or {}, hook_options={}, zeroone_options={})
        out.append(suite.one_run(rank, world, task, method, lr, a))
    return out


@pytest.fixture(scope="module")
def results():
    res = run_ranks(_runs, 4, CASES, timeout=300)
    return {(c[0], c[1], c[2], str(c[3])): r for c, r in zip(CASES, res[0])}


def _get(results, task, method, lr, extra=None):
    return results[(task, method, lr, str(extra))]


def test_suite_tasks_are_deterministic_and_the_simulation_matches_the_reference():
    from bench import robust_sim
    from bench import tasks as T

    t1, t2 = T.make_task("rare_features", quick=True), T.make_task("rare_features", quick=True)
    b1, b2 = t1.batch(7), t2.batch(7)
    assert all((x == y).all() for x, y in zip(b1, b2))
    assert not (t1.batch(8)[0] == b1[0]).all()
    assert robust_sim.check_against_reference() < 1e-5
    # --grid fine: the coarse grid's points with their geometric midpoints, for every family
    fine = T.make_task("rare_features", quick=True, grid="fine").grids
    assert fine["lamb"] == [3e-3, 5.5e-3, 1e-2, 1.7e-2, 3e-2, 5.5e-2, 1e-1]
    assert all(fine[k][::2] == v for k, v in T.GRIDS.items())
    with pytest.raises(ValueError, match="grid"):
        T.make_task("rare_features", grid="dense")
    # --steps: the run's length, over quick's; the same data
    long = T.make_task("rare_features", quick=True, steps=960)
    assert long.steps == 960 and T.make_task("rare_features").steps == 240
    assert all((x == y).all() for x, y in zip(long.batch(7), b1))
    for bad in (4, 0.5, True):
        with pytest.raises(ValueError, match="steps"):
            T.make_task("rare_features", steps=bad)


@pytest.mark.parametrize("task,lr", [("rare_features", 0.03), ("dead_relu", 0.03), ("zipf_embed", 0.03)])
def test_integration_onebit_adam_first_compressed_update_is_bounded(results, task, lr):
    """The published rule moves some coordinate by 1e3-1e5 lr here."""
    r = _get(results, task, "onebit_adam", lr)
    assert r["first_update_ratio"] is not None, r
    bound = 1.0 + 0.01 * r["param_max_at_first_update"]
    assert r["first_update_ratio"] <= bound * (1 + 1e-4), (
        f"a coordinate moved {r['first_update_ratio']:.3g} lr at the first compressed step (bound {bound:.3g} lr)")


def test_integration_onebit_lamb_first_compressed_update_is_bounded(results):
    """The published rule moves some coordinate by orders of magnitude more here."""
    r = _get(results, "rare_features", "onebit_lamb", 0.1)
    bound = 10.0 * 4.0 * (1.0 + 0.01 * r["param_max_at_first_update"])
    assert r["first_update_ratio"] <= bound * (1 + 1e-4), (
        f"a coordinate moved {r['first_update_ratio']:.3g} lr at the first compressed step (bound {bound:.3g} lr)")


@pytest.mark.parametrize("task,method,twin,lr", [
    ("dead_relu", "onebit_adam", "adamw", 0.03),
    ("dead_relu", "onebit_lamb", "lamb", 0.1),
    ("zipf_embed", "onebit_adam", "adamw", 0.03),
    ("zipf_embed", "onebit_lamb", "lamb", 0.1),
    ("dead_relu", "zeroone", "adamw", 0.03),
    ("zipf_embed", "zeroone", "adamw", 0.03),
])
def test_integration_no_divergence_where_the_full_precision_twin_converges(results, task, method, twin, lr):
    """The published rule ends above its initial loss, or in NaN, here."""
    base = _get(results, task, twin, lr)
    assert not base["diverged"] and base["final"] < base["init"], f"{twin} itself diverged: {base}"
    r = _get(results, task, method, lr)
    assert not r["diverged"] and math.isfinite(r["final"]) and r["final"] < r["init"], (
        f"{method} diverged on {task} at lr {lr} where {twin} converged: {r['final']} from {r['init']} "
        f"({twin}: {base['final']})")
    assert r["final"] <= 1.15 * base["final"], f"{method} {r['final']:.4f} vs {twin} {base['final']:.4f}"


def test_integration_the_published_rule_stays_available(results):
    """max_update=None is the published algorithm, blow-up included (the failure mode this
    guard is about, so the guard itself can fail)."""
    r = _get(results, "rare_features", "onebit_adam", 0.03, {"max_update": None, "exact_numel": 0})
    assert r["first_update_ratio"] > 100, r


def test_suite_ranks_lrs_by_the_mean_over_batch_orders():
    """--repeats: one record per (task, method, lr), the mean of its orders' final losses; an
    lr that diverged in any order is diverged; bad counts are refused."""
    from bench import suite

    def rec(lr, final, diverged=None, ratio=None):
        return {"task": "t", "method": "sgd", "lr": lr, "final": final, "init": 2.0, "diverged": diverged,
                "first_update_ratio": ratio}

    runs = [rec(0.1, 1.0, ratio=0.5), rec(0.1, 0.5, ratio=0.25), rec(0.3, 0.4), rec(0.3, float("nan"), diverged=7)]
    by_lr = {r["lr"]: r for r in suite.over_orders(runs)}
    assert by_lr[0.1]["final"] == 0.75 and by_lr[0.1]["finals"] == [1.0, 0.5]
    assert by_lr[0.1]["first_update_ratio"] == 0.5
    assert by_lr[0.3]["diverged"] == 7 and suite.is_diverged(by_lr[0.3])
    assert suite.summarize(runs)["t"]["sgd"][:2] == (0.75, 0.1)  # 0.3's best single run (0.4) does not count
    for bad in (["--repeats", "0"], ["--hook-options", "[1]"], ["--onebit-options", "{bad"],
                ["--lars-options", '{"exclude_over": "big"}'], ["--lars-options", '{"exclude_over": -1}']):
        with pytest.raises(SystemExit):  # refused when the command line is read, not on the ranks
            suite.parse_args(bad)
    assert suite.parse_args(["--hook-options", '{"block_size": 256}']).hook_options == {"block_size": 256}
    assert suite.parse_args([]).onebit_options == {}
    # the fine grid by default (the coarse one's best also measures where between its points a
    # method's best lr falls); --quick, the regression guard, keeps the coarse grid
    assert [suite.parse_args(x).grid for x in ([], ["--quick"], ["--quick", "--grid", "fine"])] == \
        ["fine", "coarse", "fine"]
    ex = suite.lars_options(suite.parse_args(["--lars-options", '{"exclude_over": 4096, "eps": 0.0}']))
    assert ex["eps"] == 0.0 and [ex["exclude_from_adaptation"](torch.zeros(s)) for s in ((8,), (64, 64), (65, 64))] \
        == [True, False, True]
    from bench import tasks as T

    batches = T.make_task("dead_relu", quick=True).batch
    assert suite.in_order(batches, 0) is batches
    x0, x1, x1_again = batches(3)[0], suite.in_order(batches, 1)(3)[0], suite.in_order(batches, 1)(3)[0]
    assert torch.equal(x1, x1_again) and not torch.equal(x0, x1)


def test_suite_reports_the_ratio_at_every_lr_of_the_grid():
    """The same-lr table: 1-bit / twin at each lr; a cell where the twin diverged is marked and
    not counted, one where only the 1-bit method diverged is the worst; the schedules."""
    from bench import suite
    from bench import tasks as T

    def rec(method, lr, final, diverged=None):
        return {"task": "t", "method": method, "lr": lr, "final": final, "init": 2.0, "diverged": diverged,
                "first_update_ratio": None}

    runs = [rec("lamb", 0.01, 1.0), rec("onebit_lamb", 0.01, 1.1), rec("lamb", 0.03, 0.5), rec("onebit_lamb", 0.03, 0.4),
            rec("lamb", 0.1, 3.0), rec("onebit_lamb", 0.1, 1.5)]  # Lamb worse than at init at 0.1: diverged
    row = suite.same_lr(runs)["t"]["onebit_lamb"]
    assert [c[0] for c in row["cells"]] == [0.01, 0.03, 0.1] and row["cells"][2] == [0.1, None, "twin-div"]
    assert abs(row["cells"][0][1] - 1.1) < 1e-12 and abs(row["cells"][1][1] - 0.8) < 1e-12
    assert row["worst_lr"] == 0.01 and abs(row["worst"] - 1.1) < 1e-12
    assert suite.summarize(runs)["t"]["onebit_lamb"][:2] == (0.4, 0.03)  # best of grid: 0.4 / 0.5 hides it
    a = suite.parse_args(["--methods", "lamb,onebit_lamb"])
    assert suite.report_same_lr(runs, a) == ["OneBitLamb on t: same-lr ratio 1.100 at lr 0.01 (target 1.05)"]
    runs[1] = rec("onebit_lamb", 0.01, float("nan"), diverged=5)
    row = suite.same_lr(runs)["t"]["onebit_lamb"]
    assert row["cells"][0] == [0.01, math.inf, "div"] and row["worst"] == math.inf
    assert suite.parse_args([]).schedule == "cosine"
    assert [T.schedule_factor("cosine", s, 100) for s in (0, 9)] == [T.lr_factor(s, 100, 10) for s in (0, 9)]
    assert T.schedule_factor("constant", 50, 100) == 1.0
    assert T.schedule_factor("long_warmup", 24, 100) == 0.5 and T.schedule_factor("long_warmup", 49, 100) == 1.0


def test_decay_to_zero_schedules_and_the_conv_task():
    """cosine_zero and linear: the warmup's 10 %, then a decay to zero (half the peak midway
    through the decay); the conv task: a GroupNorm CNN, deterministic data from its seed, in
    the suite's task list with the shared lr grids."""
    from bench import suite
    from bench import tasks as T

    for s in ("cosine_zero", "linear"):
        assert s in T.SCHEDULES and suite.parse_args(["--schedule", s]).schedule == s
        f = [T.schedule_factor(s, step, 100) for step in range(101)]
        assert f[0] == 0.1 and f[9] == 1.0 and f[10] == 1.0  # warmup end: the peak
        assert f[55] == pytest.approx(0.5)  # the decay's midpoint
        assert f[100] == 0.0 and 0.0 < f[99] < 0.03  # the end: zero
        assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert T.schedule_factor("cosine_zero", 32, 100) == pytest.approx(0.5 * (1 + math.cos(math.pi * 22 / 90)))
    assert T.schedule_factor("linear", 32, 100) == pytest.approx(1 - 22 / 90)
    with pytest.raises(ValueError, match="unknown schedule"):
        T.schedule_factor("cosine_zero_", 5, 100)
    assert "conv" in T.TASKS and "conv" in suite.parse_args([]).tasks
    t1, t2 = T.make_task("conv"), T.make_task("conv")
    assert t1.steps == 240 and t1.grids == T.GRIDS
    b1 = t1.batch(3)
    assert b1[0].shape == (128, 3, 16, 16) and all((x == y).all() for x, y in zip(b1, t2.batch(3)))
    model = t1.make_model()
    assert any(isinstance(m, torch.nn.GroupNorm) for m in model.modules())
    assert math.isclose(T.evaluate(t1, model), T.evaluate(t2, t2.make_model()))


def test_suite_report_over_seeds_counts_cells_over_target_where_the_twin_converged(capsys):
    """Several saved runs together: the worst cell over all of them, and the cells over the
    target, also counted among the lrs where the twin has at most CONVERGED_LEFT of its
    init-to-best drop left (twin_left)."""
    from bench import suite

    def rec(task, method, lr, final):
        return {"task": task, "method": method, "lr": lr, "final": final, "init": 2.0, "diverged": None,
                "first_update_ratio": None}

    seed0 = [rec("t", "adamw", 0.01, 1.5), rec("t", "onebit_adam", 0.01, 1.65),  # far from converged: 0.5 left
             rec("t", "adamw", 0.1, 1.0), rec("t", "onebit_adam", 0.1, 1.02)]
    seed1 = [rec("t", "adamw", 0.01, 1.1), rec("t", "onebit_adam", 0.01, 1.1),   # 0.1 left: converged
             rec("t", "adamw", 0.1, 1.0), rec("t", "onebit_adam", 0.1, 1.06)]
    left = suite.twin_left(seed0)
    assert left[("t", "adamw", 0.01)] == pytest.approx(0.5) and left[("t", "adamw", 0.1)] == 0.0
    g = suite.same_lr_over_runs([seed0, seed1])["t"]["onebit_adam"]
    assert g["worst"] == pytest.approx(1.1) and (g["worst_run"], g["worst_lr"]) == (0, 0.01)
    assert (g["cells"], g["over"], g["converged"], g["over_converged"]) == (4, 2, 3, 1)
    assert suite.target_of("byte_lm") == 1.01 and suite.target_of("t") == 1.05
    suite.report_over_runs([seed0, seed1], ["a.json", "b.json"], SimpleNamespace(methods=["adamw", "onebit_adam"]))
    out = capsys.readouterr().out
    assert "1.100 (#0 @0.01) 2/4, 1/3" in out
