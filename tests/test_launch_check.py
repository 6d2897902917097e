"""A job that a launcher started with several ranks, but whose script never called
torch.distributed.init_process_group, is an error: every rank would otherwise train alone
with lbcomm's optimizers and hooks, nothing averaged and nothing said."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import lbcomm
import lbcomm.comm.mpi as lbmpi
from lbcomm.comm import get_transport, world_info
from lbcomm.errors import NotInitializedError

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")

# a user's training script that forgot init_process_group
SCRIPT = textwrap.dedent("""
    import torch
    import lbcomm

    model = torch.nn.Linear(8, 4)
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2)
    for step in range(4):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    print("trained", opt.bytes_per_step())
""")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(("OMPI_", "PMIX_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return dict(env, **extra)


def _python(script, **extra):
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=_env(**extra), cwd=ROOT)


@pytest.fixture
def no_launcher(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not torch.distributed.is_initialized()
    return monkeypatch


def test_world_size_2_without_init_process_group_fails_with_the_fix():
    proc = _python(SCRIPT, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert proc.returncode != 0 and "trained" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lbcomm.errors.NotInitializedError: lbcomm: WORLD_SIZE=2 (set by torchrun) says this "
                           "job has 2 ranks, but torch.distributed is not initialized"), proc.stderr
    assert "torch.distributed.init_process_group" in last and "unset WORLD_SIZE" in last


@pytest.mark.parametrize("extra", [{"WORLD_SIZE": "1", "RANK": "0"}, {}], ids=["world_size_1", "no_launcher"])
def test_one_process_still_trains(extra):
    proc = _python(SCRIPT, **extra)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "trained None"  # one rank: nothing to send


def _local_updates():
    w = torch.zeros(3, requires_grad=True)
    return lbcomm.OneBitLocalUpdates([w], torch.optim.SGD([w], lr=0.1), sync_every=4)


def test_every_communicating_object_is_refused(no_launcher):
    no_launcher.setenv("WORLD_SIZE", "2")
    for make in (world_info, get_transport, lambda: lbcomm.CompressionState(100),
                 lambda: lbcomm.make_reducer(100),
                 lambda: lbcomm.OneBitHookState(2).state_dict(),
                 _local_updates):
        with pytest.raises(NotInitializedError, match=r"init_process_group\(\"gloo\"\)"):
            make()
    assert issubclass(NotInitializedError, RuntimeError)
    no_launcher.setenv("WORLD_SIZE", "1")
    assert world_info() == (1, 0) and lbcomm.CompressionState(100).world_size == 1


def test_mpirun_without_mpi4py_or_with_backend_torch(no_launcher):
    no_launcher.setenv("OMPI_COMM_WORLD_SIZE", "2")
    no_launcher.setattr(lbmpi, "mpi_available", lambda: False)
    with pytest.raises(NotInitializedError, match=r"the MPI launcher \(OMPI_COMM_WORLD_SIZE=2\).*pip install mpi4py"):
        get_transport()
    no_launcher.setattr(lbmpi, "mpi_available", lambda: True)
    with pytest.raises(NotInitializedError, match="pass backend='mpi'"):
        get_transport(backend="torch")  # mpi4py there, but torch asked for without init_process_group
    no_launcher.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert get_transport(backend="torch").world_size == 1


def test_torchrun_script_without_init_process_group_fails_on_every_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    logs = tmp_path / "logs"
    # each rank's stderr in its own file: two ranks writing one pipe can interleave their tracebacks
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(logs), "--redirects", "3", str(script)],
                          capture_output=True, text=True, timeout=240, env=_env(), cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "trained" not in out
    errs = [p.read_text() for p in sorted(logs.rglob("stderr.log"))]
    assert len(errs) == 2 and not any("trained" in p.read_text() for p in logs.rglob("stdout.log")), errs
    # the launcher may stop the second rank once the first has failed, so at least one says why
    said = [e for e in errs if "NotInitializedError: lbcomm: WORLD_SIZE=2 (set by torchrun) says this job has 2 "
            "ranks" in e and "torch.distributed.init_process_group" in e]
    assert said, errs
