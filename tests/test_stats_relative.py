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

    torch.manual_seed(0)  # the same initial weights on every rank
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

    # DmSGD's compressed gossip: what it sent is what its own estimate moved by, decoded
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    gossip = lbcomm.DmSGD(model.parameters(), lr=1e-2, compress=True, comm=lbcomm.CommConfig(block_size=256))
    for _ in range(4):
        before = [gossip.state[q]["sent_estimate_0"].clone() for q in model.parameters()] if gossip.state else []
        gossip.zero_grad()
        model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        gossip.step()
    moved = sum(float((gossip.state[q]["sent_estimate_0"] - b).double().square().sum())
                for q, b in zip(model.parameters(), before))
    out["dmsgd"], out["dmsgd_sent"] = gossip.compression_stats(), math.sqrt(moved)
    out["dmsgd_fp32"] = lbcomm.DmSGD(nn.Linear(4, 4).parameters(), lr=1e-2).compression_stats()

    # local updates in two fragments: the fragments' reducers together
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    inner = torch.optim.SGD(model.parameters(), lr=1e-2)
    local = lbcomm.OneBitLocalUpdates(model.parameters(), inner, 2, fragments=2,
                                      comm=lbcomm.CommConfig(exact_numel=0))
    for _ in range(8):
        inner.zero_grad()
        model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        inner.step()
        local.step()
    out["local"] = local.compression_stats()
    out["local_sent"] = [f.reducer.last_sent_norm for f in local.fragments]
    return out


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
        # DmSGD: the message's RMS block scales give it the norm of y - x^, what the estimate moved by
        dm = res["dmsgd"]
        assert dm["error_ratio"] == pytest.approx(dm["error_norm"] / res["dmsgd_sent"], rel=1e-4)
        assert 0.1 < dm["error_ratio"] <= math.sqrt(2), dm
        assert res["dmsgd_fp32"]["error_ratio"] == 0.0 == res["dmsgd_fp32"]["error_norm"]
        local, sent = res["local"], math.sqrt(sum(s * s for s in res["local_sent"]))
        assert len(res["local_sent"]) == 2 and min(res["local_sent"]) > 0
        assert local["error_ratio"] == pytest.approx(local["error_norm"] / sent, rel=1e-9)
        assert 0.1 < local["error_ratio"] <= math.sqrt(2), local


def test_error_ratio_is_zero_before_anything_was_sent():
    assert compressor_stats(None)["error_ratio"] == 0.0
    st = lbcomm.CompressionState(100)  # one process: nothing is compressed
    lbcomm.compressed_allreduce_(torch.randn(100), st)
    assert st.last_sent_norm == 0.0 and st.compression_stats()["error_ratio"] == 0.0
    assert error_ratio(3.0, 0.0) == 0.0 and error_ratio(3.0, 2.0) == 1.5
