"""Constants, the plan of checks and their timeouts, records (JSON, table), subprocesses run
in their own process group, and the build. Imports nothing of lbcomm and no other module of
the package."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SELF = os.path.join(ROOT, "scripts", "gpu_check.py")  # the entry point the child processes run
FORMAT = "lbcomm-gpu-check/1"
KERNEL_TARGET = 0.8  # kernel time vs a copy of its minimum traffic, as for the CPU kernels
DEFAULT_BUDGET = 470  # seconds for the whole run, build included (a device command may last 600)
RANKS = 4
NO_GPU_EXIT = 2

# ---------------------------------------------------------------------------- plan


def _M(k: int) -> int:
    return k << 20


# (n0, block_size, pieces, dtype): odd sizes (padding), tiny, single-scale, pipelined, half types.
ALLREDUCE_CASES = [
    (1, 2048, None, "float32"),
    (1000, 64, None, "float32"),
    (70001, 2048, None, "float32"),
    (5003, None, None, "float32"),
    (300001, 2048, 3, "float32"),
    (4099, 256, None, "bfloat16"),
    (_M(1) + 5, 2048, None, "float16"),
]
TRAIN_VARIANTS = ["ddp_onebit_hook_adamw", "ddp_onebit_adam", "onebit_adam"]


def check_params(quick: bool) -> Dict[str, Dict[str, Any]]:
    """Parameters of every check, full or --quick."""
    return {
        "build": {},
        "environment": {},
        "pytest_cuda": {},
        "kernels": {"sizes": "16M,64M" if quick else "16M,64M,256M", "world_sizes": "4,8", "reps": 5,
                    "target": KERNEL_TARGET},
        "allreduce_nccl_1rank": {"numel": 100003},
        "allreduce_mpi_4ranks": {"transport": "mpi", "ranks": RANKS, "steps": 3 if quick else 4,
                                 "cases": ALLREDUCE_CASES[:-1] if quick else ALLREDUCE_CASES},
        "allreduce_gloo_4ranks": {"transport": "gloo", "ranks": RANKS, "steps": 3,
                                  "cases": ALLREDUCE_CASES[:-1]},
        "train_4ranks": {"transport": "gloo", "ranks": RANKS, "steps": 20 if quick else 30,
                         "variants": TRAIN_VARIANTS},
        "pipelining_4ranks": {"transport": "mpi", "ranks": RANKS, "sizes": [_M(32)] if quick else [_M(32), _M(128)],
                              "settings": ["1", "auto"], "iters": 6 if quick else 10},
        "pytest_cuda_rest": {},
    }


# name -> (timeout in s, what it proves); in the order they run.
CHECKS: Dict[str, Tuple[int, str]] = {
    "build": (300, "lbcomm._C built in place with nvcc for this GPU (LBCOMM_CUDA=1)"),
    "environment": (60, "the extension loads with its CUDA kernels; versions of torch, CUDA, NCCL, MPI"),
    "pytest_cuda": (180, "tests/test_cuda.py, test_cuda_layouts.py: CUDA kernels against the reference and the "
                         "CPU kernels"),
    "kernels": (150, "worker/server/unpack kernels as a ratio to a torch op of the same reads and writes, and to a "
                     "device-to-device copy of their traffic"),
    "allreduce_nccl_1rank": (90, "NCCL transport and compressed_allreduce on CUDA tensors, one-rank group"),
    "allreduce_mpi_4ranks": (150, "4 MPI ranks on one GPU (host staging): reference match, identical ranks"),
    "allreduce_gloo_4ranks": (150, "4 ranks on one GPU through gloo CUDA staging: reference match, identical ranks"),
    "train_4ranks": (180, "DDP + onebit_hook, DDP + OneBitAdam, OneBitAdam alone on CUDA: loss falls, replicas "
                          "identical, no host sync inside hook calls"),
    "pytest_cuda_rest": (120, "the rest of the suite's CUDA-eligible cases (pytest -k cuda)"),
    "pipelining_4ranks": (150, "pieces 1 vs automatic on CUDA tensors, 4 MPI ranks on one GPU (measurement)"),
}


# ---------------------------------------------------------------------------- records, JSON, table


def make_record(name: str, ok: bool, figures: Optional[Dict[str, Any]] = None, seconds: float = 0.0,
                error: Optional[str] = None) -> Dict[str, Any]:
    return {"name": name, "ok": bool(ok), "figures": figures or {}, "seconds": round(float(seconds), 2),
            "error": error}


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def write_json(path: str, records: Sequence[Dict[str, Any]], meta: Dict[str, Any]) -> None:
    """The whole run as one JSON document (written atomically: a reader never sees half)."""
    doc = {"format": FORMAT, **_jsonable(meta), "ok": bool(records) and all(r["ok"] for r in records),
           "checks": _jsonable(list(records))}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def format_table(records: Sequence[Dict[str, Any]]) -> str:
    """One line per check: name, PASS/FAIL, seconds, its summary (or the first line of its error)."""
    rows = []
    for r in records:
        summary = str(r["figures"].get("summary", "")) if r.get("figures") else ""
        if r.get("error"):
            first = str(r["error"]).strip().splitlines()[0] if str(r["error"]).strip() else "error"
            summary = f"{summary}; {first}" if summary else first
        rows.append((r["name"], "PASS" if r["ok"] else "FAIL", f"{r['seconds']:.1f}", summary))
    w = max([len("check")] + [len(r[0]) for r in rows])
    lines = [f"{'check':<{w}}  {'':4}  {'s':>6}  summary", "-" * (w + 40)]
    lines += [f"{n:<{w}}  {s:4}  {t:>6}  {m}" for n, s, t, m in rows]
    failed = sum(not r["ok"] for r in records)
    lines.append(f"{len(records) - failed} of {len(records)} checks passed")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- subprocesses


_GROUPS: set = set()  # process groups this process started and has not yet reaped


def _stop_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM a process group we started (mpirun forwards it to its ranks, a check process
    stops the groups it started), then SIGKILL whatever is left after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _stop_all_groups(signum=None, frame=None) -> None:
    """SIGTERM handler of a check process: stop every group it started, then leave."""
    for pgid in list(_GROUPS):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(124)


def run_command(argv: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
                cwd: str = ROOT) -> Tuple[Optional[int], str, float]:
    """(exit status or None on timeout, stdout+stderr, seconds). The command runs in its own
    process group; on timeout that group is stopped (SIGTERM, then SIGKILL)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    _GROUPS.add(proc.pid)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        return proc.returncode, out, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        _stop_group(proc.pid)
        out, _ = proc.communicate()
        return None, out or "", time.monotonic() - t0
    finally:
        _GROUPS.discard(proc.pid)


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment of every child: this checkout's lbcomm first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks of one machine talk over loopback
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "4")
    env.update(extra or {})
    return env


# Lines that name the cause of a crash; a C++ abort prints them before a long backtrace.
_CAUSE_MARKS = ("what():", "terminate called", "Error:", "error:")


def tail(text: str, lines: int = 25) -> str:
    """The last `lines` lines of text, after the first few earlier lines that name a cause."""
    all_lines = text.rstrip().splitlines()
    causes = [ln for ln in all_lines[:-lines] if any(m in ln for m in _CAUSE_MARKS)][:6]
    return "\n".join(causes + (["..."] if causes else []) + all_lines[-lines:])


# ---------------------------------------------------------------------------- environment, build


def gpu_problem() -> Optional[str]:
    """Why this machine cannot run the checks, or None."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - reported as the reason
        return f"torch cannot be imported with {sys.executable} ({exc}); gpu-check needs a CUDA build of torch"
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} at {sys.executable} is a CPU build (torch.version.cuda is None); run "
                "gpu-check on the GPU machine with its CUDA torch (or set PYTHON= to that interpreter)")
    if not torch.cuda.is_available():
        return (f"no CUDA device is visible to torch {torch.__version__} (CUDA {torch.version.cuda}): "
                "torch.cuda.is_available() is False; check nvidia-smi and CUDA_VISIBLE_DEVICES")
    return None


def default_arch() -> str:
    """TORCH_CUDA_ARCH_LIST for the GPU in this machine (9.0 on H100/H200)."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}"


def build_command(python: str, arch: str, jobs: int) -> Tuple[List[str], Dict[str, str]]:
    """(argv, environment additions) of the in-place build with the CUDA kernels."""
    argv = [python, "setup.py", "build_ext", "--inplace"]
    env = {"LBCOMM_CUDA": "1", "TORCH_CUDA_ARCH_LIST": arch, "MAX_JOBS": str(jobs)}
    return argv, env


def run_build(argv: Sequence[str], env_extra: Dict[str, str], timeout: float) -> Dict[str, Any]:
    """The build step as a record."""
    rc, out, secs = run_command(argv, timeout, child_env(env_extra))
    figures = {"command": " ".join(f"{k}={v}" for k, v in env_extra.items()) + " " + " ".join(argv),
               "summary": f"{env_extra.get('TORCH_CUDA_ARCH_LIST', '')} in {secs:.0f} s"}
    if rc is None:
        return make_record("build", False, figures, secs, f"the build did not finish in {timeout:.0f} s:\n{tail(out)}")
    if rc != 0:
        return make_record("build", False, figures, secs, f"the build exited with status {rc}:\n{tail(out)}")
    return make_record("build", True, figures, secs)
