"""Regression guard for the same-lr parity of the 1-bit optimizers (docs/optimizers.md,
"Same hyperparameters as the twin").

A user who swaps Lamb for OneBitLamb, or AdamW for OneBitAdam or ZeroOneAdam, keeps the lr
they tuned.
Short runs of the suite's quick tasks (bench/tasks.py, 80 steps, 4 real gloo ranks, the
suite's cosine schedule, seed 0) at one lr per task: the final validation loss
of the 1-bit optimizer at its defaults over its twin's at the same lr must stay under
LIMITS. The runs are deterministic (the same data, weights and reduction order), so each
limit is the ratio bench.suite measured for that cell plus a margin of 0.02 (rounded up
to the next 0.01) — what a regression in the defaults would cross, and what different
CPUs' float rounding does not (bench/studies.md, "Same-lr parity").
"""
import json
import math
import re

import pytest

from dist_util import run_ranks

# the lr of each quick task where the same-lr ratio was worst over the coarse grid
# (bench.suite --quick, seed 0: bench/results/suite_quick_lamb_max_seed0.json and
# suite_quick_rescale_cap_seed0.json)
LAMB_LRS = {"rare_features": 0.03, "dead_relu": 0.1, "zipf_embed": 0.03}
ADAM_LRS = {"rare_features": 0.003, "dead_relu": 0.003, "zipf_embed": 0.03}
PAIRS = {"onebit_lamb": "lamb", "zeroone": "adamw", "onebit_adam": "adamw"}
# (task, method): the largest same-lr ratio 1-bit / twin accepted (measured + 0.02, rounded up):
# OneBitLamb 1.021 / 1.066 / 1.017, ZeroOneAdam 1.017 / 1.031 / 1.049, OneBitAdam 1.012 /
# 1.028 / 1.031 (the capped decode, CommConfig.capped_decode; with the step's clamp alone
# OneBitLamb measured 1.052 / 1.061 / 1.044, ZeroOneAdam 1.048 / 1.046 / 1.117 and
# OneBitAdam 1.042 / 1.039 / 1.074 here)
LIMITS = {
    ("rare_features", "onebit_lamb"): 1.05, ("dead_relu", "onebit_lamb"): 1.09, ("zipf_embed", "onebit_lamb"): 1.04,
    ("rare_features", "zeroone"): 1.04, ("dead_relu", "zeroone"): 1.06, ("zipf_embed", "zeroone"): 1.07,
    ("rare_features", "onebit_adam"): 1.04, ("dead_relu", "onebit_adam"): 1.05, ("zipf_embed", "onebit_adam"): 1.06,
}


def _cases():
    out = []
    for task, lr in LAMB_LRS.items():
        out += [(task, "lamb", lr), (task, "onebit_lamb", lr)]
    for task, lr in ADAM_LRS.items():
        out += [(task, "adamw", lr), (task, "zeroone", lr), (task, "onebit_adam", lr)]
    return out


def _runs(rank, world, cases):
    from types import SimpleNamespace

    from bench import suite
    from bench import tasks as T

    a = SimpleNamespace(onebit_options={}, hook_options={}, zeroone_options={}, schedule="cosine")
    return [suite.one_run(rank, world, T.make_task(task, quick=True), method, lr, a) for task, method, lr in cases]


@pytest.fixture(scope="module")
def finals():
    cases = _cases()
    res = run_ranks(_runs, 4, cases, timeout=900)[0]
    return {(task, method): r for (task, method, _), r in zip(cases, res)}


@pytest.mark.parametrize("task,method", list(LIMITS))
def test_same_lr_ratio_stays_within_its_limit(finals, task, method):
    from bench import suite

    twin, mine = finals[(task, PAIRS[method])], finals[(task, method)]
    assert not suite.is_diverged(twin), f"{PAIRS[method]} itself diverged on {task}: {twin}"
    assert not suite.is_diverged(mine), f"{method} diverged on {task} where {PAIRS[method]} converged: {mine}"
    ratio = mine["final"] / twin["final"]
    assert ratio <= LIMITS[(task, method)], (
        f"{method} / {PAIRS[method]} on {task} at lr {mine['lr']}: same-lr ratio {ratio:.3f} "
        f"(limit {LIMITS[(task, method)]})")


def test_suite_records_zeroone_bytes(finals):
    """ZeroOneAdam's own byte count (comm_stats) is in the suite's results: its variance
    steps send fp32, the rest about 1 bit per element, so over a run it sends less than
    fp32 ring allreduces would, and more than a thirty-second of that."""
    for task in ADAM_LRS:
        r = finals[(task, "zeroone")]
        assert r["bytes_uncompressed"] / 32 < r["bytes_sent"] < r["bytes_uncompressed"], r
    assert finals[("rare_features", "adamw")]["bytes_sent"] is None


def _trajectory_run(rank, world):
    from types import SimpleNamespace

    from bench import suite
    from bench import tasks as T

    a = SimpleNamespace(onebit_options={}, hook_options={}, zeroone_options={}, schedule="cosine", trajectory=40)
    return suite.one_run(rank, world, T.make_task("dead_relu", quick=True), "onebit_adam", 0.003, a)


def test_suite_records_the_trajectory_and_runs_only_the_lrs_asked_for():
    from bench import suite
    from bench import tasks as T

    r = run_ranks(_trajectory_run, 2, timeout=300)[0]
    assert [st for st, _ in r["trajectory"]] == [40, 80]  # every 40th of the quick task's 80 steps
    assert r["trajectory"][-1][1] == r["final"] and r["trajectory"][0][1] > r["final"]
    a = suite.parse_args(["--quick", "--lrs", "0.003,0.03", "--trajectory", "20"])
    assert a.lrs == [0.003, 0.03] and a.trajectory == 20
    assert suite.freeze_of(T.make_task("dead_relu", quick=True), a) == 20  # 25 % of 80 steps
    a = suite.parse_args(["--quick", "--freeze-at", "0.5"])
    assert suite.freeze_of(T.make_task("dead_relu", quick=True), a) == 40
    a = suite.parse_args(["--steps", "960"])  # a longer run: the freeze scales with it
    assert suite.freeze_of(T.make_task("dead_relu", steps=a.steps), a) == 240
    for bad in (["--lrs", "0.005", "--tasks", "dead_relu"], ["--lrs", "x"], ["--trajectory", "-1"],
                ["--freeze-at", "1"], ["--freeze-at", "0"], ["--steps", "4"]):
        with pytest.raises(SystemExit):
            suite.parse_args(bad)


def _heldout(*args, timeout=600):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=root)


def test_heldout_runs_under_torchrun(tmp_path):
    """bench/heldout.py as documented, shortened: torchrun, the twins and the 1-bit
    optimizers from the same weights (the same initial loss), a finite final loss for
    each, the ratio table printed."""
    out = tmp_path / "heldout.json"
    proc = _heldout("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "bench.heldout",
                    "--tasks", "digits,recsys", "--pairs", "onebit_adam,onebit_lamb", "--seeds", "0",
                    "--steps", "24", "--lrs", "0.003", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["world"] == 2 and doc["steps"] == 24
    runs = {(r["task"], r["method"]): r for r in doc["runs"]}
    assert set(runs) == {(t, m) for t in ("digits", "recsys") for m in ("adamw", "onebit_adam", "lamb", "onebit_lamb")}
    for t in ("digits", "recsys"):
        inits = {runs[(t, m)]["init"] for m in ("adamw", "onebit_adam", "lamb", "onebit_lamb")}
        assert len(inits) == 1, inits
        assert all(math.isfinite(runs[(t, m)]["final"]) and runs[(t, m)]["final"] < runs[(t, m)]["init"]
                   for m in ("adamw", "onebit_adam", "lamb", "onebit_lamb")), runs
    assert "digits: onebit_adam / adamw at the same lr" in proc.stdout
    assert re.search(r"lr 0\.003: \d\.\d{4} \d\.\d{4} \d\.\d{3}", proc.stdout), proc.stdout


def test_heldout_refuses_bad_input():
    proc = _heldout("-m", "bench.heldout", "--tasks", "digits")
    assert proc.returncode == 2 and "run it under torchrun" in proc.stderr
    proc = _heldout("-m", "bench.heldout", "--tasks", "mnist")
    assert proc.returncode == 2 and "unknown task 'mnist'" in proc.stderr
    for bad, why in ((["--lrs", "x"], "--lrs numbers"), (["--lrs", "-0.1"], "must be positive"),
                     (["--steps", "3"], "at least 8")):
        proc = _heldout("-m", "bench.heldout", *bad)
        assert proc.returncode == 2 and why in proc.stderr, proc.stderr
