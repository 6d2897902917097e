"""One state contract for every compressor: the reducers, the DDP hook state and the 1-bit
optimizers all report `compression_stats()` with the same keys (plain numbers), and save
and restore their error feedback with `state_dict` / `load_state_dict`."""
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from dist_util import run_ranks
from lbcomm.common import STATS_KEYS


def _plain(stats):
    return all(isinstance(stats[k], (int, float)) and not isinstance(stats[k], bool) for k in STATS_KEYS)


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
    for _ in range(5):
        data = torch.randn(8, 64, generator=g)
        for m, o in ((model, opt), (ddp_model, sgd)):
            o.zero_grad()
            m(data).pow(2).mean().backward()
            o.step()
    out["optimizer"] = opt.compression_stats()
    out["hook"] = hook.compression_stats()
    return out


def test_every_compressor_reports_the_same_statistics():
    for res in run_ranks(_contract, 2, timeout=300):
        for who in ("reducer", "optimizer", "hook"):
            stats = res[who]
            assert set(STATS_KEYS) <= set(stats) and _plain(stats), (who, stats)
            assert stats["compressed_calls"] > 0 and stats["bytes_sent"] > 0 and stats["error_norm"] > 0, (who, stats)
            assert stats["skipped_calls"] == 0, (who, stats)
        assert res["fresh_optimizer"] == {"compressed_calls": 0, "skipped_calls": 0, "bytes_sent": 0,
                                          "error_norm": 0.0}
        assert res["optimizer"]["compressed_calls"] == 3  # steps 3, 4 and 5 compress
        assert res["reducer"]["compressed_calls"] == 1
        assert res["reducer_load"] is True and res["reducer_same"]
