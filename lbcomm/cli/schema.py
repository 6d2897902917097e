"""The JSON documents lbcomm-bench writes: their fields (with the words ``--help`` shows),
builders and checkers.

``allreduce``: one object, ``schema`` = "lbcomm-bench/allreduce", ``version`` = 1,
``created`` (UTC ISO 8601), ``argv``, ``config`` (`ALLREDUCE_CONFIG_FIELDS`), ``host``
(`HOST_FIELDS`) and ``rows``, one per (size, method), with exactly the keys of
`ALLREDUCE_ROW_FIELDS` (the report completes each row with its limit, `add_limits`).
``train`` writes "lbcomm-bench/train" (``runs``: one per bandwidth, each with its
``rows``, `TRAIN_ROW_FIELDS`), ``model`` "lbcomm-bench/model" and ``advise``
"lbcomm-bench/advise" (`ADVISE_ROW_FIELDS`).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from typing import Dict, List, Optional, Set

from .allreduce import METHODS as ALLREDUCE_METHODS

__all__ = ["SCHEMA_VERSION", "ALLREDUCE_ROW_FIELDS", "ALLREDUCE_CONFIG_FIELDS", "HOST_FIELDS", "TRAIN_ROW_FIELDS",
           "ADVISE_ROW_FIELDS", "document", "allreduce_config", "allreduce_rows", "add_limits", "call_limit",
           "check_allreduce_doc", "check_head", "check_train_doc", "host", "write_json", "describe_fields"]

SCHEMA_VERSION = 1

# name: (type(s), description) of each row of an allreduce JSON document.
ALLREDUCE_ROW_FIELDS = {
    "bytes": (int, "size of the fp32 tensor in bytes (4 * elements)"),
    "elements": (int, "fp32 elements of the tensor"),
    "method": (str, "fp32 | fp16 | onebit | hier (fp32 inside a node, 1 bit between nodes)"),
    "world_size": (int, "ranks"),
    "median_s": (float, "median over iterations of the slowest rank's time per allreduce, seconds"),
    "p10_s": (float, "10th percentile of the same, seconds"),
    "p90_s": (float, "90th percentile of the same, seconds"),
    "algbw_GBps": (float, "bytes / median_s / 1e9 (GB/s)"),
    "busbw_GBps": (float, "algbw_GBps * 2 (p - 1) / p, as nccl-tests reports for allreduce (GB/s)"),
    "wire_bytes_per_rank": (int, "bytes each rank sends per allreduce (ring for fp32/fp16; both collectives "
                                 "with scales and headers for onebit)"),
    "speedup_vs_fp32": ((float, type(None)), "fp32 median_s / this median_s at the same size; null without fp32"),
    "inter_node_bytes": ((int, type(None)), "bytes per call that crossed the links between emulated nodes, read "
                                            "from the interface counters (all nodes); null: not on emulated nodes"),
    # the printed report warns above its SPREAD_LIMIT (lbcomm/cli/report.py)
    "spread_p90_p10": ((float, type(None)), "p90_s / p10_s: above 2 the printed report warns that the median may "
                                            "change a lot between runs; null when p10_s is 0"),
    # the limit of each call on this testbed (add_limits; docs/cli.md)
    "compute_s": ((float, type(None)), "local compute of one call without communication, timed on the ranks "
                                       "after the timed calls (slowest rank); null in hier rows of files from "
                                       "before hier had a compute model"),
    "wire_s": ((float, type(None)), "wire_bytes_per_rank at the emulated link's TCP payload rate (with nodes: "
                                    "inter_node_bytes per node link at the link rate); null over loopback"),
    "limit_s": ((float, type(None)), "the testbed's limit of one call: max(wire_s, compute_s) (they overlap), "
                                     "compute_s alone over loopback; null when neither is known"),
    "limit_fraction": ((float, type(None)), "limit_s / median_s: the share of the limit the call reaches"),
    # where the time goes when the host's cores are the bottleneck (docs/cli.md)
    "cpu_s": ((float, type(None)), "CPU time (user + system, all threads) of one call per rank, mean over the "
                                   "ranks: the kernels, the transport's copies and system calls, Python"),
    "compute_cpu_s": ((float, type(None)), "the CPU time of compute_s's work per rank (mean over the ranks); "
                                           "cpu_s minus this is what the transport and the rest cost"),
    "host_busy": ((float, type(None)), "share of the host's CPU capacity busy during the timed calls (all cores, "
                                       "/proc/stat; the busiest host); null where not readable or the calls took "
                                       "under 10 of its ticks per CPU (0.1 s at 100 Hz)"),
}
ALLREDUCE_CONFIG_FIELDS = {
    "world_size": (int, "ranks"),
    "backend": (str, "gloo | nccl | mpi"),
    "device": (str, "cpu or cuda"),
    "launcher": (str, "local (spawned over loopback) | netem (emulated cluster) | torchrun | mpirun"),
    "threads_per_rank": (int, "torch intra-op threads per rank"),
    "iters": (int, "timed iterations per size and method"),
    "warmup": (int, "untimed iterations first"),
    "block_size": ((int, type(None)), "elements per onebit scale block; null: one scale per chunk"),
    "pieces": ((int, type(None)), "onebit pieces per chunk (pipelined transfers); null: automatic"),
    "bandwidth": ((str, type(None)), "emulated link rate per direction and rank (tc syntax); null: not shaped"),
    "latency": ((str, type(None)), "tbf queue latency of the emulated links; null: not shaped"),
    "burst": ((str, type(None)), "tbf burst of the emulated links; null: not shaped"),
    "ranks_per_node": (int, "ranks per (emulated) node; 1: one namespace per rank"),
}
# Fields added after version 1 was published: documents written before may lack them.
OPTIONAL_FIELDS = {"inter_node_bytes", "ranks_per_node", "speedup_vs_hsdp", "inter_node_bytes_per_step",
                   "spread_p90_p10", "compute_s", "wire_s", "limit_s", "limit_fraction", "cpu_s", "compute_cpu_s",
                   "host_busy", "members"}
HOST_FIELDS = {
    "torch": (str, "torch version"),
    "lbcomm": (str, "lbcomm version"),
    "python": (str, "Python version"),
    "machine": (str, "CPU architecture, e.g. x86_64"),
    "cpu_count": (int, "logical CPUs"),
    "loadavg": (list, "1, 5 and 15 minute load averages when the run ended"),
}
TRAIN_ROW_FIELDS = {
    "method": (str, "none | ddp | fp16 | powersgd | onebit_hook | onebit_adam; with nodes also onebit_hook_hier | "
                    "hsdp | hsdp_onebit | hsdp_onebit_published | fsdp_onebit_adam"),
    "median_s": (float, "median training-step time (slowest rank), seconds"),
    "p10_s": (float, "10th percentile, seconds"),
    "p90_s": (float, "90th percentile, seconds"),
    "samples_per_s": (float, "world_size * batch / median_s"),
    "tokens_per_s": (float, "samples_per_s * seq_len"),
    "wire_bytes_per_step": ((float, type(None)), "bytes sent per step by the busiest rank, measured on its "
                                                 "interface (headers included); null over loopback"),
    "final_loss": ((float, type(None)), "loss of the last timed step on rank 0"),
    "speedup_vs_ddp": ((float, type(None)), "ddp median_s / this median_s"),
    "speedup_vs_hsdp": ((float, type(None)), "hsdp median_s / this median_s (= samples/s ratio); null without hsdp"),
    "inter_node_bytes_per_step": ((float, type(None)), "bytes per step that crossed the links between emulated "
                                                       "nodes (sum over the nodes' interface counters); null "
                                                       "without nodes"),
}
ADVISE_ROW_FIELDS = {
    "method": (str, "fp32 | fp16 | powersgd | onebit_warmup | onebit"),
    "comm_s": (float, "predicted communication per step: latency_s + wire_s + compute_s, seconds"),
    "latency_s": (float, "latency per message times the messages of one step, seconds"),
    "wire_s": (float, "node_bytes_per_step / usable link bandwidth, seconds"),
    "compute_s": (float, "local compute of the method's collectives per step (casts, adds, compression), s"),
    "step_s": (float, "predicted step time: the given compute time + comm_s (no overlap), seconds"),
    "speedup_vs_fp32": (float, "fp32 step_s / this step_s"),
    "node_bytes_per_step": (float, "bytes each node sends over its link per step"),
}


def describe_fields(fields: Dict) -> str:
    """One line per field, for --help."""
    return "\n".join(f"  {name:<20} {desc}" for name, (_, desc) in fields.items())


def host() -> Dict:
    import torch

    from .. import __version__

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {"torch": torch.__version__, "lbcomm": __version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpu_count": os.cpu_count() or 1, "loadavg": load}


def document(kind: str, **fields) -> Dict:
    """The common head of every document (schema, version, created, argv, host) and `fields`."""
    return {"schema": f"lbcomm-bench/{kind}", "version": SCHEMA_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv, **fields, "host": host()}


def write_json(path: str, doc: Dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def allreduce_config(*, world_size: int, backend: str, launcher: str, threads: int, iters: int, warmup: int,
                     block_size: Optional[int], pieces: Optional[int], bandwidth: Optional[str] = None,
                     latency: Optional[str] = None, burst: Optional[str] = None, ranks_per_node: int = 1) -> Dict:
    return dict(world_size=world_size, backend=backend, device="cuda" if backend == "nccl" else "cpu",
                launcher=launcher, threads_per_rank=threads, iters=iters, warmup=warmup, block_size=block_size,
                pieces=pieces, bandwidth=bandwidth, latency=latency, burst=burst, ranks_per_node=ranks_per_node)


def allreduce_rows(rows: List[Dict]) -> List[Dict]:
    """The rows of `lbcomm.cli.allreduce.measure` in the JSON schema's names."""
    return [{"bytes": int(r["bytes"]), "elements": int(r["size"]), "method": r["method"],
             "world_size": int(r["world_size"]), "median_s": float(r["median_s"]), "p10_s": float(r["p10_s"]),
             "p90_s": float(r["p90_s"]), "algbw_GBps": float(r["algbw_gbps"]), "busbw_GBps": float(r["busbw_gbps"]),
             "wire_bytes_per_rank": int(r["wire_bytes"]),
             "speedup_vs_fp32": None if r.get("speedup_vs_fp32") is None else float(r["speedup_vs_fp32"]),
             "inter_node_bytes": None if r.get("inter_node_bytes") is None else int(r["inter_node_bytes"]),
             "spread_p90_p10": float(r["p90_s"]) / float(r["p10_s"]) if r["p10_s"] > 0 else None,
             **{k: None if r.get(k) is None else float(r[k]) for k in ("compute_s", "cpu_s", "compute_cpu_s",
                                                                       "host_busy")}}
            for r in rows]


def call_limit(wire_s: Optional[float], compute_s: Optional[float]) -> Optional[float]:
    """The limit of one call: max(wire_s, compute_s) of those known, None if neither is.
    The call is pipelined in pieces (its compression overlaps the transfers), so at best
    the slower of the two takes all of the call's time."""
    known = [t for t in (wire_s, compute_s) if t is not None]
    return max(known) if known else None


def add_limits(doc: Dict) -> Dict:
    """`doc` with every row's wire_s, limit_s and limit_fraction filled in from its own
    fields and the config's link rate: wire_s is wire_bytes_per_rank at the TCP payload
    rate of the emulated link (one namespace per rank), or with emulated nodes the bytes
    each node's link carried per call (inter_node_bytes / nodes, whole frames) at the link
    rate; None over loopback or without a count."""
    from .model import PAYLOAD_FRACTION
    from .units import parse_rate

    c = doc["config"]
    rate = parse_rate(c["bandwidth"]) if c.get("bandwidth") else None
    nodes = c["world_size"] // max(1, c.get("ranks_per_node") or 1)
    rows = []
    for r in doc["rows"]:
        wire = None
        if rate is not None and (c.get("ranks_per_node") or 1) == 1:
            wire = r["wire_bytes_per_rank"] / (rate / 8 * PAYLOAD_FRACTION)
        elif rate is not None and r.get("inter_node_bytes") is not None:
            wire = r["inter_node_bytes"] / nodes / (rate / 8)
        limit = call_limit(wire, r.get("compute_s"))
        rows.append(dict(r, wire_s=wire, limit_s=limit,
                         limit_fraction=None if limit is None else limit / r["median_s"]))
    return dict(doc, rows=rows)


def _type_ok(value, types) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True  # a float field may hold an int (e.g. a speedup of exactly 1)
    return isinstance(value, types)


def _check_fields(obj, fields: Dict, where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    missing, extra = sorted(set(fields) - set(obj) - OPTIONAL_FIELDS), sorted(set(obj) - set(fields))
    if missing or extra:
        raise ValueError(f"{where}: missing keys {missing}, unexpected keys {extra}")
    for name, (types, _) in fields.items():
        if name not in obj:
            continue
        if not _type_ok(obj[name], types):
            raise ValueError(f"{where}.{name}: expected {types}, got {obj[name]!r}")


def check_allreduce_doc(doc: Dict) -> None:
    """Raise ValueError naming the first field of `doc` that breaks the allreduce JSON schema."""
    if not isinstance(doc, dict):
        raise ValueError("document: expected an object")
    top = {"schema", "version", "created", "argv", "config", "host", "rows"}
    if set(doc) != top:
        raise ValueError(f"document: keys {sorted(doc)}, expected {sorted(top)}")
    if doc["schema"] != "lbcomm-bench/allreduce" or doc["version"] != SCHEMA_VERSION:
        raise ValueError(f"document: schema {doc['schema']!r} version {doc['version']!r}, expected "
                         f"'lbcomm-bench/allreduce' version {SCHEMA_VERSION}")
    if not isinstance(doc["created"], str) or not isinstance(doc["argv"], list):
        raise ValueError("document: created must be a string and argv a list")
    _check_fields(doc["config"], ALLREDUCE_CONFIG_FIELDS, "config")
    _check_fields(doc["host"], HOST_FIELDS, "host")
    if not isinstance(doc["rows"], list) or not doc["rows"]:
        raise ValueError("rows: expected a non-empty list")
    for i, row in enumerate(doc["rows"]):
        _check_fields(row, ALLREDUCE_ROW_FIELDS, f"rows[{i}]")
        if row["bytes"] != 4 * row["elements"]:
            raise ValueError(f"rows[{i}]: bytes {row['bytes']} != 4 * elements {row['elements']}")
        if row["method"] not in ALLREDUCE_METHODS:
            raise ValueError(f"rows[{i}].method: {row['method']!r} is not one of {ALLREDUCE_METHODS}")
        frac, limit = row.get("limit_fraction"), row.get("limit_s")
        if (frac is None) != (limit is None) or (limit is not None
                                                 and abs(frac * row["median_s"] - limit) > 1e-9 * limit):
            raise ValueError(f"rows[{i}].limit_fraction: {frac!r} is not limit_s / median_s "
                             f"({limit!r} / {row['median_s']!r})")


def check_head(doc: Dict, kind: str, keys: Set[str]) -> None:
    """Raise ValueError unless `doc` is an 'lbcomm-bench/<kind>' document of this version
    whose keys are `document`'s head (schema, version, created, argv, host) and `keys`, with
    a valid host."""
    if not isinstance(doc, dict) or doc.get("schema") != f"lbcomm-bench/{kind}" or doc.get("version") != SCHEMA_VERSION:
        raise ValueError(f"document: not an 'lbcomm-bench/{kind}' version {SCHEMA_VERSION} document")
    top = {"schema", "version", "created", "argv", "host"} | set(keys)
    if set(doc) != top:
        raise ValueError(f"document: keys {sorted(doc)}, expected {sorted(top)}")
    _check_fields(doc["host"], HOST_FIELDS, "host")


def check_train_doc(doc: Dict) -> None:
    """Raise ValueError naming the first field of `doc` that breaks the train JSON schema."""
    check_head(doc, "train", {"config", "params", "runs"})
    for i, run in enumerate(doc["runs"]):
        if set(run) != {"bandwidth", "allreduce_s", "rows"}:
            raise ValueError(f"runs[{i}]: keys {sorted(run)}, expected ['allreduce_s', 'bandwidth', 'rows']")
        for j, row in enumerate(run["rows"]):
            _check_fields(row, TRAIN_ROW_FIELDS, f"runs[{i}].rows[{j}]")
