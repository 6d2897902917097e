"""Faults: mismatched ranks, out-of-step calls, dead peers, hostile values, long runs."""
import datetime
import math
import multiprocessing
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
hypothesis = pytest.importorskip("hypothesis")  # the GPU machine may not have it (scripts/gpu-check)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import lbcomm
from lbcomm import ops
from lbcomm.testing import kernels as R
from dist_util import run_ranks
from lbcomm.cli.soak import check, soak_rank


def _mismatch(rank, p, sizes):
    n = sizes[rank]
    state = lbcomm.CompressionState(n)
    try:
        lbcomm.compressed_allreduce_(torch.randn(n), state)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("sizes", [[1000, 1000, 2000], [1000, 1001, 1000]])
def test_different_sizes_raise_clearly_on_every_rank(sizes):
    """[1000, 1001, 1000] pad to the same wire length: it would otherwise return garbage;
    [.., 2000] has another length, which aborts the process inside gloo if ever sent."""
    for msg in run_ranks(_mismatch, 3, sizes, timeout=60):
        assert "different tensors" in msg and ("numel=2000" in msg or "numel=1001" in msg)


def _out_of_step(rank, p):
    state = lbcomm.CompressionState(500, block_size=64)
    lbcomm.compressed_allreduce_(torch.randn(500), state)
    if rank == 1:
        state.calls += 1  # this rank believes it made one more call than the others
    before = (state.worker_error.clone(), state.server_error.clone())
    try:
        lbcomm.compressed_allreduce_(torch.randn(500), state)
        return "no error", True
    except ValueError as exc:
        return str(exc), torch.equal(before[0], state.worker_error) and torch.equal(before[1], state.server_error)


def test_out_of_step_ranks_raise_with_errors_untouched():
    for msg, untouched in run_ranks(_out_of_step, 3):
        assert "out of step" in msg
        assert untouched


def _dead_peer_rank(rank, p, init_file, result_dir, timeout_s):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=p,
                            timeout=datetime.timedelta(seconds=timeout_s))
    state = lbcomm.CompressionState(4096)
    for _ in range(3):
        lbcomm.compressed_allreduce_(torch.randn(4096), state)
    if rank == p - 1:
        os._exit(17)  # killed mid-run, without any goodbye
    t0 = time.monotonic()
    try:
        for _ in range(100):
            lbcomm.compressed_allreduce_(torch.randn(4096), state)
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001 - any clear exception is the point
        outcome = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(result_dir, f"{rank}.txt"), "w") as f:
        f.write(f"{time.monotonic() - t0}\n{outcome}")


def test_dead_peer_raises_within_timeout_and_leaves_no_orphans():
    p, timeout_s = 3, 5
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_dead_peer_rank, args=(r, p, os.path.join(d, "init"), d, timeout_s))
                 for r in range(p)]
        for proc in procs:
            proc.start()
        try:
            for proc in procs:
                proc.join(timeout=120)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        assert procs[-1].exitcode == 17
        for r in range(p - 1):
            with open(os.path.join(d, f"{r}.txt")) as f:
                elapsed, outcome = f.read().split("\n", 1)
            assert outcome != "no error"
            assert float(elapsed) < timeout_s + 10, (elapsed, outcome)
        assert all(not proc.is_alive() for proc in procs)
        assert not multiprocessing.active_children()


# ------------------------------------------------------------------ property-based kernels
_SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1e-39, -1e-39, 3e38, -3e38, math.inf, -math.inf, math.nan]


@st.composite
def _tensors(draw):
    n0 = draw(st.integers(0, 3000))
    p = draw(st.integers(1, 5))
    block = draw(st.sampled_from([None, 32, 64, 96, 2048]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    n_special = draw(st.integers(0, min(n0, 8)))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n0, generator=g) * draw(st.sampled_from([1e-30, 1.0, 1e30]))
    for _ in range(n_special):
        x[draw(st.integers(0, n0 - 1))] = draw(st.sampled_from(_SPECIAL))
    m = R.chunk_size(n0, p)
    e = torch.randn(p, m, generator=g) * 0.1
    e.view(-1)[n0:] = 0
    return x.to(dtype), e, block


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)


def _same_where_finite(packed, scales, err, ref_packed, ref_scales, ref_err, block):
    """The contract for hostile values: a block's scale is non-finite exactly where the
    reference's is (so the call is rejected identically everywhere), and every block with
    a finite scale has exactly the reference's bits, scale and error. The bits and errors
    of a non-finite block are not compared: IEEE leaves the sign of a NaN unspecified, and
    compilers may legally flip it (x + -y rewritten as x - y)."""
    assert torch.equal(torch.isfinite(scales), torch.isfinite(ref_scales))
    if packed.numel() == 0:
        return
    rows = packed.reshape(-1, packed.shape[-1])
    m = rows.shape[1] * 8
    ok = R._expand(torch.isfinite(ref_scales).reshape(rows.shape[0], -1), m, block).reshape(-1)
    bits, ref_bits = R.unpack_signs(rows).reshape(-1), R.unpack_signs(ref_packed.reshape(rows.shape)).reshape(-1)
    assert torch.equal(bits[ok], ref_bits[ok])
    _same(scales, ref_scales)
    _same(err.reshape(-1)[ok], ref_err.reshape(-1)[ok])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_tensors())
def test_worker_kernel_matches_reference_on_any_values(case):
    x, e, block = case
    ref_packed, ref_scales, ref_err = R.worker_compress(x, e, block)
    err = e.clone()
    packed, scales = ops.worker_compress(x, err, block)
    _same_where_finite(packed, scales, err, ref_packed, ref_scales, ref_err, block)
    if torch.isfinite(x).all():
        assert torch.equal(packed, ref_packed)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_tensors(), st.integers(0, 2**31 - 1))
def test_server_kernel_and_unpack_match_reference_on_any_values(case, seed):
    x, e, block = case
    p, m = e.shape
    packed, scales = ops.worker_compress(x, e.clone(), block)
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(m, generator=g)
    real = min(x.numel(), m)
    s[real:] = 0
    ref = R.server_compress(packed, scales, s, block, real)
    err = s.clone()
    got = ops.server_compress(packed, scales, err, block, real)
    _same_where_finite(got[0], got[1], err, ref[0], ref[1], ref[2], block)
    if torch.isfinite(scales).all():
        assert torch.equal(got[0], ref[0])
        assert torch.equal(ops.unpack(packed, scales, x.numel(), block), R.unpack(packed, scales, x.numel(), block))


# ------------------------------------------------------------------ soak (short)
def _soak(rank, p, steps, n):
    return soak_rank(rank, steps, n)


def test_short_soak_identical_and_bounded():
    check(run_ranks(_soak, 4, 300, 3001, timeout=300), window=100)
