"""The command line (`scripts/gpu-check`), the run of the plan within the budget, and the
entries of the child processes: one check (--run-check), one rank (--rank-job)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

from .allreduce import job_allreduce
from .base import (CHECKS, DEFAULT_BUDGET, NO_GPU_EXIT, _jsonable, _stop_all_groups, build_command, check_params,
                   default_arch, format_table, gpu_problem, make_record, run_build, write_json)
from .checks import CHECK_FUNCS, run_check_inprocess, run_check_subprocess
from .pipelining import job_pipelining
from .ranks import RankContext
from .train import job_train


def rank_main(job: str, workdir: str, rank: Optional[int], world: Optional[int]) -> int:
    """Entry of one rank: set up the transport, run the job, save {"ok": result} or {"error": tb}."""
    import datetime as _dt

    import torch

    with open(os.path.join(workdir, "params.json")) as f:
        params = json.load(f)
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 4) // params["ranks"])))
    use_cuda = params.get("device", "cuda") == "cuda"
    dist = None
    if params["transport"] == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()
        barrier = comm.Barrier
    else:
        import torch.distributed as dist

        # torch's gloo stages CUDA tensors through pinned host memory for all_to_all_single,
        # all_gather_into_tensor, all_reduce and broadcast: the way several ranks share one GPU.
        backend = "cpu:gloo,cuda:gloo" if use_cuda else "gloo"
        dist.init_process_group(backend, init_method=f"file://{os.path.join(workdir, 'init')}", rank=rank,
                                world_size=world, timeout=_dt.timedelta(seconds=90))
        barrier = dist.barrier
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    ctx = RankContext(rank, world, device, params["transport"], barrier)
    ok = False
    try:
        payload = {"ok": RANK_JOBS[job](ctx, params)}
        ok = True
    except BaseException:  # noqa: BLE001 - reported through the result file
        payload = {"error": traceback.format_exc()}
    torch.save(payload, os.path.join(workdir, f"rank{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    if dist is not None:
        # Skip interpreter finalization, as tests/dist_util.py does: gloo sometimes aborts there.
        os._exit(0 if ok else 1)
    return 0 if ok else 1


RANK_JOBS: Dict[str, Callable] = {"allreduce": job_allreduce, "train": job_train, "pipelining": job_pipelining}



# ---------------------------------------------------------------------------- command line


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description="Build lbcomm with nvcc and run every CUDA path on this GPU machine, with a table and a JSON file.",
        epilog="Checks, in order: " + ", ".join(CHECKS) + ". Exit status: 0 all passed, 1 a check failed, "
               "2 nothing could run (no GPU, bad arguments).")
    ap.add_argument("--json", default="gpu-check.json", help="write the records here (default: %(default)s)")
    ap.add_argument("--skip-build", action="store_true", help="use the extension already built in place")
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer steps (about half the time)")
    ap.add_argument("--only", help="comma list of checks to run (the build still runs unless --skip-build)")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                    help="seconds for the whole run; each check's timeout is cut to what is left (default: %(default)s)")
    ap.add_argument("--build-timeout", type=float, default=CHECKS["build"][0],
                    help="seconds for the build, within the budget (default: %(default)s)")
    ap.add_argument("--arch", help="TORCH_CUDA_ARCH_LIST for the build (default: this GPU's capability, e.g. 9.0)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="MAX_JOBS for the build (default: %(default)s)")
    ap.add_argument("--list", action="store_true", help="print the checks, their timeouts and the build command; run nothing")
    # internal: one check in a child process, one rank of a multi-rank job
    ap.add_argument("--run-check", help=argparse.SUPPRESS)
    ap.add_argument("--rank-job", choices=sorted(RANK_JOBS), help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in CHECKS or n == "build"]
        if unknown or not names:
            ap.error(f"--only: unknown check(s) {unknown or args.only!r}; choose from {', '.join(list(CHECKS)[1:])}")
        args.only = names
    if args.build_timeout <= 0:
        ap.error(f"--build-timeout must be positive, got {args.build_timeout}")
    if args.budget <= 0:
        ap.error(f"--budget must be positive, got {args.budget}")
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.run_check is not None and args.run_check not in CHECK_FUNCS:
        ap.error(f"--run-check: unknown check {args.run_check!r}")
    return args


def plan(args: argparse.Namespace) -> List[str]:
    """Check names to run, in order."""
    names = [n for n in CHECKS if n != "build"]
    if args.only:
        names = [n for n in names if n in args.only]
    return ([] if args.skip_build else ["build"]) + names


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.run_check:  # child: one check, record to the workdir
        signal.signal(signal.SIGTERM, _stop_all_groups)  # the parent's timeout reaches our ranks too
        with open(os.path.join(args.workdir, "params.json")) as f:
            params = json.load(f)
        rec = run_check_inprocess(args.run_check, params)
        with open(os.path.join(args.workdir, "record.json"), "w") as f:
            json.dump(_jsonable(rec), f)
        return 0
    if args.rank_job:
        return rank_main(args.rank_job, args.workdir, args.rank, args.world)

    params_all = check_params(args.quick)
    names = plan(args)
    if args.list:
        argv_b, env_b = build_command(sys.executable, args.arch or "<this GPU>", args.jobs)
        print("build: " + ("skipped (--skip-build)" if args.skip_build else
                           " ".join(f"{k}={v}" for k, v in env_b.items()) + " " + " ".join(argv_b)))
        for n in names:
            if n != "build":
                print(f"{n:<24}{CHECKS[n][0]:>5} s  {CHECKS[n][1]}")
        print(f"budget {args.budget:.0f} s; JSON to {args.json}")
        return 0

    problem = gpu_problem()
    if problem is not None:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return NO_GPU_EXIT

    import torch

    meta = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "host": os.uname().nodename,
            "python": sys.executable, "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0), "quick": args.quick, "budget_s": args.budget,
            "argv": list(argv) if argv is not None else sys.argv[1:]}
    arch = args.arch or default_arch()
    print(f"gpu-check: {meta['device']}, torch {meta['torch']} (CUDA {meta['cuda']}); {len(names)} checks, "
          f"budget {args.budget:.0f} s", flush=True)

    def build(timeout: float) -> Dict[str, Any]:
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None:
            return make_record("build", False, None, 0.0, "nvcc not found: torch found no CUDA_HOME; put nvcc on PATH "
                                                          "or set CUDA_HOME")
        argv_b, env_b = build_command(sys.executable, arch, args.jobs)
        rec = run_build(argv_b, env_b, timeout)
        rec["figures"]["cuda_home"] = CUDA_HOME
        return rec

    records = run_all(names, args, params_all, meta, build, run_check_subprocess)
    print()
    print(format_table(records))
    print(f"\nJSON: {os.path.abspath(args.json)}")
    return 0 if all(r["ok"] for r in records) else 1


def run_all(names: Sequence[str], args: argparse.Namespace, params_all: Dict[str, Dict[str, Any]],
            meta: Dict[str, Any], build: Callable[[float], Dict[str, Any]],
            run_check: Callable[[str, Dict[str, Any], float], Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Run the plan in order within the budget; print each result and rewrite the JSON after each."""
    deadline = time.monotonic() + args.budget
    records: List[Dict[str, Any]] = []
    build_ok = True
    for name in names:
        left = deadline - time.monotonic()
        timeout = min(args.build_timeout if name == "build" else CHECKS[name][0], left)
        if name != "build" and not build_ok:
            rec = make_record(name, False, None, 0.0, "not run: the build failed")
        elif timeout < 10:
            rec = make_record(name, False, None, 0.0, f"not run: the time budget ({args.budget:.0f} s, --budget) "
                                                      "was used up")
        elif name == "build":
            rec = build(timeout)
            build_ok = rec["ok"]
        else:
            rec = run_check(name, params_all[name], timeout)
        records.append(rec)
        status = "PASS" if rec["ok"] else "FAIL"
        print(f"[{status}] {name} ({rec['seconds']:.1f} s) {rec['figures'].get('summary', '') if rec['figures'] else ''}",
              flush=True)
        if rec["error"]:
            print("       " + "\n       ".join(str(rec["error"]).strip().splitlines()[:12]), flush=True)
        write_json(args.json, records, meta)
    return records
