"""`lbcomm-bench race --fault`: the local-update methods as torchft replica groups, one of
which crashes and restarts; real processes, torchft's real Lighthouse and Managers, gloo
over loopback."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lbcomm.cli.args import build_parser
from lbcomm.common import ring_allreduce_bytes
from lbcomm.cli.argtypes import UsageError
from lbcomm.cli.faultrace import ROW_FIELDS, check_fault_doc
from lbcomm.cli.racecli import check

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16", "--val-seqs", "16", "--warmup", "2",
        "--no-progress"]


def _args(*argv):
    return build_parser().parse_args(["race", "--fault", "--bandwidth", "none", *argv])


def test_fault_refuses_what_it_cannot_race():
    pytest.importorskip("torchft")
    with pytest.raises(UsageError, match="--target-loss"):
        check(_args("--methods", "onebit_local"), None)
    with pytest.raises(UsageError, match="not ddp"):
        check(_args("--methods", "ddp,onebit_local", "--target-loss", "3"), None)
    with pytest.raises(UsageError, match="--world-size >= 3"):
        check(_args("--world-size", "2", "--target-loss", "3"), None)
    with pytest.raises(UsageError, match="overlap"):
        check(_args("--local-h", "8", "--local-overlap", "2", "--target-loss", "3"), None)
    with pytest.raises(UsageError, match="no plot"):
        check(_args("--target-loss", "3", "--plot", "x.png"), None)
    args = _args("--target-loss", "3", "--local-h", "8", "--diloco-h", "16")
    check(args, None)  # by default the two local-update methods, nothing else
    assert [r["label"] for r in args.runs] == ["diloco_h16", "onebit_local_h8"]


def test_fault_without_torchft_says_how_to_install():
    code = ("import sys; sys.modules['torchft'] = None\n"
            "import importlib.util; importlib.util.find_spec = lambda name, *a: None\n"
            "from lbcomm.cli.args import build_parser\nfrom lbcomm.cli.racecli import check\n"
            "args = build_parser().parse_args(['race', '--fault', '--bandwidth', 'none', '--target-loss', '3'])\n"
            "try:\n    check(args, None)\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("UsageError") and "pip install torchft" in out


def test_fault_race_loopback(tmp_path):
    pytest.importorskip("torchft")
    path = tmp_path / "fault.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "lbcomm.cli", "race", "--fault", "--bandwidth", "none",
                           "--world-size", "3", "--methods", "onebit_local", "--local-h", "5", "--steps", "60",
                           "--target-loss", "10", "--restart-after", "0.5", "--local-block-size", "512",
                           "--json", str(path), *TINY],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(path.read_text())
    check_fault_doc(doc)
    assert doc["config"]["replicas"] == 3 and doc["config"]["crash_at_step"] == 20
    assert doc["config"]["block_size"] == 512
    (run,) = doc["runs"]
    clean, fault = run["rows"]
    assert (clean["run"], fault["run"]) == ("onebit_local_h5_clean", "onebit_local_h5_fault")
    assert clean["syncs"] == 60 // 5 and clean["failed_attempts"] == 0
    # the target is above the initial loss: reached at the first synchronization
    assert clean["time_to_target_s"] == pytest.approx(clean["curve"][0][0], abs=1e-3)
    # the survivors saw the crash and went on without it
    assert fault["detect_s"] is not None and fault["syncs"] >= 60 // 5
    # 1-bit: under a tenth of the bytes of an fp32 ring allreduce of the model per synchronization
    fp32 = clean["syncs"] * ring_allreduce_bytes(4 * doc["params"], 3)
    assert 0 < clean["bytes_per_replica"] < fp32 / 10
    assert set(ROW_FIELDS) <= set(clean) and clean["members"] == [3] * clean["syncs"]
    assert "fault/clean" in proc.stdout and "restarts 0.5 s later" in proc.stdout


def _entry(t, loss, members=3):
    return dict(step=1, members=members, t=t, eval=loss, evals_before_s=0.0, quorum_s=2.0, heal_apply_s=0.5,
                exchange_s=0.25, commit_s=0.25)


def test_a_restarted_replica_stopped_before_it_finished_still_reports_its_rejoin(tmp_path):
    # the replica left out of the last round is stopped waiting for a quorum; the log it
    # wrote after each synchronization still gives the recovery
    from lbcomm.cli.faultrace import FAULT_ROW_FIELDS, _row

    outs = [str(tmp_path / f"r{i}_0.json") for i in range(3)] + [str(tmp_path / "r2_1.json")]
    stats = dict(syncs=2, bytes_sent=100, failed=0)
    for o in outs[:2]:
        log = [_entry(11.0, 3.0), _entry(30.0, 2.5, members=2)]
        Path(o).write_text(json.dumps(dict(log=log, stats=stats, inner_steps=10)))
    Path(outs[2] + ".died").write_text("12.0")
    Path(outs[3] + ".partial").write_text(json.dumps(dict(log=[_entry(29.0, 2.6)], stats=None, inner_steps=None)))
    row = _row("1bit_fault", "1bit", True, 2.8, t0=10.0, t_restart=22.0, outs=outs, victim=2, n=3)
    assert set(FAULT_ROW_FIELDS) <= set(row)
    assert row["recovery_s"] == pytest.approx(17.0) and row["rejoin_s"] == pytest.approx(7.0)
    assert row["detect_s"] == pytest.approx(18.0) and row["first_step_s"] == pytest.approx(0.5)
    assert row["time_to_target_s"] == pytest.approx(20.0) and row["members"] == [3, 2]
    # without the partial log the row says the replica did not rejoin
    os.remove(outs[3] + ".partial")
    assert _row("1bit_fault", "1bit", True, 2.8, 10.0, 22.0, outs, 2, 3)["recovery_s"] is None
    # replica 0 must have finished: its partial log alone is refused
    os.remove(outs[0])
    Path(outs[0] + ".partial").write_text(json.dumps(dict(log=[_entry(11.0, 3.0)], stats=None, inner_steps=None)))
    with pytest.raises(RuntimeError, match="replica 0 did not finish"):
        _row("1bit_fault", "1bit", True, 2.8, 10.0, 22.0, outs, 2, 3)


def test_fault_doc_check_names_what_is_wrong():
    doc = json.loads((ROOT / "bench/results/race_fault_1gbit_2026-11-30/fault_1gbit_s0.json").read_text())
    check_fault_doc(doc)
    with pytest.raises(ValueError, match="document: keys"):
        check_fault_doc(dict(doc, extra=1))
    with pytest.raises(ValueError, match=r"runs\[0\]: keys"):
        check_fault_doc(dict(doc, runs=[dict(doc["runs"][0], ddp_time_s=1.0)]))
    row = {k: v for k, v in doc["runs"][0]["rows"][1].items() if k != "recovery_s"}
    with pytest.raises(ValueError, match=r"runs\[0\]\.rows\[0\]"):
        check_fault_doc(dict(doc, runs=[dict(doc["runs"][0], rows=[row])]))
