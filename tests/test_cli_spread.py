"""lbcomm-bench allreduce says when its timings spread too widely for the medians to be
trusted (p90/p10 above SPREAD_LIMIT), and asks for more iterations."""
import json

import pytest

from lbcomm.cli.allreduce import quantiles
from lbcomm.cli.report import SPREAD_LIMIT, report_allreduce, spread, spread_warnings
from lbcomm.cli.schema import allreduce_config, allreduce_rows, check_allreduce_doc, document


def _row(method, size, times):
    med, p10, p90 = quantiles(times)
    return dict(size=size, bytes=4 * size, method=method, world_size=2, median_s=med, p10_s=p10, p90_s=p90,
                algbw_gbps=4 * size / med / 1e9, busbw_gbps=4 * size / med / 1e9, wire_bytes=4 * size,
                speedup_vs_fp32=None, inter_node_bytes=None)


QUIET = [1e-3 * (1 + 0.02 * (i % 7)) for i in range(20)]  # within 12 %
BUSY = [1e-3] * 10 + [1e-3 * (3 + i) for i in range(10)]  # half the iterations 3-12x slower


def _doc(rows, iters=20):
    config = allreduce_config(world_size=2, backend="gloo", launcher="local", threads=1, iters=iters, warmup=3,
                              block_size=2048, pieces=None)
    return document("allreduce", config=config, rows=allreduce_rows(rows))


def test_spread_of_synthetic_timings():
    quiet, busy = allreduce_rows([_row("fp32", 4096, QUIET), _row("onebit", 4096, BUSY)])
    assert spread(quiet) == pytest.approx(quiet["p90_s"] / quiet["p10_s"]) and spread(quiet) < 1.2
    assert spread(busy) == pytest.approx(10e-3 / 1e-3)  # nearest-rank p90 of BUSY: its 18th value
    assert spread({"p10_s": 0.0, "p90_s": 1e-3}) == float("inf")
    assert spread_warnings([quiet], 20) == []
    # just above and at the limit
    edge = dict(quiet, p10_s=1e-3, p90_s=SPREAD_LIMIT * 1e-3)
    assert spread_warnings([edge], 20) == []
    assert len(spread_warnings([dict(edge, p90_s=1.01 * SPREAD_LIMIT * 1e-3)], 20)) == 1


def test_one_warning_per_method_naming_the_worst_size():
    rows = allreduce_rows([_row("fp32", 4096, QUIET), _row("onebit", 4096, BUSY),
                           _row("fp32", 65536, QUIET), _row("onebit", 65536, [t * 0.5 for t in BUSY[5:]] + QUIET)])
    lines = spread_warnings(rows, 20)
    assert lines == [
        "# warning: onebit timings spread widely: p90/p10 = 10.0 at 16384 B (p10 1.00 ms, p90 10.00 ms), above 2 at "
        "2 of 2 size(s), so a median of 20 iterations can change a lot between runs (is the machine busy?). Rerun "
        "with a larger --iters (e.g. --iters 100), on a quieter machine if you can"]
    assert "--iters 500" in spread_warnings(rows, 100)[0]


def test_the_report_prints_the_warning_and_the_json_is_unchanged(tmp_path, capsys):
    busy = _doc([_row("fp32", 4096, QUIET), _row("onebit", 4096, BUSY)], iters=20)
    path = tmp_path / "a.json"
    report_allreduce(busy, str(path))
    out = capsys.readouterr().out
    warned = [line for line in out.splitlines() if line.startswith("# warning:")]
    assert len(warned) == 1 and "onebit timings spread widely" in warned[0] and "--iters 100" in warned[0]
    assert out.index("# warning:") > out.index(" onebit ")  # below the table
    check_allreduce_doc(json.loads(path.read_text()))  # the rows carry p10_s and p90_s, as before

    report_allreduce(_doc([_row("fp32", 4096, QUIET), _row("onebit", 4096, QUIET)]))
    assert "# warning" not in capsys.readouterr().out
