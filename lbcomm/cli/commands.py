"""What each lbcomm-bench command does: start the ranks (or join them under torchrun or
mpirun), run the rank side of a task, and hand the JSON document to the report; `main`
parses and checks every argument first (lbcomm/cli/args.py)."""
from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional, Sequence

from . import launch
from .args import build_parser
from .argtypes import UsageError
from .checks import train_model, validate
from .report import advise_table, check_table, emit, grid_table, report_allreduce, report_train
from .schema import allreduce_config, allreduce_rows, check_allreduce_doc, document
from .units import format_count, parse_rate

__all__ = ["main", "run_task", "run_allreduce"]


def _threads(args, world_size: int) -> int:
    if args.threads:
        return args.threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, (os.cpu_count() or 1) // max(1, local))


def _progress_factory(enabled: bool, title: str):
    from .progress import Progress

    def make(total, per_item, label):
        return Progress(total, per_item, label, enabled=enabled, title=title)

    return make


def _run(spec: Dict, world: int, backend: str, bandwidth: Optional[str], args):
    """Run `spec` on `world` new ranks, in an emulated cluster when `bandwidth` is given
    (one namespace per node of ``args.ranks_per_node`` ranks); returns (rank 0's result,
    the cluster's rate or None)."""
    if not bandwidth:
        return launch.spawn(spec, world, backend, timeout=args.timeout), None
    cluster = launch.cluster_for(world, bandwidth, args.latency, args.burst,
                                 ranks_per_node=getattr(args, "ranks_per_node", None) or 1)
    with cluster:
        return launch.spawn(spec, world, backend, cluster=cluster, timeout=args.timeout), cluster.bandwidth


# ---------------------------------------------------------------------------- the rank side


def run_task(task: str, params: Dict, info: launch.RankInfo) -> Dict:
    """Run one benchmark task as rank `info.rank`; the result is meaningful on rank 0."""
    import torch

    torch.set_num_threads(params["threads"])
    transport, device = launch.join(params["backend"], info)
    try:
        show = params.get("progress", True) and transport.rank == 0
        if task == "allreduce":
            from .allreduce import measure

            sizes, methods, iters = params["sizes"], params["methods"], params["iters"]
            labels = [f"{format_count(n)} {m}" for n in sizes for m in methods]
            bar = _progress_factory(show, "allreduce ")(len(labels) * iters, iters, lambda i: labels[i])
            rows = measure(sizes, methods, iters, params["warmup"], params["block_size"], device=str(device),
                           transport=transport, progress=bar, pieces=params.get("pieces"),
                           ranks_per_node=params.get("ranks_per_node", 1),
                           profile=params.get("profile", False))
            bar.close()
            return {"rows": rows}
        if task == "train":
            from . import train

            return train.run_rank(params, transport, device, _progress_factory(show, "train "))
        if task == "race":
            from . import race

            return race.run_rank(params, transport, device)
        raise ValueError(f"unknown task {task!r}")
    finally:
        launch.leave(params["backend"])


# ---------------------------------------------------------------------------- allreduce


def _allreduce_params(args, world: int, sizes=None, methods=None) -> Dict:
    return dict(sizes=sizes or args.sizes, methods=methods or args.methods, iters=args.iters, warmup=args.warmup,
                block_size=args.block_size, pieces=args.pieces, threads=_threads(args, world),
                backend=args.backend, progress=not args.no_progress,
                ranks_per_node=getattr(args, "ranks_per_node", None) or 1)


def run_allreduce(args, bandwidth: Optional[str] = None, world_size: Optional[int] = None,
                  sizes: Optional[List[int]] = None, methods: Optional[List[str]] = None) -> Dict:
    """Run the allreduce benchmark as the launcher; returns the JSON document (unprinted)."""
    world = world_size or args.world_size or 4
    params = _allreduce_params(args, world, sizes, methods)
    result, rate = _run({"task": "allreduce", "params": params}, world, args.backend, bandwidth, args)
    launcher = "netem" if bandwidth else "mpirun" if args.backend == "mpi" else "local"
    shaping = dict(bandwidth=rate, latency=args.latency, burst=args.burst) if bandwidth else {}
    config = allreduce_config(world_size=world, backend=args.backend, launcher=launcher, threads=params["threads"],
                              iters=args.iters, warmup=args.warmup, block_size=args.block_size, pieces=args.pieces,
                              ranks_per_node=params["ranks_per_node"], **shaping)
    return document("allreduce", config=config, rows=allreduce_rows(result["rows"]))


def cmd_allreduce(args, info: Optional[launch.RankInfo]) -> int:
    if info is None:
        report_allreduce(run_allreduce(args, bandwidth=args.bandwidth), args.json, args.plot)
        return 0
    params = _allreduce_params(args, info.world_size)  # one rank of torchrun / mpirun
    result = run_task("allreduce", params, info)
    if info.rank == 0:
        config = allreduce_config(world_size=info.world_size, backend=args.backend, launcher=info.launcher,
                                  threads=params["threads"], iters=args.iters, warmup=args.warmup,
                                  block_size=args.block_size, pieces=args.pieces,
                                  ranks_per_node=params["ranks_per_node"])
        report_allreduce(document("allreduce", config=config, rows=allreduce_rows(result["rows"])), args.json,
                         args.plot)
    return 0


# ---------------------------------------------------------------------------- train


def _train_params(args, world: int, bandwidth: Optional[str]) -> Dict:
    return dict(model=train_model(args), methods=args.methods, steps=args.steps, rounds=args.rounds,
                warmup_steps=args.warmup_steps, lr=args.lr, threads=_threads(args, world), backend=args.backend,
                progress=not args.no_progress, netem=bool(bandwidth), allreduce_iters=args.allreduce_iters,
                ranks_per_node=args.ranks_per_node)


def cmd_train(args, info: Optional[launch.RankInfo]) -> int:
    runs = []
    if info is not None:
        params = _train_params(args, info.world_size, None)
        result = run_task("train", params, info)
        if info.rank != 0:
            return 0
        runs.append(dict(bandwidth=None, rows=result["rows"], allreduce_s=result["allreduce_s"]))
        world = info.world_size
    else:
        world = args.world_size
        for bw in args.bandwidth:
            params = _train_params(args, world, bw)
            result, rate = _run({"task": "train", "params": params}, world, args.backend, bw, args)
            runs.append(dict(bandwidth=rate, rows=result["rows"], allreduce_s=result["allreduce_s"]))
    config = dict(backend=args.backend, steps=args.steps, rounds=args.rounds, warmup_steps=args.warmup_steps,
                  latency=args.latency, burst=args.burst, world_size=world, threads_per_rank=params["threads"],
                  model=params["model"], methods=params["methods"], nodes=world // args.ranks_per_node,
                  ranks_per_node=args.ranks_per_node)
    report_train(document("train", config=config, params=result["params"], runs=runs), args.json, args.plot)
    return 0


# ---------------------------------------------------------------------------- model


def _measured(args) -> List[Dict]:
    """allreduce JSON documents: loaded from --from-json, or measured now at each world size."""
    docs = []
    if args.from_json:
        for path in args.from_json:
            with open(path) as f:
                doc = json.load(f)
            check_allreduce_doc(doc)
            if not doc["config"].get("bandwidth"):
                raise UsageError(f"--from-json {path}: the model needs runs in the emulated cluster "
                                 "(allreduce --bandwidth ...)")
            docs.append(doc)
        return docs
    for p in args.world_sizes:
        print(f"# measuring {p} ranks at {args.bandwidth} ...", file=sys.stderr)
        docs.append(run_allreduce(args, bandwidth=args.bandwidth, world_size=p, sizes=args.sizes,
                                  methods=["fp32", "onebit"]))
    return docs


def cmd_model(args, info) -> int:
    from .model import PAYLOAD_FRACTION, calibrate_alpha, compute_times, predict

    docs = _measured(args)
    checks: List[Dict] = []
    alphas: Dict[str, Dict[str, float]] = {}
    for doc in docs:
        c = doc["config"]
        bps, p = parse_rate(c["bandwidth"]), c["world_size"]
        rows = doc["rows"]
        block = c.get("block_size", args.block_size)
        sizes = sorted({r["elements"] for r in rows})
        methods = [m for m in ("fp32", "onebit") if any(r["method"] == m for r in rows)]
        print(f"# timing the local compute of {p} ranks at once ...", file=sys.stderr)
        k_here = compute_times([(m, n, p) for m in methods for n in sizes], block, processes=p)
        alpha = {}
        for m in methods:
            r0 = next(r for r in rows if r["elements"] == sizes[0] and r["method"] == m)
            alpha[m] = calibrate_alpha(m, sizes[0], p, bps, r0["median_s"], k_here[(m, sizes[0], p)], block)
        alphas[str(p)] = alpha
        for n in sizes:
            pred, meas = {}, {}
            for m in methods:
                r = next((r for r in rows if r["elements"] == n and r["method"] == m), None)
                if r is None:
                    continue
                meas[m] = r["median_s"]
                pred[m] = predict(m, n, p, bps, alpha[m], k_here[(m, n, p)], block_size=block)
                checks.append(dict(world_size=p, bandwidth=c["bandwidth"], elements=n, method=m,
                                   measured_s=meas[m], predicted_s=pred[m], compute_s=k_here[(m, n, p)],
                                   calibration=n == sizes[0]))
            if len(pred) == 2:
                checks.append(dict(world_size=p, bandwidth=c["bandwidth"], elements=n, method="speedup",
                                   measured_speedup=meas["fp32"] / meas["onebit"],
                                   predicted_speedup=pred["fp32"] / pred["onebit"], calibration=n == sizes[0]))

    # Predictions for a real cluster: one rank per node, compute timed in one process.
    n, alpha = args.predict_size, args.predict_alpha
    k_node = compute_times([(m, n, p) for p in args.predict_world_sizes for m in ("fp32", "onebit")],
                           args.block_size, processes=1)
    grid = []
    for p in args.predict_world_sizes:
        for bw in args.predict_bandwidths:
            bps = parse_rate(bw)
            t32 = predict("fp32", n, p, bps, alpha, k_node[("fp32", n, p)])
            t1 = predict("onebit", n, p, bps, alpha, k_node[("onebit", n, p)], block_size=args.block_size)
            grid.append(dict(world_size=p, bandwidth=bw, elements=n, fp32_s=t32, onebit_s=t1, speedup=t32 / t1,
                             compute_fp32_s=k_node[("fp32", n, p)], compute_onebit_s=k_node[("onebit", n, p)]))

    print(f"# alpha-beta model: T = 2(p-1) alpha + bytes/(B * {PAYLOAD_FRACTION:.3f}) + K(n, p); K = local compute "
          f"per call measured here (one thread per rank)")
    if checks:
        print("# measured points: K timed with all p ranks' processes at once on this machine; alpha calibrated on "
              "the smallest size: " + "; ".join(f"{p} ranks: fp32 {a.get('fp32', 0) * 1e6:.0f} us, onebit "
                                              f"{a.get('onebit', 0) * 1e6:.0f} us" for p, a in alphas.items()))
        print(check_table(checks))
    print(f"\n# predicted for a real cluster (one rank per node, K timed in one process, alpha {alpha * 1e6:.0f} us): "
          f"onebit speedup over fp32 and onebit time, {n} elements ({4 * n / 2**20:g} MiB)")
    print(grid_table(grid, args.predict_world_sizes, args.predict_bandwidths))
    doc = document("model", alpha_s=alphas, predict_alpha_s=alpha, payload_fraction=PAYLOAD_FRACTION, checks=checks,
                   grid=grid, measured=docs)
    emit(doc, args.json, args.plot, "plot_model", grid,
         [c for c in checks if c["method"] == "speedup" and c["elements"] == n],
         title=f"alpha-beta model, {n * 4 / 2**20:g} MiB fp32: onebit speedup over fp32")
    return 0


# ---------------------------------------------------------------------------- model-nodes


def _nodes_doc(args) -> Dict:
    """The allreduce document of the calibration: loaded (--from-json) or measured now."""
    if args.from_json:
        with open(args.from_json) as f:
            doc = json.load(f)
        check_allreduce_doc(doc)
        c = doc["config"]
        G = c.get("ranks_per_node") or 1
        have = {r["method"] for r in doc["rows"]}
        sizes = {r["elements"] for r in doc["rows"]}
        if not c.get("bandwidth") or G < 2 or not {"fp32", "onebit", "hier"} <= have or len(sizes) < 3:
            raise UsageError(f"--from-json {args.from_json}: the node model needs a run on emulated nodes "
                             "(allreduce --nodes N --ranks-per-node G --bandwidth B --methods fp32,onebit,hier) "
                             "with at least 3 sizes")
        return doc
    args.pieces = 1  # the model is of the unpipelined call
    world = args.nodes * args.ranks_per_node
    print(f"# measuring {args.nodes} nodes x {args.ranks_per_node} ranks at {args.bandwidth} ...", file=sys.stderr)
    return run_allreduce(args, bandwidth=args.bandwidth, world_size=world, sizes=args.sizes,
                         methods=["fp32", "onebit", "hier"])


def cmd_model_nodes(args, info) -> int:
    from .model import PAYLOAD_FRACTION
    from .nodemodel import NODE_METHODS, Links, fit_emulated, gpu_kernel_s, node_cost
    from .report import nodes_check_table, nodes_grid_table

    doc = _nodes_doc(args)
    c = doc["config"]
    G = c["ranks_per_node"]
    N, p = c["world_size"] // G, c["world_size"]
    block = c.get("block_size", args.block_size)
    rows = {(r["method"], r["elements"]): r for r in doc["rows"]}
    sizes = sorted({n for _, n in rows})
    bx = parse_rate(c["bandwidth"]) / 8 * PAYLOAD_FRACTION
    fits, checks = {}, []
    for m in ("fp32", "onebit", "hier"):
        fits[m] = fit_emulated(m, [(n, rows[m, n]["median_s"]) for n in sizes[:2]], N, G, bx, block)
        links = Links(bx, float("inf"), fits[m]["alpha_s"], fits[m]["alpha_s"])
        for n in sizes:
            pr = node_cost(m, n, N, G, links, fits[m]["kappa_s"] * n, block)
            meas = rows[m, n]
            checks.append(dict(method=m, elements=n, measured_s=meas["median_s"], predicted_s=pr["total_s"],
                               kernel_s=pr["kernel_s"], calibration=n in sizes[:2],
                               measured_inter_node_bytes=meas.get("inter_node_bytes"),
                               predicted_inter_node_bytes=N * pr["node_bytes"]))
    calibration = dict(nodes=N, ranks_per_node=G, bandwidth=c["bandwidth"], inter_Bps=bx, fits=fits)
    print(f"# node model: {N} emulated nodes x {G} ranks, links {c['bandwidth']} (payload {bx / 1e6:.1f} MB/s); "
          f"per method, latency per message and local compute per element (K = kappa n: kernels, copies and the "
          f"shared-memory stages of {p} ranks on this machine's cores) fitted on the two smallest sizes")
    print("# fitted: " + "; ".join(f"{m} alpha {f['alpha_s'] * 1e6:.0f} us, kappa {f['kappa_s'] * 1e9:.2f} ns/element"
                                   for m, f in fits.items()))
    print(nodes_check_table(checks))

    # PREDICTION for GPU clusters
    G2, alpha, alpha_i = args.predict_ranks_per_node, args.predict_alpha, args.predict_intra_alpha
    grid = []
    for P in args.predict_params:
        for N2 in args.predict_nodes:
            for bw in args.predict_bandwidths:
                links = Links(parse_rate(bw) / 8 * PAYLOAD_FRACTION, args.intra_bandwidth, alpha, alpha_i)
                cell = dict(params=P, nodes=N2, ranks_per_node=G2, bandwidth=bw)
                for m in NODE_METHODS:
                    cell[f"{m}_s"] = node_cost(m, P, N2, G2, links, gpu_kernel_s(m, P, N2, G2, args.mem_bandwidth),
                                               block)["total_s"]
                grid.append(cell)
    assumptions = dict(ranks_per_node=G2, inter_alpha_s=alpha, intra_alpha_s=alpha_i, intra_Bps=args.intra_bandwidth,
                       mem_Bps=args.mem_bandwidth, payload_fraction=PAYLOAD_FRACTION, block_size=block)
    print(f"\n# PREDICTION (not measured): one gradient reduction per step, {G2} GPUs per node; links between nodes "
          f"at the rate given x {PAYLOAD_FRACTION:.3f}, {alpha * 1e6:.0f} us per message; inside a node "
          f"{args.intra_bandwidth / 1e9:.0f} GB/s per GPU, {alpha_i * 1e6:.0f} us; 1-bit kernels estimated from "
          f"memory traffic at {args.mem_bandwidth / 1e12:.1f} TB/s; NCCL's fp32/bf16 reductions bounded by the "
          "links; no overlap with compute; HSDP rows exclude FSDP's parameter all-gather")
    print(nodes_grid_table(grid, NODE_METHODS))
    emit(document("model-nodes", calibration=calibration, checks=checks, assumptions=assumptions, grid=grid,
                  measured=doc), args.json)
    return 0


# ---------------------------------------------------------------------------- advise


def cmd_advise(args, info) -> int:
    from .advise import advise

    bps = parse_rate(args.bandwidth)
    p = args.nodes * args.ranks_per_node
    print(f"# timing the local compute of each method on this machine ({args.device}, one thread) ...",
          file=sys.stderr)
    res = advise(args.params, args.nodes, args.ranks_per_node, bps, args.latency, args.step_time,
                 block_size=args.block_size, powersgd_rank=args.powersgd_rank, width=args.width,
                 bucket_bytes=args.bucket_size, device=args.device,
                 intra_bandwidth_bps=None if args.intra_bandwidth is None else parse_rate(args.intra_bandwidth),
                 cores_per_rank=args.cores_per_rank)
    print(f"# lbcomm-bench advise: {args.params / 1e6:.1f}M parameters, {args.nodes} node(s) x {args.ranks_per_node} "
          f"rank(s) = {p} ranks, {args.bandwidth} links, {args.latency * 1e6:.0f} us per message, compute "
          f"{args.step_time * 1e3:.1f} ms per step")
    print("# predicted per step (no overlap of communication with compute); comm = latency + wire + compute")
    print(advise_table(res["rows"]))
    for line in res["verdict"]:
        print(f"# {line}")
    inputs = dict(params=args.params, nodes=args.nodes, ranks_per_node=args.ranks_per_node, bandwidth=args.bandwidth,
                  latency_s=args.latency, step_time_s=args.step_time, block_size=args.block_size,
                  powersgd_rank=args.powersgd_rank, width=args.width, bucket_bytes=args.bucket_size,
                  device=args.device, intra_bandwidth=args.intra_bandwidth, cores_per_rank=args.cores_per_rank)
    emit(document("advise", inputs=inputs, verdict=res["verdict"], rows=res["rows"]), args.json)
    return 0


# ---------------------------------------------------------------------------- main


def cmd_race(args, info) -> int:
    from .racecli import cmd_race as race

    return race(args, info)


_COMMANDS = {"allreduce": cmd_allreduce, "train": cmd_train, "model": cmd_model, "model-nodes": cmd_model_nodes,
             "advise": cmd_advise, "race": cmd_race}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_rank"]:  # a rank started by launch.spawn: python -m lbcomm.cli _rank SPEC
        if len(argv) != 2:
            raise SystemExit("usage: lbcomm-bench _rank SPEC (started by lbcomm-bench itself)")
        return launch.run_spawned(argv[1], run_task)
    args = build_parser().parse_args(argv)
    try:
        info = launch.launched_rank()
        validate(args, info)
        return _COMMANDS[args.command](args, info)
    except KeyboardInterrupt:
        print("lbcomm-bench: interrupted; ranks killed and any emulated cluster torn down", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"lbcomm-bench: error: {exc}", file=sys.stderr)
        return 1
