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


def _small_sums(rank, p):
    """A few non-integer values (the small path) and a larger tensor (gloo's ring)."""
    from lbcomm.comm.base import SMALL_ALL_REDUCE_BYTES

    tr = get_transport()
    out = {}
    for name, n in (("small", 37), ("large", SMALL_ALL_REDUCE_BYTES // 4)):
        for op in ("sum", "max"):
            t = torch.randn(SMALL_ALL_REDUCE_BYTES // 4, generator=torch.Generator().manual_seed(100 + rank))
            t = t[:n].clone()
            tr.all_reduce(t, op)
            out[f"{name}_{op}"] = t
    return out


def test_small_all_reduce_is_the_rank_order_sum_on_every_rank():
    """On gloo, a few values go through one all-to-all and are summed here in rank order:
    every rank holds the same bits, those of the sequential sum; a larger tensor takes
    gloo's ring (equal on every rank, the sum within rounding)."""
    res = run_ranks(_small_sums, 4)
    from lbcomm.comm.base import SMALL_ALL_REDUCE_BYTES

    n_large = SMALL_ALL_REDUCE_BYTES // 4
    inputs = [torch.randn(n_large, generator=torch.Generator().manual_seed(100 + r)) for r in range(4)]
    for name, n in (("small", 37), ("large", n_large)):
        seq = inputs[0][:n].clone()
        for x in inputs[1:]:
            seq.add_(x[:n])
        peak = torch.stack([x[:n] for x in inputs]).max(0).values
        for r in res:
            assert torch.equal(r[f"{name}_sum"], res[0][f"{name}_sum"]) and torch.equal(r[f"{name}_max"], peak)
        if name == "small":
            assert torch.equal(res[0]["small_sum"], seq)
        else:
            torch.testing.assert_close(res[0]["large_sum"], seq)


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


def _conforms(cls) -> list:
    """The members of the Transport protocol that `cls` lacks (static check, no instance)."""
    import inspect

    from lbcomm.comm.base import Transport

    missing = []
    for name in ("check_device", "all_to_all", "all_gather", "all_reduce", "barrier", "rows_out",
                 "all_to_all_rows", "all_gather_rows"):
        mine = getattr(cls, name, None)
        if mine is None:
            missing.append(name)
            continue
        want = list(inspect.signature(getattr(Transport, name)).parameters)
        if list(inspect.signature(mine).parameters)[:len(want)] != want:
            missing.append(f"{name}{inspect.signature(mine)}")
    return missing


def test_every_transport_conforms_to_the_protocol():
    from lbcomm.comm.base import Transport
    from lbcomm.comm.counting import CountingTransport
    from lbcomm.comm.mpi import MPITransport
    from lbcomm.comm.shm import ShmTransport
    from lbcomm.comm.torch_dist import TorchTransport

    for cls in (TorchTransport, MPITransport, LoopTransport, ShmTransport, CountingTransport):
        assert _conforms(cls) == [], cls
    for tr in (get_transport(), LoopTransport(3), CountingTransport(LoopTransport(2)), CountingTransport(get_transport())):
        assert isinstance(tr, Transport), tr
    # ShmTransport and MPITransport instances: tests/test_shm.py and tests/mpi_worker.py


def test_row_collectives_of_the_loop_transport():
    """rows_out + all_to_all_rows / all_gather_rows through the byte collectives, and the
    counted bytes of a CountingTransport (rows are counted like the byte collectives)."""
    from lbcomm.comm.counting import CountingTransport

    tr = CountingTransport(LoopTransport(3))
    send = tr.rows_out(3, 8, torch.device("cpu"))
    assert send.shape == (3, 8) and send.dtype == torch.uint8 and not send.any()
    send.copy_(torch.arange(24, dtype=torch.uint8).view(3, 8))
    rows = tr.all_to_all_rows(async_op=True).wait()
    assert [r.tolist() for r in rows] == send.tolist()  # the loop: every rank sent what this one sent
    mine = tr.rows_out(1, 8, torch.device("cpu"))
    mine.fill_(7)
    assert [r.tolist() for r in tr.all_gather_rows()] == [[7] * 8] * 3
    assert tr.bytes_sent == 24 * 2 // 3 + 8 * 2 and tr.rounds == 2
    with pytest.raises(RuntimeError, match="rows_out"):
        tr.all_gather_rows()
