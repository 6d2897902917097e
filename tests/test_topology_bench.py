"""Several nodes in the benchmark CLI (lbcomm.cli): the arguments of --nodes and
--ranks-per-node, the bytes that cross the links between emulated nodes, `train` on a
2-D mesh of loopback nodes, and the node cost model (lbcomm.cli.nodemodel) against values
computed by hand."""
import os

import pytest


def _bench_env():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env, root


def test_bench_nodes_arguments(capsys):
    from lbcomm.cli.commands import main

    assert main(["allreduce", "--nodes", "2", "--ranks-per-node", "2", "--world-size", "3", "--sizes", "4K"]) == 1
    assert "--nodes 2 x --ranks-per-node 2 = 4" in capsys.readouterr().err
    assert main(["allreduce", "--world-size", "3", "--ranks-per-node", "2", "--sizes", "4K"]) == 1
    assert "does not divide" in capsys.readouterr().err


def test_bench_emulated_nodes_count_inter_node_bytes(tmp_path):
    import json
    import subprocess
    import sys

    from lbcomm.cli import netem
    from lbcomm.cli.schema import check_allreduce_doc

    ok, why = netem.available()
    if not ok:
        pytest.skip(f"emulated cluster unavailable: {why}")
    env, root = _bench_env()
    out = tmp_path / "n.json"
    proc = subprocess.run([sys.executable, "-m", "lbcomm.cli", "allreduce", "--nodes", "2", "--ranks-per-node", "2",
                           "--bandwidth", "1gbit", "--sizes", "1M", "--iters", "3", "--warmup", "1",
                           "--methods", "onebit,hier", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert "across the links between the 2 emulated nodes of 2 ranks" in proc.stdout
    doc = json.loads(out.read_text())
    check_allreduce_doc(doc)
    assert doc["config"]["ranks_per_node"] == 2
    rows = {r["method"]: r for r in doc["rows"]}
    hier, flat = rows["hier"], rows["onebit"]
    # what crossed the links: the 1-bit stage of all 4 ranks plus TCP/IP framing (< 10 %)
    assert 4 * hier["wire_bytes_per_rank"] <= hier["inter_node_bytes"] < 1.1 * 4 * hier["wire_bytes_per_rank"]
    assert flat["inter_node_bytes"] > 1.5 * hier["inter_node_bytes"], (flat, hier)
    # both limits have a compute half: hier's counts its own passes inside the node too
    for r in (hier, flat):
        assert r["compute_s"] > 0 and r["limit_s"] == max(r["wire_s"], r["compute_s"])


def test_bench_train_nodes_loopback(tmp_path):
    """train --nodes 2 --ranks-per-node 2 (unshaped): plain HSDP, HSDP + 1 bit and OneBitAdam
    on FSDP2 train on a 2-D mesh (OneBitAdam timed frozen); ratios against plain HSDP from the same run."""
    import json
    import subprocess
    import sys

    from lbcomm.cli.schema import check_train_doc

    env, root = _bench_env()
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, "-m", "lbcomm.cli", "train", "--nodes", "2", "--ranks-per-node", "2",
                           "--bandwidth", "none", "--preset", "tiny", "--steps", "1", "--rounds", "1",
                           "--warmup-steps", "4", "--allreduce-iters", "1", "--methods",
                           "hsdp,hsdp_onebit,fsdp_onebit_adam", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert "2 nodes x 2 ranks" in proc.stdout and "against plain HSDP" in proc.stdout
    doc = json.loads(out.read_text())
    check_train_doc(doc)
    assert doc["config"]["ranks_per_node"] == 2 and doc["config"]["nodes"] == 2
    rows = {r["method"]: r for r in doc["runs"][0]["rows"]}
    assert list(rows) == ["hsdp", "hsdp_onebit", "fsdp_onebit_adam"]
    base = rows["hsdp"]["median_s"]
    for r in rows.values():
        assert r["speedup_vs_hsdp"] == pytest.approx(base / r["median_s"])
        assert r["speedup_vs_ddp"] is None and r["inter_node_bytes_per_step"] is None  # no ddp row; loopback
        assert r["final_loss"] == r["final_loss"] and 5.0 < r["final_loss"] < 7.5  # ln(512) = 6.2 at the start


def test_bench_train_nodes_arguments(capsys):
    from lbcomm.cli.commands import main

    assert main(["train", "--world-size", "2", "--methods", "ddp,hsdp", "--bandwidth", "none"]) == 1
    assert "hsdp need emulated nodes: give --nodes N --ranks-per-node G" in capsys.readouterr().err
    assert main(["train", "--nodes", "2", "--ranks-per-node", "2", "--world-size", "2", "--bandwidth", "none"]) == 1
    assert "--nodes 2 x --ranks-per-node 2 = 4" in capsys.readouterr().err
    assert main(["train", "--world-size", "3", "--ranks-per-node", "2", "--bandwidth", "none"]) == 1
    assert "does not divide" in capsys.readouterr().err
    assert main(["model-nodes", "--sizes", "1M,8M"]) == 1
    assert "at least 3 sizes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["model-nodes", "--mem-bandwidth", "fast"])
    assert "use bytes per second like 3TB" in capsys.readouterr().err


def test_node_cost_model_hand_computed():
    """lbcomm.cli.nodemodel against values computed by hand from its formulas and the wire
    format (n/8 sign bytes, one fp32 scale per 2048 elements, a 24-byte header per row;
    the 104-byte finiteness agreement in a ring)."""
    from lbcomm.cli.nodemodel import Links, gpu_kernel_s, node_cost, onebit_bytes
    from lbcomm.comm import LoopTransport
    from lbcomm.compressed import CompressionState

    # the byte formula is the state's own count, without allocating the state
    for m, q in ((5000, 3), (1 << 16, 4), (131072, 2)):
        st = CompressionState(m, transport=LoopTransport(q), block_size=2048, pieces=1)
        assert onebit_bytes(m, q) == st.bytes_per_call()
    n, N, G = 1 << 20, 4, 8
    links = Links(1e9, 1e11, 1e-5, 1e-6)
    # 1-bit bytes of a rank's slice (2^17 elements) over 4 nodes: chunks of 32768 elements,
    # rows of 4096 sign bytes + 16 scales x 4 bytes + 24 = 4184 bytes, 2 x 3 rows, plus the
    # agreement ring 2 x 3/4 x 104 = 156 bytes
    slice_bytes = 2 * 3 * 4184 + 156
    assert onebit_bytes(n // G, N) == slice_bytes
    hier = node_cost("hier", n, N, G, links, kernel_s=0.5e-3)
    assert hier["node_bytes"] == 8 * slice_bytes
    assert hier["inter_s"] == pytest.approx(8 * slice_bytes / 1e9)
    assert hier["intra_s"] == pytest.approx(2 * 7 / 8 * 4 * n / 1e11)
    assert hier["latency_s"] == pytest.approx(2 * 7 * 1e-6 + 2 * 3 * 1e-5)
    assert hier["total_s"] == pytest.approx(hier["latency_s"] + hier["inter_s"] + hier["intra_s"] + 0.5e-3)
    hsdp = node_cost("hsdp_fp32", n, N, G, links)
    assert hsdp["node_bytes"] == pytest.approx(2 * 3 / 4 * 4 * n)  # 8 ranks x ring of a 1/8 shard
    assert hsdp["total_s"] == pytest.approx(7 * 1e-6 + 2 * 3 * 1e-5 + 2 * 3 / 4 * 4 * n / 1e9 + 7 / 8 * 4 * n / 1e11)
    bf16 = node_cost("hsdp_bf16", n, N, G, links)
    assert bf16["node_bytes"] == pytest.approx(hsdp["node_bytes"] / 2)
    assert node_cost("hsdp_onebit", n, N, G, links)["node_bytes"] == hier["node_bytes"]
    # flat 1-bit over 32 ranks, rows of 32768 elements (4184 bytes): the all-to-all sends 8 x 24
    # rows off the node (24 of a rank's 31 peers are elsewhere), the ring all-gather 31 rows
    flat = node_cost("onebit", n, N, G, links)
    assert flat["node_bytes"] == pytest.approx((8 * 24 + 31) * 4184 + 2 * 31 / 32 * 104)
    assert flat["latency_s"] == pytest.approx(2 * 31 * 1e-5)
    fp32 = node_cost("fp32", n, N, G, links)
    assert fp32["node_bytes"] == pytest.approx(2 * 31 / 32 * 4 * n)
    # 2 x 2 as emulated: flat 4 + 3 rows, hierarchical 2 x (1 + 1) rows of the same size
    two = Links(1.2e8, float("inf"), 0, 0)
    row = 32768 + 4 * 128 + 24  # 2^20 over 4 ranks: 262144-element chunks, 128 scales
    assert node_cost("onebit", n, 2, 2, two)["node_bytes"] == pytest.approx(7 * row + 2 * 3 / 4 * 104)
    assert node_cost("hier", n, 2, 2, two)["node_bytes"] == 2 * (2 * row + 104)
    # GPU kernel estimates: memory traffic over memory bandwidth
    assert gpu_kernel_s("hsdp_onebit", n, N, G, 3e12) == pytest.approx((16.375 + 8.125 / 4) * (n / 8) / 3e12)
    # the hierarchical call adds its passes inside the node: 4 B in (finite check), 7/8 of
    # 8 B (copy out to the others), 8 x 4/8 B in + 4/8 B out (mean) + 8/8 B (division), 8 B (copy back)
    intra = 4 + 8 * 7 / 8 + 4 + 4 / 8 + 8 / 8 + 8
    assert gpu_kernel_s("hier", n, N, G, 3e12) == pytest.approx(((16.375 + 8.125 / 4) * (n / 8) + intra * n) / 3e12)
    assert gpu_kernel_s("onebit", n, N, G, 3e12) == pytest.approx((16.375 + 8.125 / 32) * n / 3e12)
    assert gpu_kernel_s("hsdp_bf16", n, N, G, 3e12) == 0.0
    with pytest.raises(ValueError, match="unknown method"):
        node_cost("ring", n, N, G, links)
    with pytest.raises(ValueError, match="intra_Bps must be > 0"):
        Links(1e9, 0, 0, 0)
