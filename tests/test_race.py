"""`lbcomm-bench race` end to end with a tiny model and a few steps: the JSON schema, the
table, the curves, the choice of methods; on an emulated cluster where root is available.
Nothing here checks timings or which method wins (a busy 2-core machine)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lbcomm.cli import netem
from lbcomm.cli.args import build_parser
from lbcomm.cli.argtypes import UsageError
from lbcomm.cli.racecli import check, check_race_doc

ROOT = Path(__file__).resolve().parents[1]
_ok, _why = netem.available()
needs_netns = pytest.mark.skipif(not _ok, reason=f"emulated cluster unavailable: {_why}")
HAS_TORCHFT = importlib.util.find_spec("torchft") is not None
TINY = ["--world-size", "2", "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16", "--val-seqs", "16",
        "--steps", "6", "--eval-every", "3", "--warmup", "2", "--no-progress"]


def race(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "lbcomm.cli", "race", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
    path = tmp_path_factory.mktemp("race") / "race.json"
    methods = "ddp,onebit_adam" + (",diloco" if HAS_TORCHFT else "") + ",onebit_local"
    # outer momentum 0: DiLoCo's outer step is then plain SGD (torch refuses Nesterov without momentum)
    proc = race("--bandwidth", "none", "--methods", methods, "--diloco-h", "3", "--outer-momentum", "0",
                "--local-h", "3", "--local-overlap", "1", "--local-block-size", "256",
                "--schedule", "cosine", "--json", str(path), *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(path.read_text())


def test_race_loopback_schema_and_table(loopback):
    proc, doc = loopback
    check_race_doc(doc)
    assert doc["config"]["outer_momentum"] == 0.0 and doc["config"]["local_overlap"] == 1
    assert doc["config"]["local_block_size"] == 256
    assert doc["config"]["schedule"] == "cosine" and doc["config"]["delay"] == "0"
    (run,) = doc["runs"]
    assert run["bandwidth"] is None
    methods = [r["method"] for r in run["rows"]]
    assert methods == ["ddp", "onebit_adam"] + (["diloco_h3"] if HAS_TORCHFT else []) + ["onebit_local_h3"]
    ddp = run["rows"][0]
    assert ddp["reached"] and ddp["speedup_vs_ddp"] == 1.0 and ddp["steps_to_target"] == 6
    assert run["target_loss"] == ddp["final_val_loss"] == ddp["curve"][-1]["val_loss"]
    assert run["ddp_time_s"] == ddp["time_to_target_s"]
    for r in run["rows"]:
        steps = [c["step"] for c in r["curve"]]
        assert steps[0] == 0 and steps == sorted(steps)
        times = [c["time_s"] for c in r["curve"]]
        assert times == sorted(times) and r["final_time_s"] == times[-1]
        assert all(c["bytes_per_rank"] is None for c in r["curve"][1:])  # loopback: no interface counter
        assert r["bytes_per_rank_to_target"] is None
        if r["reached"]:
            assert r["time_to_target_s"] <= r["final_time_s"]
            hit = next(c for c in r["curve"] if c["val_loss"] <= run["target_loss"])
            assert (hit["step"], hit["time_s"]) == (r["steps_to_target"], r["time_to_target_s"])
        if r["family"] == "diloco":
            assert all(s % 3 == 0 for s in steps)  # evaluated at syncs only
    curve0 = {json.dumps(r["curve"][0]) for r in run["rows"]}
    assert len(curve0) == 1  # the same initial weights and held-out set for every method
    assert "to target s" in proc.stdout and "onebit_adam" in proc.stdout and "target validation loss" in proc.stdout
    assert "clock: training steps only" in proc.stdout


def test_check_race_doc_rejects(loopback):
    _, doc = loopback
    bad = json.loads(json.dumps(doc))
    del bad["runs"][0]["rows"][0]["steps_to_target"]
    with pytest.raises(ValueError, match="steps_to_target"):
        check_race_doc(bad)
    bad = json.loads(json.dumps(doc))
    bad["runs"][0]["rows"][0]["sync_every"] = 4  # ddp has no H
    with pytest.raises(ValueError, match="sync_every"):
        check_race_doc(bad)


def _args(*argv):
    return build_parser().parse_args(["race", *argv])


def test_methods_and_grid():
    args = _args("--bandwidth", "none", "--diloco-h", "8,32", "--local-h", "4,16")
    check(args, None)  # every method by default; diloco is left out with a note without torchft
    labels = [r["label"] for r in args.runs]
    assert labels[0] == "ddp" and "onebit_adam" in labels and "zeroone_adam" in labels
    assert [x for x in labels if x.startswith("onebit_local")] == ["onebit_local_h4", "onebit_local_h16"]
    assert [r["sync_every"] for r in args.runs if r["label"].startswith("onebit_local")] == [4, 16]
    if HAS_TORCHFT:
        assert [x for x in labels if x.startswith("diloco")] == ["diloco_h8", "diloco_h32"]
    else:
        assert any(s["method"] == "diloco" and "torchft" in s["why"] for s in args.skipped)
        with pytest.raises(UsageError, match="torchft"):
            check(_args("--bandwidth", "none", "--methods", "ddp,diloco"), None)


def test_lr_schedules():
    from lbcomm.cli.race import lr_at

    assert [lr_at(s, 1.0, 4) for s in (0, 3, 50)] == [0.25, 1.0, 1.0]  # warmup, then constant
    cos = [lr_at(s, 1.0, 4, "cosine", 104) for s in range(200)]
    assert cos[:4] == [0.25, 0.5, 0.75, 1.0] and cos[4] == 1.0
    assert all(a >= b for a, b in zip(cos[4:], cos[5:]))  # decays
    assert cos[54] == pytest.approx(0.55) and cos[104] == pytest.approx(0.1) and cos[199] == pytest.approx(0.1)
    assert _args("--bandwidth", "none").schedule == "constant"
    with pytest.raises(SystemExit):
        _args("--bandwidth", "none", "--schedule", "linear")


def test_methods_run_ddp_first():
    args = _args("--bandwidth", "none", "--methods", "onebit_local,ddp", "--local-h", "4")
    check(args, None)
    assert [r["label"] for r in args.runs] == ["ddp", "onebit_local_h4"]


def test_local_overlap_below_every_h():
    with pytest.raises(UsageError, match="--local-overlap"):
        check(_args("--bandwidth", "none", "--methods", "ddp,onebit_local", "--local-h", "2,8", "--local-overlap",
                    "2"), None)
    with pytest.raises(SystemExit):
        _args("--bandwidth", "none", "--local-overlap", "-1")


def test_outer_momentum_is_a_momentum():
    assert _args("--bandwidth", "none").outer_momentum == 0.9  # DiLoCo's
    for bad in ("1", "-0.1", "x"):
        with pytest.raises(SystemExit):
            _args("--bandwidth", "none", "--outer-momentum", bad)


def test_target_needs_ddp_or_a_loss():
    with pytest.raises(UsageError, match="include ddp"):
        check(_args("--bandwidth", "none", "--methods", "onebit_adam"), None)
    args = _args("--bandwidth", "none", "--methods", "onebit_adam", "--target-loss", "3.2")
    check(args, None)
    assert [r["label"] for r in args.runs] == ["onebit_adam"]


@needs_netns
def test_race_emulated_cluster_counts_bytes(tmp_path):
    path = tmp_path / "race.json"
    proc = race("--bandwidth", "100mbit", "--methods", "ddp,onebit_hook", "--json", str(path), *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(path.read_text())
    check_race_doc(doc)
    (run,) = doc["runs"]
    assert run["bandwidth"] == "100mbit"
    for r in run["rows"]:
        sent = [c["bytes_per_rank"] for c in r["curve"]]
        assert sent[0] == 0 and all(b > 0 for b in sent[1:]) and sent == sorted(sent)
    ddp = run["rows"][0]
    # 6 steps of the fp32 ring allreduce: 2 (p-1)/p * 4 bytes per parameter and step, headers on top
    assert ddp["bytes_per_rank_to_target"] >= 6 * 4 * doc["params"]
