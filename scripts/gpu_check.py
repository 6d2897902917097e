"""GPU readiness: one command that builds lbcomm with nvcc and runs every CUDA path.

Entry point: ``scripts/gpu-check`` (see README, "On a GPU"). The parent process never
imports lbcomm: it checks for a GPU, builds the extension in place, then runs each check in
its own subprocess with its own timeout, so that a crash, a hang or a CUDA error in one
check never stops the others. Checks that need several ranks start them themselves:
``mpirun -np 4`` for the MPI transport (CUDA tensors staged through host memory), or 4
local processes joined by a torch.distributed group whose CUDA tensors go through gloo
(``cpu:gloo,cuda:gloo``), all sharing the one GPU.

Every check gives one record ``{name, ok, figures, seconds, error}``; the records are
written to one JSON file (after every check, so a killed run keeps what it had) and
printed as a table. Exit status: 0 when every check passed, 1 when any failed, 2 when
nothing could run (no GPU, bad arguments).

The rank jobs and the verification functions also run with CPU tensors (``device="cpu"``),
which tests/test_gpu_check.py uses on machines without a GPU; the command line always
runs on CUDA.

This file is the entry point and the names the tests use; the code is in the package
``scripts/gpucheck/``: base.py (constants, plan, records, subprocesses, build), checks.py
(the checks, in process or in a subprocess), ranks.py (multi-rank jobs), allreduce.py,
train.py and pipelining.py (the rank jobs and their verification), cli.py (the command
line and the child entries).
"""
from __future__ import annotations

import sys

from gpucheck.allreduce import case_input, job_allreduce, verify_allreduce
from gpucheck.base import (ALLREDUCE_CASES, CHECKS, DEFAULT_BUDGET, FORMAT, KERNEL_TARGET, NO_GPU_EXIT, RANKS, ROOT,
                           SELF, TRAIN_VARIANTS, build_command, check_params, child_env, default_arch, format_table,
                           gpu_problem, make_record, run_build, run_command, tail, write_json)
from gpucheck.checks import (CHECK_FUNCS, check_allreduce, check_allreduce_nccl_1rank, check_environment, check_kernels,
                             check_pipelining, check_pytest_cuda, check_pytest_cuda_rest, check_train,
                             evaluate_kernel_rows, parse_junit, run_check_inprocess, run_check_subprocess)
from gpucheck.cli import RANK_JOBS, main, parse_args, plan, rank_main, run_all
from gpucheck.pipelining import job_pipelining, summarize_pipelining
from gpucheck.ranks import RankContext, find_mpirun, launch_ranks, mpirun_command
from gpucheck.train import SyncCounter, job_train, verify_train

__all__ = [
    "ALLREDUCE_CASES", "CHECKS", "CHECK_FUNCS", "DEFAULT_BUDGET", "FORMAT", "KERNEL_TARGET", "NO_GPU_EXIT", "RANKS",
    "RANK_JOBS", "ROOT", "SELF", "TRAIN_VARIANTS", "RankContext", "SyncCounter", "build_command", "case_input",
    "check_allreduce", "check_allreduce_nccl_1rank", "check_environment", "check_kernels", "check_params",
    "check_pipelining", "check_pytest_cuda", "check_pytest_cuda_rest", "check_train", "child_env", "default_arch",
    "evaluate_kernel_rows", "find_mpirun", "format_table", "gpu_problem", "job_allreduce", "job_pipelining",
    "job_train", "launch_ranks", "main", "make_record", "mpirun_command", "parse_args", "parse_junit", "plan",
    "rank_main", "run_all", "run_build", "run_check_inprocess", "run_check_subprocess", "run_command",
    "summarize_pipelining", "tail", "verify_allreduce", "verify_train", "write_json",
]

if __name__ == "__main__":
    sys.exit(main())
