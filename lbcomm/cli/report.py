"""What lbcomm-bench prints: the tables and headers of every command, and the JSON and
plot files they write (plots themselves: lbcomm/cli/plot.py)."""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence

from .schema import add_limits, write_json
from .units import parse_rate

__all__ = ["SPREAD_LIMIT", "spread", "spread_warnings", "allreduce_header", "allreduce_table",
           "report_allreduce", "train_table", "report_train", "check_table",
           "nodes_check_table", "nodes_grid_table", "grid_table", "advise_table", "emit"]


def emit(doc: Dict, json_path: Optional[str], plot_path: Optional[str] = None, plot: str = "", *data,
         title: str = "") -> None:
    """Flush the printed report, then write the JSON document and, with `plot_path`, the plot
    `lbcomm.cli.plot.<plot>(*data, plot_path, title)`."""
    sys.stdout.flush()
    if json_path:
        write_json(json_path, doc)
        print(f"# wrote {json_path}")
    if plot_path:
        from . import plot as plots

        getattr(plots, plot)(*data, plot_path, title)
        print(f"# wrote {plot_path}")


# ---------------------------------------------------------------------------- allreduce


def allreduce_header(config: Dict) -> str:
    where = {"local": "local processes over loopback (no shaping)", "netem": "emulated cluster (network namespaces)",
             "torchrun": "started by torchrun", "mpirun": "started by mpirun"}.get(config["launcher"],
                                                                                 config["launcher"])
    lines = [f"# lbcomm-bench allreduce: {config['world_size']} ranks, {where}; backend {config['backend']}, "
             f"device {config['device']}, {config['threads_per_rank']} thread(s) per rank"]
    if config.get("bandwidth"):
        lines.append(f"# links: {config['bandwidth']} per direction and rank (tbf burst {config['burst']}, "
                     f"queue latency {config['latency']})")
    pieces = config.get("pieces")
    lines.append(f"# onebit block_size {config['block_size']}, pieces {'auto' if pieces is None else pieces}; "
                 f"{config['iters']} timed iterations after "
                 f"{config['warmup']} warmup; times: slowest rank, median and p10/p90")
    if config["backend"] == "mpi":
        lines.append("# mpi: fp16 is summed in an fp32 copy (MPI has no half-precision sum) and sends fp32's bytes")
    lines.append("# algbw = bytes/time, busbw = algbw*2(p-1)/p (nccl-tests); wire = bytes sent per rank per call")
    wire = ("wire ms = those bytes at the link's TCP payload rate" if not config.get("bandwidth") or
            (config.get("ranks_per_node") or 1) == 1 else
            "wire ms = the bytes each node link carried (interface counters) at the link rate")
    lines.append("# limit = max(wire, compute) (pieces overlap compression with transfers); compute ms = the "
                 "call's local work alone, timed on these ranks after the calls; "
                 + (wire if config.get("bandwidth") else "loopback has no link rate: limit = compute")
                 + "; of limit = limit / median")
    lines.append("# cpu ms = CPU time of one call per rank (all threads); host busy = share of this host's cores "
                 "busy during the calls (near 100 %: the host's CPU, not the link, bounds the call)")
    return "\n".join(lines)


def allreduce_table(rows: List[Dict]) -> str:
    """nccl-tests-like table of JSON rows: size in bytes and fp32 elements, times in ms, GB/s."""
    hdr = (f"{'bytes':>10} {'elements':>9} {'method':>7} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} "
           f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'wire B/rank':>11} {'vs fp32':>8} "
           f"{'compute ms':>10} {'wire ms':>8} {'limit ms':>8} {'of limit':>8} {'cpu ms':>7} {'host busy':>9}")
    lines = [hdr, "-" * len(hdr)]

    def ms(v):
        return "-" if v is None else f"{v * 1e3:.2f}"

    for r in rows:
        sp = f"{r['speedup_vs_fp32']:.2f}x" if r.get("speedup_vs_fp32") else "-"
        frac = "-" if r.get("limit_fraction") is None else f"{r['limit_fraction']:.0%}"
        busy = "-" if r.get("host_busy") is None else f"{r['host_busy']:.0%}"
        lines.append(f"{r['bytes']:>10} {r['elements']:>9} {r['method']:>7} {r['median_s'] * 1e3:>10.2f} "
                     f"{r['p10_s'] * 1e3:>8.2f} {r['p90_s'] * 1e3:>8.2f} {r['algbw_GBps']:>10.3f} "
                     f"{r['busbw_GBps']:>10.3f} {r['wire_bytes_per_rank']:>11} {sp:>8} "
                     f"{ms(r.get('compute_s')):>10} {ms(r.get('wire_s')):>8} {ms(r.get('limit_s')):>8} {frac:>8} "
                     f"{ms(r.get('cpu_s')):>7} {busy:>9}")
    return "\n".join(lines)


# p90/p10 of a row's timings above which its median is called unreliable. An allreduce
# that the machine leaves alone varies by tens of percent between iterations; at twice,
# a tenth of the iterations took over twice as long as another tenth (other processes,
# frequency changes), and with few iterations the median shifts with where those land.
SPREAD_LIMIT = 2.0


def spread(row: Dict) -> float:
    """p90 / p10 of a row's timings (inf when p10 is zero)."""
    return row["p90_s"] / row["p10_s"] if row["p10_s"] > 0 else float("inf")


def spread_warnings(rows: List[Dict], iters: int, limit: float = SPREAD_LIMIT) -> List[str]:
    """One warning line per method whose timings spread beyond `limit` (p90/p10) at some
    size (the worst one named): its medians may move a lot between runs, so the line asks
    for more iterations. The JSON rows carry p10_s and p90_s, from which it follows."""
    wide: Dict[str, List[Dict]] = {}
    for r in rows:
        if spread(r) > limit:
            wide.setdefault(r["method"], []).append(r)
    sizes = len({r["elements"] for r in rows})
    more = max(100, 5 * iters)
    lines = []
    for method, flagged in wide.items():
        worst = max(flagged, key=spread)
        lines.append(f"# warning: {method} timings spread widely: p90/p10 = {spread(worst):.1f} at {worst['bytes']} B "
                     f"(p10 {worst['p10_s'] * 1e3:.2f} ms, p90 {worst['p90_s'] * 1e3:.2f} ms), above {limit:g} at "
                     f"{len(flagged)} of {sizes} size(s), so a median of {iters} iterations can change a lot "
                     f"between runs (is the machine busy?). Rerun with a larger --iters (e.g. --iters {more}), on a "
                     "quieter machine if you can")
    return lines


def report_allreduce(doc: Dict, json_path: Optional[str] = None, plot_path: Optional[str] = None) -> None:
    """Print the allreduce document, its rows completed with each call's limit
    (`lbcomm.cli.schema.add_limits`), and write it (with those fields) to `json_path`."""
    doc = add_limits(doc)
    c = doc["config"]
    print(allreduce_header(c))
    print(allreduce_table(doc["rows"]))
    for line in spread_warnings(doc["rows"], c["iters"]):
        print(line)
    link = c.get("bandwidth")
    if link:
        for r in doc["rows"]:
            if r["method"] == "fp32":
                bits = r["busbw_GBps"] * 8e9
                print(f"# fp32 at {r['bytes']} B: busbw {bits / 1e9:.3f} Gbit/s = {bits / parse_rate(link):.0%} of the "
                      f"{link} link")
    counted = [r for r in doc["rows"] if r.get("inter_node_bytes") is not None]
    if counted:
        G = c.get("ranks_per_node", 1)
        print(f"# bytes per call across the links between the {c['world_size'] // G} emulated nodes of {G} ranks "
              "(interface counters, all nodes):")
        by_size: Dict[int, Dict[str, Dict]] = {}
        for r in counted:
            by_size.setdefault(r["elements"], {})[r["method"]] = r
        for n, rows in by_size.items():
            parts = []
            for m, r in rows.items():
                parts.append(f"{m} {r['inter_node_bytes'] / 1e6:.3f} MB")
            line = f"#   {n} elements: " + ", ".join(parts)
            if "hier" in rows:
                h = rows["hier"]
                for m in ("onebit", "fp32"):
                    if m in rows and h["inter_node_bytes"]:
                        line += (f"; {m}/hier bytes {rows[m]['inter_node_bytes'] / h['inter_node_bytes']:.1f}x, "
                                 f"time {rows[m]['median_s'] / h['median_s']:.2f}x")
            print(line)
    emit(doc, json_path, plot_path, "plot_allreduce", doc["rows"],
         title=f"allreduce, {c['world_size']} ranks, {c['backend']}, "
               f"{link + ' links' if link else 'loopback (no shaping)'}")


# ---------------------------------------------------------------------------- train


def train_table(runs: List[Dict]) -> str:
    nodes = any(r.get("speedup_vs_hsdp") is not None or r.get("inter_node_bytes_per_step") is not None
                for run in runs for r in run["rows"])
    extra = f" {'vs hsdp':>8}" if nodes else ""
    sent = "MB inter-node/step" if nodes else "MB sent/step"
    hdr = (f"{'links':>9} {'method':>16} {'step ms':>9} {'p10 ms':>8} {'p90 ms':>8} {'samples/s':>10} "
           f"{'vs ddp':>7}{extra} {sent:>18} {'loss':>7}")
    lines = [hdr, "-" * len(hdr)]
    for run in runs:
        for r in run["rows"]:
            sp = f"{r['speedup_vs_ddp']:.2f}x" if r.get("speedup_vs_ddp") else "-"
            nb = r.get("inter_node_bytes_per_step") if nodes else r.get("wire_bytes_per_step")
            mb = f"{nb / 1e6:.2f}" if nb is not None else "-"
            col = ""
            if nodes:
                col = f" {r['speedup_vs_hsdp']:>7.2f}x" if r.get("speedup_vs_hsdp") else f" {'-':>8}"
            lines.append(f"{run['bandwidth'] or 'loopback':>9} {r['method']:>16} {r['median_s'] * 1e3:>9.1f} "
                         f"{r['p10_s'] * 1e3:>8.1f} {r['p90_s'] * 1e3:>8.1f} {r['samples_per_s']:>10.2f} {sp:>7}"
                         f"{col} {mb:>18} {r['final_loss']:>7.3f}")
    return "\n".join(lines)


def report_train(doc: Dict, json_path: Optional[str] = None, plot_path: Optional[str] = None) -> None:
    from .train import describe_model

    c = doc["config"]
    G = c.get("ranks_per_node") or 1
    ranks = f"{c['world_size'] // G} nodes x {G} ranks" if G > 1 else f"{c['world_size']} ranks"
    print(f"# lbcomm-bench train: {ranks}, {c['threads_per_rank']} thread(s) per rank, backend "
          f"{c['backend']}; {describe_model(c['model'], doc['params'])}")
    if G > 1:
        print("# nodes: the ranks of a node share one network namespace (loopback, unshaped), the nodes' links are "
              "shaped; MB inter-node/step: sum of the nodes' interface counters")
    print(f"# {c['steps']} timed steps x {c['rounds']} interleaved rounds per method after {c['warmup_steps']} "
          f"untimed; step time = slowest rank, median and p10/p90; samples/s over all ranks")
    for run in doc["runs"]:
        ddp = next((r for r in run["rows"] if r["method"] == "ddp"), None)
        frac = f" = {run['allreduce_s'] / ddp['median_s']:.0%} of a DDP+AdamW step" if ddp else ""
        print(f"# {run['bandwidth'] or 'loopback'}: fp32 allreduce of all {doc['params'] / 1e6:.2f}M gradients "
              f"alone {run['allreduce_s'] * 1e3:.0f} ms{frac}")
    print(train_table(doc["runs"]))
    for run in doc["runs"]:
        ratios = [f"{r['method']} {r['speedup_vs_hsdp']:.2f}x" for r in run["rows"]
                  if r.get("speedup_vs_hsdp") and r["method"] != "hsdp"]
        if ratios:
            print(f"# {run['bandwidth'] or 'loopback'}: samples/s against plain HSDP in the same run: "
                  + ", ".join(ratios))
    emit(doc, json_path, plot_path, "plot_train", doc["runs"],
         title=f"training-step throughput, {c['world_size']} ranks, {doc['params'] / 1e6:.1f}M-parameter "
               "transformer LM")


# ---------------------------------------------------------------------------- model


def check_table(checks: List[Dict]) -> str:
    hdr = (f"{'ranks':>5} {'links':>7} {'elements':>9} {'method':>8} {'measured':>10} {'model':>10} "
           f"{'model/meas':>10}")
    lines = [hdr, "-" * len(hdr)]
    for c in checks:
        if c["method"] == "speedup":
            a, b = c["measured_speedup"], c["predicted_speedup"]
            lines.append(f"{c['world_size']:>5} {c['bandwidth']:>7} {c['elements']:>9} {'speedup':>8} "
                         f"{a:>9.2f}x {b:>9.2f}x {b / a:>10.2f}{'  (calibration point)' if c['calibration'] else ''}")
        else:
            a, b = c["measured_s"] * 1e3, c["predicted_s"] * 1e3
            note = "  (calibrates alpha)" if c.get("calibration") else ""
            lines.append(f"{c['world_size']:>5} {c['bandwidth']:>7} {c['elements']:>9} {c['method']:>8} "
                         f"{a:>8.2f}ms {b:>8.2f}ms {b / a:>10.2f}{note}")
    return "\n".join(lines)


def grid_table(grid: List[Dict], world_sizes: Sequence[int], bandwidths: Sequence[str]) -> str:
    hdr = f"{'ranks':>5} " + " ".join(f"{bw:>14}" for bw in bandwidths)
    lines = [hdr + "   (speedup; onebit ms)", "-" * len(hdr)]
    for p in world_sizes:
        cells = []
        for bw in bandwidths:
            g = next(g for g in grid if g["world_size"] == p and g["bandwidth"] == bw)
            cells.append(f"{g['speedup']:>6.1f}x {g['onebit_s'] * 1e3:>6.1f}")
        lines.append(f"{p:>5} " + " ".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- advise


def advise_table(rows: List[Dict]) -> str:
    hdr = (f"{'method':>14} {'step ms':>9} {'vs fp32':>8} {'comm ms':>9} {'latency':>8} {'wire':>8} "
           f"{'compute':>8} {'MB/node/step':>13}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        lines.append(f"{r['method']:>14} {r['step_s'] * 1e3:>9.1f} {r['speedup_vs_fp32']:>7.2f}x "
                     f"{r['comm_s'] * 1e3:>9.1f} {r['latency_s'] * 1e3:>8.1f} {r['wire_s'] * 1e3:>8.1f} "
                     f"{r['compute_s'] * 1e3:>8.1f} {r['node_bytes_per_step'] / 1e6:>13.2f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- model-nodes


def nodes_check_table(checks: List[Dict]) -> str:
    hdr = (f"{'method':>7} {'elements':>9} {'measured':>10} {'model':>10} {'model/meas':>10} {'K':>8} "
           f"{'inter-node B meas':>17} {'model':>10}")
    lines = [hdr, "-" * len(hdr)]
    for c in checks:
        a, b = c["measured_s"] * 1e3, c["predicted_s"] * 1e3
        mb = c["measured_inter_node_bytes"]
        lines.append(f"{c['method']:>7} {c['elements']:>9} {a:>8.1f}ms {b:>8.1f}ms {b / a:>10.2f} "
                     f"{c['kernel_s'] * 1e3:>6.1f}ms {mb if mb is not None else '-':>17} "
                     f"{c['predicted_inter_node_bytes']:>10.0f}{'  (calibration)' if c['calibration'] else ''}")
    return "\n".join(lines)


def nodes_grid_table(grid: List[Dict], methods: Sequence[str]) -> str:
    hdr = f"{'params':>7} {'nodes':>5} {'links':>8} " + " ".join(f"{m:>11}" for m in methods) + "   best"
    lines = ["ms per gradient reduction (PREDICTION)", hdr, "-" * len(hdr)]
    for g in grid:
        times = {m: g[f"{m}_s"] for m in methods}
        best = min(times, key=times.get)
        lines.append(f"{g['params'] / 1e9:>6.2f}B {g['nodes']:>5} {g['bandwidth']:>8} "
                     + " ".join(f"{times[m] * 1e3:>11.2f}" for m in methods) + f"   {best}")
    return "\n".join(lines)
