"""``error_ratio`` in ``compression_stats()``: the error feedback's norm over the norm of what
was last sent, so that ``error_norm`` has a scale."""
import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from dist_util import run_ranks
from lbcomm.common import compressor_stats, error_ratio

CASES = [(5000, 64, 2), (3001, None, 1), (700, 256, 1)]  # numel, block_size, pieces (padding in each)


def _sent_by_the_data(x, worker_before, worker_after, out, span):
    """The squared norm of what one rank sent, decoded, from the data rather than the block
    scales: its worker values are x + e_before - e_after, its server values the result's
    entries of the chunk it serves."""
    n = x.numel()
    worker = x.double() + worker_before[:n].double() - worker_after[:n].double()
    lo, hi = span
    return float(worker.square().sum() + out[lo:hi].double().square().sum())


def _ratios(rank, p):
    g = torch.Generator().manual_seed(rank)
    out = {"flat": []}
    for numel, block, pieces in CASES:
        st = lbcomm.CompressionState(numel, block_size=block, pieces=pieces)
        for _ in range(4):
            x = torch.randn(numel, generator=g)
            before = st.worker_error.clone()
            y = lbcomm.compressed_allreduce(x, st, out=torch.empty(numel))
        stats = st.compression_stats()
        sent = _sent_by_the_data(x, before, st.worker_error, y, st.served_span())
        out["flat"].append((stats, sent, st.last_sent_norm))

    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2, comm=lbcomm.CommConfig(exact_numel=0))
    ddp_model = DDP(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)))
    hook = lbcomm.OneBitHookState(2, comm=lbcomm.CommConfig(exact_numel=0))
    ddp_model.register_comm_hook(hook, lbcomm.onebit_hook)
    sgd = torch.optim.SGD(ddp_model.parameters(), lr=1e-2)
    for _ in range(5):
        data = torch.randn(8, 64, generator=g)
        for m, o in ((model, opt), (ddp_model, sgd)):
            o.zero_grad()
            m(data).pow(2).mean().backward()
            o.step()
    out["optimizer"] = opt.compression_stats()
    out["hook"] = hook.compression_stats()
    out["hook_sent"] = [u.compression.last_sent_norm for u in hook.planner.units()]
    return out


@pytest.mark.multiproc
def test_error_ratio_is_the_error_norm_over_what_was_sent():
    for res in run_ranks(_ratios, 2, timeout=300):
        for stats, sent_sq, last_sent in res["flat"]:
            assert last_sent == pytest.approx(math.sqrt(sent_sq), rel=1e-5)
            assert stats["error_ratio"] == pytest.approx(stats["error_norm"] / math.sqrt(sent_sq), rel=1e-5)
            # one 1-bit compression with RMS scales errs by at most sqrt(2) times its input
            assert 0.1 < stats["error_ratio"] <= math.sqrt(2), stats
        for who in ("optimizer", "hook"):
            assert 0.1 < res[who]["error_ratio"] <= math.sqrt(2), (who, res[who])
        hook, sent = res["hook"], math.sqrt(sum(s * s for s in res["hook_sent"]))
        assert sent > 0 and hook["error_ratio"] == pytest.approx(hook["error_norm"] / sent, rel=1e-9)


def test_error_ratio_is_zero_before_anything_was_sent():
    assert compressor_stats(None)["error_ratio"] == 0.0
    st = lbcomm.CompressionState(100)  # one process: nothing is compressed
    lbcomm.compressed_allreduce_(torch.randn(100), st)
    assert st.last_sent_norm == 0.0 and st.compression_stats()["error_ratio"] == 0.0
    assert error_ratio(3.0, 0.0) == 0.0 and error_ratio(3.0, 2.0) == 1.5
