"""Compressed allreduces that tests/test_mpi.py runs on both backends and compares bitwise.

`compute(rank, p, backend)` reduces the same deterministic inputs (sync, async and in place
through out=) on ``backend``; tests/test_mpi.py calls it in spawned gloo ranks for
"torch", and runs this file under mpirun for "mpi":

    mpirun --allow-run-as-root --oversubscribe -np 3 python tests/mpi_worker.py OUT_DIR

Each MPI rank writes OUT_DIR/<rank>.pt with its results and the outcome of MPI-only checks
(backend selection, concurrent calls, error reporting).
"""
from __future__ import annotations

import os
import sys
import threading
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lbcomm  # noqa: E402

CASES = [(1, 2048, None), (1000, 64, None), (4099, 2048, None), (5003, None, None), (4099, 64, 3)]  # n0, block, pieces
STEPS = 6


def inputs(rank: int, t: int, n0: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * t + 104729 * rank + n0)
    return torch.randn(n0, generator=g) * (1 + rank)


def compute(rank: int, p: int, backend: str, concurrent: bool = False):
    """{(n0, block, pieces): (outputs per step, worker error, server error)} on `backend`.

    With `concurrent`, the two largest cases are reduced with both calls in flight at once
    (each state has its own communicator on MPI); the results must not change."""
    torch.set_num_threads(1)
    results = {}
    states = {case: lbcomm.CompressionState(case[0], block_size=case[1], backend=backend, pieces=case[2])
              for case in CASES}
    outs = {case: [] for case in CASES}
    for t in range(STEPS):
        pending = []
        for case in CASES:
            n0 = case[0]
            st, x = states[case], inputs(rank, t, n0)
            mode = (t + n0) % 3
            if concurrent and n0 > 4000:
                pending.append((case, lbcomm.compressed_allreduce(x, st, out=torch.empty_like(x), async_op=True)))
                continue
            if mode == 0:  # the primary entry point, in place
                out = x.clone()
                assert lbcomm.compressed_allreduce_(out, st) is out
            elif mode == 1:
                out = lbcomm.compressed_allreduce(x, st, out=torch.empty_like(x), async_op=True).wait()
            else:
                out = x.clone()
                lbcomm.compressed_allreduce(out, st, async_op=True, out=out).wait()
            outs[case].append(out.clone())
        for case, fut in pending:
            outs[case].append(fut.wait().clone())
    for case in CASES:
        st = states[case]
        results[case] = (outs[case], st.worker_error.clone(), st.server_error.clone())
    return results


def transport_ops(rank: int, p: int, backend: str):
    """The transport's all_reduce (every op, bucketed, async, half precision) and barrier on
    integer-valued inputs, so that every backend's sums are exact and comparable bitwise."""
    from lbcomm.comm import get_transport

    tr = get_transport(None, backend=backend)
    out = {}
    base = torch.arange(1000, dtype=torch.float32) % 17 + rank
    for op in ("sum", "mean", "max", "min"):
        t = base.clone()
        tr.all_reduce(t, op)
        out[op] = t
    t = base.clone()
    assert tr.all_reduce(t, "sum", bucket_bytes=1000) is None  # 4 buckets of 250 elements
    out["bucketed"] = t
    t = base.clone()
    fut = tr.all_reduce(t, "mean", async_op=True, bucket_bytes=400)
    out["async_mean_same_tensor"] = fut.wait() is t
    out["async_mean"] = t
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int64):
        t = base.to(dtype)
        tr.all_reduce(t, "sum")
        out[f"sum_{dtype}"] = t
    tr.barrier()
    try:
        tr.all_reduce(base[::2], "sum")
        out["noncontiguous"] = "no error"
    except ValueError as exc:
        out["noncontiguous"] = str(exc)
    try:
        tr.all_reduce(base.clone(), "prod")
        out["bad_op"] = "no error"
    except ValueError as exc:
        out["bad_op"] = str(exc)
    return out


def mpi_checks(rank: int, p: int):
    """MPI-only behaviour: backend selection, non-finite input, MPI errors surfaced."""
    from mpi4py import MPI

    from lbcomm.comm import get_transport
    from lbcomm.comm.mpi import MPITransport, cuda_aware_mpi

    out = {}
    auto = lbcomm.CompressionState(10)
    out["auto_transport"] = type(auto.transport).__name__
    out["world"] = (auto.world_size, auto.rank)
    out["cuda_aware"] = cuda_aware_mpi()
    try:
        get_transport(None, backend="nope")
        out["bad_backend"] = "no error"
    except ValueError as exc:
        out["bad_backend"] = str(exc)

    # Non-finite input on one rank: every rank raises, errors untouched.
    st = lbcomm.CompressionState(300, block_size=64, backend="mpi")
    lbcomm.compressed_allreduce_(torch.randn(300), st)
    before = st.worker_error.clone(), st.server_error.clone()
    x = torch.randn(300)
    if rank == 1:
        x[7] = float("nan")
    try:
        lbcomm.compressed_allreduce_(x, st, async_op=True).wait()
        out["nonfinite"] = "no error"
    except lbcomm.NonFiniteError:
        out["nonfinite"] = "raised"
    out["nonfinite_errors_kept"] = torch.equal(before[0], st.worker_error) and torch.equal(before[1], st.server_error)

    # An MPI error (here: a freed communicator) fails the future with MPI's message, and the
    # transport refuses further calls instead of hanging.
    tr = MPITransport()
    tr.comm.Free()
    buf = torch.zeros(p, 4, dtype=torch.uint8)
    try:
        tr.all_to_all(torch.empty_like(buf), buf, async_op=True).wait()
        out["mpi_error"] = "no error"
    except RuntimeError as exc:
        out["mpi_error"] = str(exc)
    try:
        tr.all_gather(torch.empty(4 * p, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))
        out["after_error"] = "no error"
    except RuntimeError as exc:
        out["after_error"] = str(exc)

    # A blocking collective from a callback on the progress thread would wait for itself: it
    # is refused. Rank-local (COMM_SELF), and the callback is registered while the progress
    # thread cannot start the op yet, so that the callback surely runs on that thread.
    from lbcomm.comm.mpi_progress import ENGINE as _ENGINE

    good = MPITransport()
    alone = MPITransport(MPI.COMM_SELF)
    seen, ran = [], threading.Event()

    def cb(fut):
        try:
            alone.all_gather(torch.empty(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8))
            seen.append("no error")
        except RuntimeError as exc:
            seen.append(str(exc))
        ran.set()

    with _ENGINE._cond:
        fut = alone.all_gather(torch.empty(1, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8), async_op=True)
        fut.add_done_callback(cb)
    fut.wait()
    ran.wait(60)  # callbacks run just after the future's waiters are released
    out["blocking_in_callback"] = seen[0] if seen else "callback not run"
    gathered = good.all_gather(torch.empty(p, dtype=torch.uint8), torch.full((1,), rank, dtype=torch.uint8),
                               async_op=True)
    out["gathered"] = gathered.wait()[0].tolist()
    MPI.COMM_WORLD.Barrier()
    return out


def main(out_dir: str) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    try:
        payload = {"ok": {"results": compute(rank, p, "mpi", concurrent=True), "checks": mpi_checks(rank, p),
                          "transport": transport_ops(rank, p, "mpi")}}
        code = 0
    except BaseException:  # noqa: BLE001 - reported to the test through the file
        payload = {"error": traceback.format_exc()}
        code = 1
    torch.save(payload, os.path.join(out_dir, f"{rank}.pt"))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
