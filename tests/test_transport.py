"""The transport interface (lbcomm.comm): all_reduce and barrier on real gloo ranks, the
same calls on MPI (tests/test_mpi.py compares them bitwise) and the in-process loop."""
import pytest
import torch

import mpi_worker
from dist_util import run_ranks
from lbcomm.comm import LoopTransport, get_transport

P = 3


def expected(p):
    ranks = [torch.arange(1000, dtype=torch.float32) % 17 + r for r in range(p)]
    stack = torch.stack(ranks)
    total = stack.sum(0)
    return {"sum": total, "mean": total / p, "max": stack.max(0).values, "min": stack.min(0).values,
            "bucketed": total, "async_mean": total / p}


def check_transport_results(res, p):
    want = expected(p)
    for key, value in want.items():
        assert torch.equal(res[key], value), key
    assert res["async_mean_same_tensor"] is True
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int64):
        got = res[f"sum_{dtype}"]
        assert got.dtype == dtype and torch.equal(got, want["sum"].to(dtype)), dtype
    assert "contiguous" in res["noncontiguous"]
    assert "invalid op" in res["bad_op"]


def _gloo(rank, p):
    return mpi_worker.transport_ops(rank, p, "torch")


def test_torch_transport_all_reduce_and_barrier():
    for res in run_ranks(_gloo, P):
        check_transport_results(res, P)


def test_one_rank_transport_is_identity():
    tr = get_transport()
    t = torch.arange(5.0)
    assert tr.all_reduce(t, "sum") is None and torch.equal(t, torch.arange(5.0))
    assert tr.all_reduce(t, "mean", async_op=True).wait() is t
    tr.barrier()


def test_loop_transport():
    tr = LoopTransport(4)
    t = torch.arange(6.0)
    tr.all_reduce(t, "sum")
    assert torch.equal(t, torch.arange(6.0) * 4)
    tr.all_reduce(t, "mean")
    assert torch.equal(t, torch.arange(6.0) * 4)
    out = torch.empty(4 * 3, dtype=torch.uint8)
    assert tr.all_gather(out, torch.tensor([1, 2, 3], dtype=torch.uint8), async_op=True).wait()[0] is out
    assert out.tolist() == [1, 2, 3] * 4
    tr.barrier()
    with pytest.raises(ValueError, match="world_size"):
        LoopTransport(0)
    with pytest.raises(ValueError, match="invalid op"):
        tr.all_reduce(t, "avg")
