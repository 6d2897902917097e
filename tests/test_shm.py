"""The shared-memory transport (lbcomm.comm.shm) on real gloo ranks: its byte collectives
give exactly what the torch transport gives, buffers grow on demand, nothing is left in
/dev/shm, and clear errors."""
import os

import pytest
import torch

from dist_util import run_ranks
from lbcomm.comm import get_transport
from lbcomm.comm.shm import SHM_DIR, ShmTransport

P = 3


def _collectives(rank, p):
    shm, ref = ShmTransport(), get_transport(None, backend="torch")
    ok = []
    for L in (5, 64, 1000, 7, 40000):  # buffers grow (and are reused) on the way
        g = torch.Generator().manual_seed(rank * 100 + L)
        inp = torch.randint(0, 256, (p, L), dtype=torch.uint8, generator=g)
        a, b = torch.empty_like(inp), torch.empty_like(inp)
        shm.all_to_all(a, inp)
        ref.all_to_all(b, inp)
        ok.append(torch.equal(a, b))
        row = torch.randint(0, 256, (L,), dtype=torch.uint8, generator=g)
        a, b = torch.empty(p * L, dtype=torch.uint8), torch.empty(p * L, dtype=torch.uint8)
        assert shm.all_gather(a, row, async_op=True).wait()[0] is a
        ref.all_gather(b, row)
        ok.append(torch.equal(a, b))
    from lbcomm.comm.base import Transport

    assert isinstance(shm, Transport)
    for L, use_async in ((12, False), (400, True), (8, True)):  # row collectives: read in place, same rows
        g = torch.Generator().manual_seed(rank * 7 + L)
        data = torch.randint(0, 256, (p, L), dtype=torch.uint8, generator=g)
        got = []
        for tr in (shm, ref):
            tr.rows_out(p, L, torch.device("cpu")).copy_(data)
            rows = tr.all_to_all_rows(async_op=use_async)
            rows = rows.wait() if use_async else rows
            got.append([r.clone() for r in rows])
            tr.rows_out(1, L, torch.device("cpu"))[0].copy_(data[0])
            rows = tr.all_gather_rows(async_op=use_async)
            got.append([r.clone() for r in (rows.wait() if use_async else rows)])
        ok.append(all(torch.equal(a, b) for a, b in zip(got[0] + got[1], got[2] + got[3])))
    x = torch.arange(4.0) + rank
    shm.all_reduce(x, "sum")
    ok.append(torch.equal(x, torch.arange(4.0) * p + sum(range(p))))
    with pytest.raises(ValueError, match="CPU tensors"):
        shm.check_device(torch.device("meta"))
    shm.barrier()
    left = [f for f in os.listdir(SHM_DIR) if f.startswith(f"lbcomm-{shm._token}")]
    return ok, left


def test_shm_transport_equals_torch_transport():
    for ok, left in run_ranks(_collectives, P):
        assert all(ok), ok
        assert left == []  # every file unlinked once mapped
