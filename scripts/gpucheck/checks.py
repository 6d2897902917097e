"""The checks (each run in a child process: `gpu_check.py --run-check NAME`) and how the
parent runs one: in process (the child's side) or in a subprocess with a hard timeout."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .allreduce import verify_allreduce
from .base import CHECKS, KERNEL_TARGET, SELF, child_env, make_record, run_command, tail
from .pipelining import summarize_pipelining
from .ranks import find_mpirun, launch_ranks
from .train import _batch, _make_model, _teacher, verify_train


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
    rc, fig, out = _pytest(["tests/test_cuda.py", "tests/test_cuda_layouts.py"], params["timeout"])
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
    # -k matches module, test and parameter names: every case outside pytest_cuda's files that names CUDA.
    rc, fig, out = _pytest(["tests", "--ignore=tests/test_cuda.py", "--ignore=tests/test_cuda_layouts.py",
                            "--ignore=tests/test_gpu_check.py", "-k", "cuda",
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
