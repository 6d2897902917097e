"""`lbcomm-bench race`, the launcher's side: its options, the checks, the runs (one emulated
cluster per bandwidth, or loopback), the table, the JSON document and the plot. The ranks'
side is race.py (the loop, the data) and racemethods.py (the methods)."""
from __future__ import annotations

import math
import sys
from typing import Dict, List, Optional

from .argtypes import (UsageError, _choices, _comma, _float_over, _int_at_least, _momentum, _positive, _rate_or_none,
                       _seconds, check_cluster)
from ..config import DEFAULT_BLOCK_SIZE
from .racemethods import FAMILIES, LOCAL_FAMILIES, unavailable
from .schema import _check_fields, check_head, describe_fields, document

__all__ = ["add_parser", "check", "cmd_race", "race_table", "check_race_doc", "RACE_ROW_FIELDS", "MODEL"]

# A byte-level TinyLM of 12.7M parameters with 32 tokens per rank and step (the regime of
# `train`'s small preset: many parameters, little compute per step), so that at 1 Gbit/s and
# 4 ranks DDP's fp32 gradient allreduce is most of its step.
MODEL = dict(d_model=512, layers=4, heads=8, seq_len=32, batch=1, train_bytes=4 * 2**20, val_bytes=2**19)

RACE_ROW_FIELDS = {
    "method": (str, "the method and its H: ddp | bf16 | powersgd | onebit_hook | onebit_adam | zeroone_adam | "
                    "diloco_hH | onebit_local_hH"),
    "family": (str, "the method without H"),
    "sync_every": ((int, type(None)), "H: inner steps per outer step (local-update methods); null otherwise"),
    "reached": (bool, "the validation loss reached the target before the cap"),
    "time_to_target_s": ((float, type(None)), "clocked seconds at the first evaluation at or below the target"),
    "speedup_vs_ddp": ((float, type(None)), "ddp time_to_target_s / this time_to_target_s"),
    "steps_to_target": ((int, type(None)), "training steps (inner steps) at that evaluation"),
    "bytes_per_rank_to_target": ((float, type(None)), "bytes sent by the busiest rank until then (interface "
                                                      "counter, clocked time only); null over loopback"),
    "loss_at_ddp_time": ((float, type(None)), "validation loss at the last evaluation within ddp's "
                                              "time_to_target_s; null without ddp"),
    "final_val_loss": (float, "validation loss at the last evaluation"),
    "final_step": (int, "training steps done"),
    "final_time_s": (float, "clocked seconds when the method stopped"),
    "step_s": (float, "final_time_s / final_step: clocked seconds per step, syncs and warmups included"),
    "comm_share": (float, "1 - compute_step_s / step_s: the share of a step spent beyond the compute floor "
                          "(communication, compression, waiting)"),
    "curve": (list, "evaluations: step, time_s (clocked), val_loss, bytes_per_rank"),
}


def _methods(text: str) -> List[str]:
    return _choices(FAMILIES, "method")(text)


def add_parser(sub, make) -> None:
    """The race subcommand on `sub` (`make`: args.py's subparser factory)."""
    p = make(sub, "race", "wall-clock time to a target validation loss, lbcomm against its peers",
             "Race to a target validation loss: a byte-level transformer LM (TinyLM, vocabulary 256) learns the\n"
             "Python standard library's source (every 10th file held out for validation). DDP + AdamW trains\n"
             "--steps steps; its validation loss then is the target. Every other method starts from the same\n"
             "weights, sees the same samples, and trains until it reaches the target and DDP's time, or the\n"
             "cap. The clock counts every training step (warmups, syncs, compression) as the slowest rank's\n"
             "time and is paused while the validation loss is measured (every --eval-every steps;\n"
             "local-update methods at their next sync). Methods: ddp, bf16 (torch's bf16_compress_hook),\n"
             "powersgd (torch's PowerSGD hook, rank 4), onebit_hook, onebit_adam, zeroone_adam (lbcomm),\n"
             "diloco (torchft's DiLoCo, outer Nesterov SGD, --outer-lr, --outer-momentum; needs torchft) and\n"
             "onebit_local (lbcomm.OneBitLocalUpdates, the same outer step on the 1-bit compressed outer momentum).",
             "JSON: schema lbcomm-bench/race with config, params, skipped (methods not run, and why) and runs\n"
             "(one per bandwidth: bandwidth, target_loss, ddp_time_s, compute_step_s, rows); one row per\n"
             "method:\n" + describe_fields(RACE_ROW_FIELDS))
    p.add_argument("--world-size", type=_int_at_least(2), default=4, help="ranks (default: 4)")
    p.add_argument("--backend", choices=("gloo",), default="gloo", help="gloo, CPU tensors (default: gloo)")
    p.add_argument("--bandwidth", type=_comma(_rate_or_none), default=["1gbit"],
                   help="comma-separated link rates, one emulated cluster and race each (needs root); 'none' for "
                        "loopback (default: 1gbit)")
    p.add_argument("--latency", default="50ms", help="with --bandwidth: tbf queue latency (default: 50ms)")
    p.add_argument("--burst", default="256kb", help="with --bandwidth: tbf burst (default: 256kb)")
    p.add_argument("--delay", default="0", help="with --bandwidth: one-way delay between two ranks, as on a "
                   "wide-area link, e.g. 50ms (a delay line in front of the rate limit) (default: 0, none)")
    p.add_argument("--methods", type=_methods, default=None,
                   help=f"comma-separated subset of {','.join(FAMILIES)} (default: all; diloco is left out "
                        "with a note when torchft is not installed)")
    p.add_argument("--diloco-h", type=_comma(_positive), default=[16, 64],
                   help="diloco: inner steps per sync, one race each (default: 16,64)")
    p.add_argument("--local-h", type=_comma(_positive), default=[4, 8, 16],
                   help="onebit_local: inner steps per sync, one race each (default: 4,8,16)")
    p.add_argument("--local-overlap", type=_int_at_least(0), default=0,
                   help="onebit_local: inner steps each sync runs behind the training (OneBitLocalUpdates' overlap, "
                        "< every --local-h) (default: 0)")
    p.add_argument("--local-block-size", type=_positive, default=DEFAULT_BLOCK_SIZE,
                   help="onebit_local: elements per scale block of the 1-bit outer exchange (CommConfig's "
                        "block_size); 256 or less for a run trained near its floor (docs/internet.md) "
                        f"(default: {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--outer-lr", type=_float_over(0, "learning rate"), default=0.7,
                   help="diloco and onebit_local: the outer Nesterov SGD's learning rate (default: 0.7, DiLoCo's)")
    p.add_argument("--outer-momentum", type=_momentum, default=0.9,
                   help="diloco and onebit_local: the outer SGD's momentum, Nesterov when > 0; 0 with --outer-lr 1 "
                        "is plain averaging of the replicas (local SGD) (default: 0.9, DiLoCo's)")
    p.add_argument("--steps", type=_positive, default=100, help="ddp's step budget, which sets the target "
                                                               "(default: 100)")
    p.add_argument("--target-loss", type=_float_over(0, "loss"), default=None,
                   help="race to this validation loss instead (e.g. from an earlier run's target_loss); ddp then "
                        "races like the others (default: ddp's loss after --steps)")
    p.add_argument("--eval-every", type=_positive, default=10, help="steps between evaluations (default: 10)")
    p.add_argument("--cap", type=_float_over(0, "factor"), default=2.0,
                   help="stop a method at this many times ddp's time (default: 2)")
    p.add_argument("--time-cap", type=_seconds, default=math.inf,
                   help="also stop a method at this clocked time: seconds or a time like 600s (default: no limit)")
    p.add_argument("--max-steps-factor", type=_positive, default=4,
                   help="stop a method after this many times --steps steps (default: 4)")
    p.add_argument("--lr", type=_float_over(0, "learning rate"), default=1e-3,
                   help="AdamW's (inner) learning rate, after --warmup steps of linear warmup (default: 1e-3)")
    p.add_argument("--warmup", type=_int_at_least(2), default=10,
                   help="lr warmup steps; also the fp32 steps of powersgd and onebit_hook (default: 10)")
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                   help="the lr after the warmup: constant, or a cosine decay to a tenth of --lr at ddp's --steps "
                        "(kept there after it), for a target near convergence (default: constant)")
    p.add_argument("--freeze-step", type=_positive, default=None,
                   help="onebit_adam's freeze_step and zeroone_adam's var_freeze_step (default: --steps / 10)")
    for name, what, dflt in (("d-model", "width", MODEL["d_model"]), ("layers", "blocks", MODEL["layers"]),
                             ("heads", "heads", MODEL["heads"]), ("seq-len", "tokens per sample", MODEL["seq_len"]),
                             ("batch", "samples per rank and step", MODEL["batch"])):
        p.add_argument(f"--{name}", type=_positive, default=dflt, help=f"model: {what} (default: {dflt})")
    p.add_argument("--val-seqs", type=_positive, default=256, help="held-out sequences (default: 256)")
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="sample order (default: 0)")
    p.add_argument("--threads", type=_positive, default=1, help="torch threads per rank (default: 1)")
    p.add_argument("--fault", action="store_true",
                   help="race onebit_local and diloco as torchft replica groups (one process per rank), each with and "
                        "without a fault: the last replica crashes at a third of --steps inner steps (every replica "
                        "trains --steps) and restarts --restart-after later; needs torchft and --target-loss; JSON "
                        "schema lbcomm-bench/race-fault (docs/internet.md)")
    p.add_argument("--restart-after", type=_seconds, default=10.0,
                   help="with --fault: seconds from the crash to the restart (default: 10)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (fields listed below)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="validation loss against clocked time, one panel per bandwidth (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    p.add_argument("--timeout", type=_float_over(0, "number of seconds"), default=4 * 3600.0,
                   help="seconds before the ranks are stopped, per bandwidth (default: 14400)")
    p.set_defaults(command="race")


def check(args, info) -> None:
    """The race's checks; fills in args.runs (label, family, sync_every) and args.skipped."""
    if info is not None:
        raise UsageError(f"race starts its own ranks; run it directly, not under {info.launcher}")
    if args.d_model % args.heads:
        raise UsageError(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    asked = args.methods is not None
    families = list(dict.fromkeys(args.methods or FAMILIES))
    args.skipped = []
    for f in list(families):
        why = unavailable(f)
        if why and asked:
            raise UsageError(why)
        if why:
            families.remove(f)
            args.skipped.append(dict(method=f, why=why))
    if args.fault:
        _check_fault(args, families, asked)
    elif args.target_loss is None:
        if "ddp" not in families:
            raise UsageError("the target is ddp's validation loss after --steps: include ddp in --methods, or give "
                             "--target-loss")
        families.remove("ddp")
        families.insert(0, "ddp")
    if "onebit_local" in families and any(args.local_overlap >= h for h in args.local_h):
        raise UsageError(f"--local-overlap {args.local_overlap} must be below every --local-h {args.local_h}")
    args.runs = []
    for f in families:
        for h in (args.diloco_h if f == "diloco" else args.local_h if f == "onebit_local" else [None]):
            args.runs.append(dict(label=f"{f}_h{h}" if h else f, family=f, sync_every=h))
    if args.plot:
        from .plot import require_matplotlib

        require_matplotlib()
    if any(args.bandwidth):
        from .netns import require
        from .units import parse_delay

        check_cluster(args.world_size, args.bandwidth, args.latency, args.burst, delay=args.delay)
        require(delay=bool(parse_delay(args.delay)))


def _check_fault(args, families: List[str], asked: bool) -> None:
    """--fault: the local-update methods only (DDP's ranks cannot lose one), on enough
    replicas that a quorum survives the crash, against a given target."""
    why = unavailable("diloco")
    if why:
        raise UsageError("--fault runs on torchft's Manager and Lighthouse: " + why)
    other = [f for f in families if f not in LOCAL_FAMILIES]
    if asked and other:
        raise UsageError(f"--fault races the local-update methods (onebit_local, diloco), not {', '.join(other)}")
    families[:] = [f for f in families if f in LOCAL_FAMILIES]
    if args.target_loss is None:
        raise UsageError("--fault needs --target-loss (e.g. ddp's on loopback: lbcomm-bench race --bandwidth none "
                         "--methods ddp --steps 100)")
    if args.world_size < 3:
        raise UsageError("--fault needs --world-size >= 3: two replicas must go on while one is down")
    if args.local_overlap:
        raise UsageError("--fault: the fault-tolerant exchange runs no overlap; leave --local-overlap at 0")
    if args.plot:
        raise UsageError("--fault writes no plot; each row of the JSON keeps its curve")


def _params(args, bandwidth: Optional[str]) -> Dict:
    model = dict(MODEL, d_model=args.d_model, layers=args.layers, heads=args.heads, seq_len=args.seq_len,
                 batch=args.batch)
    return dict(model=model, runs=args.runs, steps=args.steps, eval_every=args.eval_every, lr=args.lr,
                outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, local_overlap=args.local_overlap,
                local_block_size=args.local_block_size, warmup=args.warmup, schedule=args.schedule,
                freeze_step=args.freeze_step or max(2, args.steps // 10),
                time_cap_s=args.time_cap, cap_factor=args.cap, max_steps=args.max_steps_factor * args.steps,
                target_loss=args.target_loss, val_seqs=args.val_seqs, seed=args.seed, threads=args.threads,
                backend="gloo", progress=not args.no_progress, netem=bool(bandwidth), floor_steps=6)


def _last_within(curve: List[Dict], t: float) -> Optional[float]:
    within = [c for c in curve if c["time_s"] <= t + 1e-9]
    return within[-1]["val_loss"] if within else None


def _rows(result: Dict) -> List[Dict]:
    ddp_t = result["ddp_time_s"]
    rows = []
    for r in result["results"]:
        last, hit = r["curve"][-1], r["reached"]
        step_s = last["time_s"] / max(1, last["step"])
        rows.append(dict(method=r["label"], family=r["family"], sync_every=r["sync_every"], reached=hit is not None,
                         time_to_target_s=hit["time_s"] if hit else None, speedup_vs_ddp=None,
                         steps_to_target=hit["step"] if hit else None,
                         bytes_per_rank_to_target=hit["bytes_per_rank"] if hit else None,
                         loss_at_ddp_time=_last_within(r["curve"], ddp_t) if ddp_t is not None else None,
                         final_val_loss=last["val_loss"], final_step=last["step"], final_time_s=last["time_s"],
                         step_s=step_s, comm_share=max(0.0, 1.0 - result["compute_step_s"] / step_s) if step_s else 0.0,
                         curve=r["curve"]))
    base = next((r for r in rows if r["method"] == "ddp" and r["reached"]), None)
    for r in rows:
        if base and r["reached"] and r["time_to_target_s"]:
            r["speedup_vs_ddp"] = base["time_to_target_s"] / r["time_to_target_s"]
    return rows


def race_table(run: Dict) -> str:
    hdr = (f"{'method':>17} {'to target s':>11} {'vs ddp':>7} {'steps':>6} {'MB/rank':>8} {'loss@ddp t':>10} "
           f"{'final loss':>10} {'step ms':>8} {'comm':>5}")
    lines = [hdr, "-" * len(hdr)]
    for r in run["rows"]:
        t = f"{r['time_to_target_s']:.1f}" if r["reached"] else f">{r['final_time_s']:.1f}"
        sp = f"{r['speedup_vs_ddp']:.2f}x" if r["speedup_vs_ddp"] else "-"
        st = str(r["steps_to_target"]) if r["reached"] else f">{r['final_step']}"
        mb = f"{r['bytes_per_rank_to_target'] / 1e6:.1f}" if r["bytes_per_rank_to_target"] is not None else "-"
        la = f"{r['loss_at_ddp_time']:.4f}" if r["loss_at_ddp_time"] is not None else "-"
        lines.append(f"{r['method']:>17} {t:>11} {sp:>7} {st:>6} {mb:>8} {la:>10} {r['final_val_loss']:>10.4f} "
                     f"{r['step_s'] * 1e3:>8.1f} {r['comm_share']:>5.0%}")
    return "\n".join(lines)


def cmd_race(args, info) -> int:
    from . import launch
    from .report import emit

    if args.fault:
        from .faultrace import cmd_fault_race

        return cmd_fault_race(args, _params(args, None)["model"])
    runs, result = [], None
    for bw in args.bandwidth:
        params = _params(args, bw)
        spec = {"task": "race", "params": params}
        print(f"# racing {len(args.runs)} methods on {args.world_size} ranks, {bw or 'loopback'} ...", file=sys.stderr)
        if bw:
            with launch.cluster_for(args.world_size, bw, args.latency, args.burst, delay=args.delay) as cluster:
                result = launch.spawn(spec, args.world_size, "gloo", cluster=cluster, timeout=args.timeout)
                bw = cluster.bandwidth
        else:
            result = launch.spawn(spec, args.world_size, "gloo", timeout=args.timeout)
        runs.append(dict(bandwidth=bw, target_loss=result["target_loss"], ddp_time_s=result["ddp_time_s"],
                         compute_step_s=result["compute_step_s"], rows=_rows(result)))
    m = params["model"]
    config = dict(world_size=args.world_size, backend="gloo", threads_per_rank=args.threads, model=m,
                  steps=args.steps, eval_every=args.eval_every, lr=args.lr, outer_lr=args.outer_lr,
                  outer_momentum=args.outer_momentum, local_overlap=args.local_overlap,
                  local_block_size=args.local_block_size, warmup=args.warmup, schedule=args.schedule,
                  freeze_step=params["freeze_step"],
                  cap=args.cap,
                  time_cap_s=None if math.isinf(args.time_cap) else args.time_cap, target_loss=args.target_loss,
                  latency=args.latency, burst=args.burst, delay=args.delay,
                  val_seqs=args.val_seqs, seed=args.seed, train_tokens=result["train_tokens"],
                  clock="training steps only, slowest rank; paused for evaluations")
    doc = document("race", config=config, params=result["params"], skipped=args.skipped, runs=runs)
    print(f"# lbcomm-bench race: {args.world_size} ranks, gloo, {args.threads} thread(s) per rank; TinyLM bytes: "
          f"d_model {m['d_model']}, {m['layers']} layers, {m['heads']} heads, {m['batch']} x {m['seq_len']} tokens "
          f"per rank and step, {result['params'] / 1e6:.2f}M parameters; training text: the standard library's .py "
          f"files, every 10th file held out ({args.val_seqs} held-out sequences)")
    print("# clock: training steps only (warmups, syncs and compression included), slowest rank; paused while the "
          f"validation loss is measured, every {args.eval_every} steps (diloco/onebit_local: at the next sync)")
    for s in args.skipped:
        print(f"# skipped {s['method']}: {s['why']}")
    for run in runs:
        print(f"\n# {run['bandwidth'] or 'loopback'}: target validation loss {run['target_loss']:.4f}"
              + (f" (ddp after {args.steps} steps, {run['ddp_time_s']:.1f} s)" if run["ddp_time_s"] else "")
              + f"; compute floor {run['compute_step_s'] * 1e3:.0f} ms per step (AdamW, no communication)")
        print(race_table(run))
    emit(doc, args.json, args.plot, "plot_race", runs,
         title=f"race to DDP's validation loss, {args.world_size} ranks, {result['params'] / 1e6:.1f}M-parameter LM")
    return 0


def check_race_doc(doc: Dict) -> None:
    """Raise ValueError naming the first field of `doc` that breaks the race JSON schema."""
    check_head(doc, "race", {"config", "params", "skipped", "runs"})
    for i, run in enumerate(doc["runs"]):
        keys = {"bandwidth", "target_loss", "ddp_time_s", "compute_step_s", "rows"}
        if set(run) != keys:
            raise ValueError(f"runs[{i}]: keys {sorted(run)}, expected {sorted(keys)}")
        for j, row in enumerate(run["rows"]):
            _check_fields(row, RACE_ROW_FIELDS, f"runs[{i}].rows[{j}]")
            if row["family"] not in FAMILIES or (row["family"] in LOCAL_FAMILIES) != (row["sync_every"] is not None):
                raise ValueError(f"runs[{i}].rows[{j}]: family {row['family']!r} with sync_every {row['sync_every']!r}")
            for k, c in enumerate(row["curve"]):
                if set(c) != {"step", "time_s", "val_loss", "bytes_per_rank"}:
                    raise ValueError(f"runs[{i}].rows[{j}].curve[{k}]: keys {sorted(c)}")
