"""One state contract for every compressor: the reducers, the DDP hook state, the 1-bit
optimizers and the model-parallel DCT boundary all report `compression_stats()` with the
same keys (plain numbers), and save and restore their error feedback with `state_dict` /
`load_state_dict`."""
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from dist_util import run_ranks
from lbcomm.comm import get_transport
from lbcomm.common import STATS_KEYS
from lbcomm.dct_mp import DCTBoundary


def _plain(stats):
    return all(isinstance(stats[k], (int, float)) and not isinstance(stats[k], bool) for k in STATS_KEYS)


def _boundary(rank, g):
    """A few thresholded exchanges across a DCTBoundary: rank 0 sends activations, rank 1
    sends their gradients back. Its stats, and those of a fresh boundary before and after
    loading its state_dict."""
    link = DCTBoundary(get_transport(backend="torch"), density=0.25, refresh_every=2)
    fresh = DCTBoundary(get_transport(backend="torch"), density=0.25, refresh_every=2)
    out = {"fresh": fresh.compression_stats()}
    w = torch.randn(16, 4, generator=g)
    for _ in range(3):
        if rank == 0:
            x = torch.randn(8, 16, generator=g, requires_grad=True)
            link.send(x)
            x.backward(link.recv_grad())
        else:
            x = link.recv((8, 16))
            (x @ w).pow(2).mean().backward()
            link.send_grad(x.grad)
    out["stats"] = link.compression_stats()
    fresh.load_state_dict(link.state_dict())
    out["loaded"] = fresh.compression_stats()
    return out


def _contract(rank, p):
    torch.manual_seed(0)
    out = {}
    g = torch.Generator().manual_seed(rank)
    reducer = lbcomm.make_reducer(5000)
    x = torch.randn(5000, generator=g)
    reducer.reduce_(x, x)
    out["reducer"] = reducer.compression_stats()
    before = reducer.state_dict()
    fresh = lbcomm.make_reducer(5000)
    out["reducer_load"] = fresh.load_state_dict(before)
    out["reducer_same"] = torch.equal(fresh.worker_error, reducer.worker_error)

    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2, comm=lbcomm.CommConfig(exact_numel=0))
    ddp_model = DDP(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)))
    hook = lbcomm.OneBitHookState(2, comm=lbcomm.CommConfig(exact_numel=0))
    sgd = torch.optim.SGD(ddp_model.parameters(), lr=1e-2)
    lbcomm.attach(ddp_model, hook, optimizer=sgd)
    out["fresh_optimizer"] = opt.compression_stats()
    out["fresh_onebit"] = [o.compression_stats() for o in (
        lbcomm.OneBitLamb(nn.Linear(4, 4).parameters(), lr=1e-3, freeze_step=2),
        lbcomm.ZeroOneAdam(nn.Linear(4, 4).parameters(), lr=1e-3))]
    for _ in range(5):
        data = torch.randn(8, 64, generator=g)
        for m, o in ((model, opt), (ddp_model, sgd)):
            o.zero_grad()
            m(data).pow(2).mean().backward()
            o.step()
    out["optimizer"] = opt.compression_stats()
    out["hook"] = hook.compression_stats()
    out["boundary"] = _boundary(rank, g)
    return out


def _zeros(stats):
    return {k: stats[k] for k in STATS_KEYS} == dict.fromkeys(STATS_KEYS, 0)


def test_every_compressor_reports_the_same_statistics():
    for rank, res in enumerate(run_ranks(_contract, 2, timeout=300)):
        res["boundary_stats"] = res["boundary"]["stats"]
        # the sender holds the residual; the receiver sends gradients and holds none
        for who in ("reducer", "optimizer", "hook") + (("boundary_stats",) if rank == 0 else ()):
            stats = res[who]
            assert set(STATS_KEYS) <= set(stats) and _plain(stats), (who, stats)
            assert all(stats[k] > 0 for k in STATS_KEYS if k != "skipped_calls"), (who, stats)
            assert stats["skipped_calls"] == 0, (who, stats)
        # a fresh 1-bit optimizer: the keys every compressor reports, all zero, and why it is not compressing
        for fresh in [res["fresh_optimizer"]] + res["fresh_onebit"]:
            assert set(fresh) == set(STATS_KEYS) | {"status"} and _plain(fresh) and _zeros(fresh), fresh
            assert isinstance(fresh["status"], str) and fresh["status"] and fresh["status"] != "compressing", fresh
        assert res["optimizer"]["status"] == "compressing"
        assert res["optimizer"]["compressed_calls"] == 3  # steps 3, 4 and 5 compress
        assert res["reducer"]["compressed_calls"] == 1
        assert res["reducer_load"] is True and res["reducer_same"]
        link = res["boundary"]
        assert set(STATS_KEYS) <= set(link["fresh"]) and _plain(link["fresh"]) and _zeros(link["fresh"]), link
        assert link["stats"]["compressed_calls"] == 3 and link["stats"]["bytes_sent"] > 0, link
        if rank == 1:
            assert link["stats"]["error_norm"] == 0.0 == link["stats"]["error_ratio"], link
        # restored: the counters and the residual; the ratio waits for the next send
        assert {k: link["loaded"][k] for k in STATS_KEYS if k != "error_ratio"} == \
            {k: link["stats"][k] for k in STATS_KEYS if k != "error_ratio"} and link["loaded"]["error_ratio"] == 0.0


def test_one_load_signature_and_one_form_of_elastic_resume():
    """Every compressor's load_state_dict returns whether its error feedback carried over
    (a bool), and every data-parallel one takes the saved world as ``all_ranks=``: the
    reducers too, not only their owners."""
    import inspect

    from lbcomm.reduce.hierarchical import HierarchicalState

    elastic = (lbcomm.CompressionState, HierarchicalState, lbcomm.OneBitHookState, lbcomm.DCTHookState,
               lbcomm.OneBitHSDPState, lbcomm.OneBitLocalUpdates)
    for cls in elastic + (DCTBoundary, lbcomm.Reducer):
        sig = inspect.signature(cls.load_state_dict)
        assert sig.return_annotation in (bool, "bool"), cls
        if cls is not DCTBoundary:  # two fixed ranks of a model-parallel boundary: no world to change
            assert sig.parameters["all_ranks"].kind is inspect.Parameter.KEYWORD_ONLY, cls


def test_a_reducer_resumes_elastically_with_all_ranks():
    """CompressionState.load_state_dict(sd, all_ranks=saved) is the redistributed state,
    loaded (one process: a world of one takes the state of two saved ranks)."""
    from lbcomm.reduce.compression import CompressionState

    one = CompressionState(5000, block_size=256).state_dict()
    g = torch.Generator().manual_seed(0)
    one["worker_error"].copy_(torch.randn(one["worker_error"].shape, generator=g))
    one["server_error"].copy_(torch.randn(one["server_error"].shape, generator=g))
    saved = [CompressionState.redistribute([one], 2, r) for r in range(2)]
    elastic, direct, plain = (CompressionState(5000, block_size=256) for _ in range(3))
    assert elastic.load_state_dict(saved[0], all_ranks=saved) is True
    assert direct.load_state_dict(CompressionState.redistribute(saved, 1, 0)) is True
    assert all(torch.equal(elastic.state_dict()[k], direct.state_dict()[k]) for k in ("worker_error", "server_error"))
    assert plain.load_state_dict(saved[0]) is False  # another world without all_ranks: reset
    assert float(plain.state_dict()["worker_error"].abs().sum()) == 0.0
