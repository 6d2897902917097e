"""lbcomm-bench's arguments (every one checked before anything runs, help in a user's words),
and the `advise` command. The end-to-end runs of the benchmarks are in test_bench_cli.py."""
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from lbcomm.cli import commands
from lbcomm.cli.schema import ADVISE_ROW_FIELDS
from lbcomm.cli.units import parse_params
from lbcomm.common import ring_allreduce_bytes

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=_env(),
                          cwd=ROOT)


# ------------------------------------------------------------------------------ checked up front


def test_block_size_rejected_before_anything_runs():
    proc = _run("-m", "lbcomm.cli", "allreduce", "--world-size", "2", "--sizes", "4K", "--block-size", "100")
    assert proc.returncode == 2
    assert proc.stdout == ""  # no fp32/fp16 timings first
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1
    assert "--block-size" in errors[0] and "'100'" in errors[0]
    assert "multiple of 32" in errors[0] and "'none'" in errors[0]


@pytest.mark.parametrize("argv, match", [
    (["allreduce", "--block-size", "48"], "multiple of 32"),
    (["allreduce", "--block-size", "0"], "multiple of 32"),
    (["allreduce", "--sizes", "6B"], "whole number of fp32 elements"),
    (["allreduce", "--methods", "fp64"], "choose from fp32, fp16, onebit"),
    (["allreduce", "--bandwidth", "1gbps"], "ambiguous"),
    (["allreduce", "--latency", "50 years"], "Invalid time"),
    (["allreduce", "--iters", "0"], ">= 1"),
    (["allreduce", "--warmup", "-1"], ">= 0"),
    (["allreduce", "--world-size", "1"], ">= 2"),
    (["allreduce", "--timeout", "0"], "> 0"),
    (["train", "--warmup-steps", "2"], ">= 4"),
    (["train", "--bandwidth", "fast"], "Invalid bandwidth"),
    (["train", "--lr", "-1"], "learning rate"),
    (["model", "--predict-bandwidths", "1gbit,10"], "Invalid bandwidth"),
    (["model", "--predict-alpha", "soon"], "Invalid time"),
    (["advise", "--params", "350X", "--nodes", "2", "--bandwidth", "1gbit", "--step-time", "1s"], "unknown unit"),
    (["advise", "--params", "1M", "--nodes", "2", "--bandwidth", "1gbit"], "--step-time"),
])
def test_bad_value_is_a_usage_error(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        commands.main(argv)
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and match in out.err


@pytest.mark.parametrize("argv, match", [
    (["allreduce", "--block-size", "none", "--pieces", "2"], "--pieces 2 needs block scales"),
    (["train", "--d-model", "65", "--heads", "2"], "--d-model 65 must be a multiple of --heads 2"),
    (["train", "--backend", "mpi"], "use --backend gloo or nccl"),
    (["allreduce", "--world-size", "2", "--bandwidth", "1gbit", "--burst", "1kb"], "burst"),
])
def test_arguments_that_do_not_fit_together(argv, match, capsys):
    assert commands.main(argv) == 1
    out = capsys.readouterr()
    assert out.out == "" and match in out.err and "Traceback" not in out.err


@pytest.mark.parametrize("command", ["", "allreduce", "train", "model", "advise"])
def test_help_in_a_users_words(command, capsys):
    with pytest.raises(SystemExit) as exc:
        commands.main([command, "--help"] if command else ["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "usage: lbcomm-bench" in text
    # No Python a user cannot look up: dotted paths, calls, class names, constants, private
    # names, Python's None (names of methods and units are fine).
    words = {"PowerSGD", "AdamW", "MiB", "GiB"}
    for pattern in (r"\b(?:lbcomm|torch)\.[a-z_]+\.\w+", r"\w\(\)", r"\b[A-Z][a-z]+[A-Z]\w*",
                    r"\b[A-Z]+_[A-Z_]+\b", r"(?<![\w-])_\w+", r"\bNone\b", r"DESIGN\.md"):
        found = [w for w in re.findall(pattern, text) if w not in words]
        assert not found, f"lbcomm-bench {command} --help: {found}"


def test_console_script_points_to_the_cli():
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["lbcomm-bench"]
    module, func = target.split(":")
    assert module == "lbcomm.cli.commands" and func == "main"
    assert getattr(__import__(module, fromlist=[func]), func) is commands.main


# ------------------------------------------------------------------------------ advise


@pytest.mark.parametrize("text, n", [("125M", 125_000_000), ("1.3B", 1_300_000_000), ("350k", 350_000),
                                     ("7e9", 7_000_000_000), ("4096", 4096)])
def test_parse_params(text, n):
    assert parse_params(text) == n


def _advise(tmp_path, *argv):
    path = tmp_path / "advise.json"
    assert commands.main(["advise", *argv, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_advise_slow_network_big_model(tmp_path, capsys):
    doc = _advise(tmp_path, "--params", "100M", "--nodes", "8", "--bandwidth", "1gbit", "--step-time", "200ms")
    out = capsys.readouterr().out
    assert doc["schema"] == "lbcomm-bench/advise"
    rows = {r["method"]: r for r in doc["rows"]}
    assert list(rows) == ["fp32", "fp16", "powersgd", "onebit_warmup", "onebit"]
    for r in doc["rows"]:
        assert set(r) == set(ADVISE_ROW_FIELDS)
        assert r["step_s"] == pytest.approx(0.2 + r["comm_s"])
        assert r["comm_s"] == pytest.approx(r["latency_s"] + r["wire_s"] + r["compute_s"])
        assert r["speedup_vs_fp32"] == pytest.approx(rows["fp32"]["step_s"] / r["step_s"])
    # a ring sends 2 (p-1)/p of the gradients through each node's link; 1-bit about 1/32 of it
    assert rows["fp32"]["node_bytes_per_step"] == pytest.approx(ring_allreduce_bytes(4e8, 8))
    assert rows["fp32"]["wire_s"] >= 5.6  # 5.6 GB... at 1 Gbit/s
    assert 20 < rows["fp32"]["node_bytes_per_step"] / rows["onebit"]["node_bytes_per_step"] < 32
    assert rows["onebit_warmup"]["step_s"] == rows["fp32"]["step_s"]
    assert rows["onebit"]["speedup_vs_fp32"] > 3
    assert "1-bit pays" in out and "will not pay" not in out


def test_advise_says_when_compression_will_not_pay(tmp_path, capsys):
    # a 1M-parameter model on 100 Gbit/s links with 100 ms of compute: nothing to gain
    doc = _advise(tmp_path, "--params", "1M", "--nodes", "4", "--bandwidth", "100gbit", "--step-time", "100ms")
    out = capsys.readouterr().out
    assert any("1-bit will not pay" in line for line in doc["verdict"])
    assert "1-bit will not pay" in out and "fast or the model small" in out
    rows = {r["method"]: r for r in doc["rows"]}
    assert rows["onebit"]["speedup_vs_fp32"] < 1.10


def test_advise_chooses_flat_or_hierarchical_on_nodes(tmp_path, capsys):
    """On nodes of several ranks the hierarchical call sends a node's g slices of n/g once
    across nodes: on a slow network with free transfers inside the node it wins; over a
    slow link inside the node (its fp32 reduce-scatter and all-gather) the verdict says to
    use the flat call."""
    argv = ["--params", "50M", "--nodes", "2", "--ranks-per-node", "4", "--bandwidth", "1gbit",
            "--step-time", "100ms"]
    free = _advise(tmp_path, *argv)
    rows = {r["method"]: r for r in free["rows"]}
    assert list(rows)[-1] == "onebit_hier" and set(rows["onebit_hier"]) == set(ADVISE_ROW_FIELDS)
    assert rows["onebit_hier"]["node_bytes_per_step"] < rows["onebit"]["node_bytes_per_step"] / 2
    assert any("keep CommConfig(topology='auto')" in line for line in free["verdict"])
    slow = _advise(tmp_path, *argv, "--intra-bandwidth", "1gbit")
    assert any("use CommConfig(topology='flat')" in line for line in slow["verdict"])
    assert "use CommConfig(topology='flat')" in capsys.readouterr().out
    one_rank_nodes = _advise(tmp_path, "--params", "50M", "--nodes", "2", "--bandwidth", "10gbit", "--step-time", "1s")
    assert "onebit_hier" not in {r["method"] for r in one_rank_nodes["rows"]}


def test_advise_one_node(tmp_path, capsys):
    doc = _advise(tmp_path, "--params", "10M", "--nodes", "1", "--ranks-per-node", "8", "--bandwidth", "1gbit",
                  "--step-time", "100ms")
    assert all(r["node_bytes_per_step"] == 0 for r in doc["rows"])
    assert any("on one node nothing crosses a network link" in line for line in doc["verdict"])


# ------------------------------------------------------------------------------ the limit of a call


def _limit_doc(bandwidth, ranks_per_node=1, world=4):
    from lbcomm.cli.schema import allreduce_config, allreduce_rows, document

    rows = [dict(size=1024, bytes=4096, method=m, world_size=world, median_s=t, p10_s=t, p90_s=t,
                 algbw_gbps=4096 / t / 1e9, busbw_gbps=4096 / t / 1e9, wire_bytes=w, speedup_vs_fp32=None,
                 inter_node_bytes=inb, compute_s=c, cpu_s=cpu, compute_cpu_s=c, host_busy=busy)
            for m, t, w, inb, c, cpu, busy in (("fp32", 2e-3, 6144, 12_000, 1e-3, 2e-3, 0.5),
                                               ("onebit", 1e-3, 400, 1_000, 5e-4, 8e-4, 0.97),
                                               ("hier", 1e-3, 200, 600, None, None, None))]
    shaping = dict(bandwidth=bandwidth, latency="50ms", burst="256kb") if bandwidth else {}
    config = allreduce_config(world_size=world, backend="gloo", launcher="netem" if bandwidth else "local",
                              threads=1, iters=3, warmup=1, block_size=2048, pieces=None,
                              ranks_per_node=ranks_per_node, **shaping)
    return document("allreduce", config=config, rows=allreduce_rows(rows))


@pytest.mark.parametrize("bandwidth, ranks_per_node", [(None, 1), ("1mbit", 1), ("1mbit", 2)])
def test_allreduce_limit_fields(bandwidth, ranks_per_node, capsys):
    from lbcomm.cli.report import report_allreduce
    from lbcomm.cli.schema import ALLREDUCE_ROW_FIELDS, add_limits, check_allreduce_doc

    doc = add_limits(_limit_doc(bandwidth, ranks_per_node))
    check_allreduce_doc(doc)
    payload = 1e6 / 8 * 1448 / 1514  # bytes/s of TCP payload in full frames at 1 Mbit/s
    for r in doc["rows"]:
        assert set(r) == set(ALLREDUCE_ROW_FIELDS)
        if bandwidth is None:
            wire = None
        elif ranks_per_node == 1:
            wire = r["wire_bytes_per_rank"] / payload
        else:  # what each of the 2 node links carried, headers included, at the raw rate
            wire = r["inter_node_bytes"] / 2 / (1e6 / 8)
        assert r["wire_s"] == (None if wire is None else pytest.approx(wire))
        known = [t for t in (wire, r["compute_s"]) if t is not None]
        limit = max(known) if known else None
        assert r["limit_s"] == (None if limit is None else pytest.approx(limit))
        if limit is None:
            assert r["limit_fraction"] is None
        else:
            assert r["limit_s"] > 0 and r["limit_fraction"] == pytest.approx(limit / r["median_s"])
    report_allreduce(_limit_doc(bandwidth, ranks_per_node))  # adds the same fields itself
    out = capsys.readouterr().out
    assert "limit ms" in out and "of limit" in out
    onebit = next(line.split() for line in out.splitlines() if re.match(r"\s*4096\s+1024\s+onebit\s", line))
    assert onebit[-3] == f"{doc['rows'][1]['limit_fraction']:.0%}"
    assert onebit[-2:] == ["0.80", "97%"]  # cpu ms and host busy


def test_allreduce_docs_without_limits_still_check():
    """Documents written before the limit fields existed (or by run_allreduce, before the
    report adds them) pass the schema check."""
    from lbcomm.cli.schema import check_allreduce_doc

    doc = _limit_doc(None)
    for r in doc["rows"]:
        del r["compute_s"]
    check_allreduce_doc(doc)


def test_host_busy_from_proc_stat():
    """busy_between reads the share of the host's CPU capacity that was busy: a process
    spinning on one core keeps at least 1/cpus of it busy."""
    from lbcomm.cli.allreduce import busy_between, host_cpu_ticks

    assert busy_between(None, (1, 2)) is None and busy_between((5, 10), (5, 10), min_ticks=1) is None
    assert busy_between((10, 100), (40, 160), min_ticks=60) == pytest.approx(0.5)
    assert busy_between((10, 100), (40, 160), min_ticks=61) is None  # too short a window to read
    before = host_cpu_ticks()
    if before is None:
        pytest.skip("no /proc/stat on this host")
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:
        pass
    busy = busy_between(before, host_cpu_ticks())
    assert busy is not None and 0.5 / os.cpu_count() <= busy <= 1.0


def test_hier_compute_counts_the_passes_inside_the_node():
    """The compute half of hier's limit: its stages inside the node (finiteness check, the
    copy of the slices that leave, the fp32 mean of g slices, the copy back) then the 1-bit
    passes on one slice of n/g over the nodes; the input is only read. One node, or one
    rank per node, is the flat call's."""
    import torch

    from lbcomm.cli import allreduce

    x = torch.randn(10_000)
    before = x.clone()
    op = allreduce._compute_op("hier", x, 4, 2048, 2)
    op()
    assert torch.equal(x, before)
    for p, g in ((4, 1), (2, 2)):
        allreduce._compute_op("hier", x, p, 2048, g)()
    intra = allreduce.hier_intra_compute(torch.randn(7), 3)  # slices of 3, 3, 1: the last one short
    intra()
    with pytest.raises(ValueError, match="unknown method"):
        allreduce._compute_op("bogus", x, 4, 2048)


def test_advise_counts_hier_passes_and_shared_cores(monkeypatch, capsys):
    """The model's arithmetic with fixed compute times: the hierarchical call's compute is
    the 1-bit passes on a slice plus its own passes inside the node (K_intra), and every
    compute term is divided by --cores-per-rank, which can turn the verdict to flat."""
    from lbcomm.cli import advise as adv

    fixed = {"fp32": 1e-3, "fp16": 1e-3, "onebit": 4e-3, "hier_intra": 3e-3}
    monkeypatch.setattr(adv, "compute_times", lambda items, *a, **k: {it: fixed[it[0]] for it in items})
    monkeypatch.setattr(adv, "powersgd_compute_s", lambda *a, **k: 1e-4)
    kw = dict(params=2**22, nodes=2, ranks_per_node=2, bandwidth_bps=1e9, latency_s=0.0, step_compute_s=0.1)
    whole = {r["method"]: r for r in adv.advise(**kw)["rows"]}
    assert whole["onebit"]["compute_s"] == pytest.approx(4e-3)
    assert whole["onebit_hier"]["compute_s"] == pytest.approx(4e-3 + 3e-3)
    half = adv.advise(**kw, cores_per_rank=0.5)
    rows = {r["method"]: r for r in half["rows"]}
    for m in ("fp32", "onebit", "onebit_hier"):
        assert rows[m]["compute_s"] == pytest.approx(2 * whole[m]["compute_s"])
        assert rows[m]["wire_s"] == pytest.approx(whole[m]["wire_s"])
    assert any("use CommConfig(topology='flat')" in line for line in half["verdict"])
    with pytest.raises(ValueError, match="cores_per_rank"):
        adv.advise(**kw, cores_per_rank=0)
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit) as exc:
            commands.main(["advise", "--params", "1M", "--nodes", "2", "--bandwidth", "1gbit", "--step-time", "1s",
                           "--cores-per-rank", bad])
        assert exc.value.code == 2 and "--cores-per-rank" in capsys.readouterr().err
