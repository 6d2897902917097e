"""Elastic resume (another world size): the error feedback of every saved rank is
redistributed so that the total carried error of DESIGN.md §1's invariant,
mean_r(worker error r) + concat_k(server error k), is preserved (to float rounding).
The pure function against a direct computation, and `load_sharded` 4 -> 2 and 2 -> 4
ranks in real processes."""
import os

import pytest
import torch

import lbcomm
from dist_util import run_ranks
from lbcomm.compressed import CompressionState, redistribute_errors
from lbcomm.wire import chunk_size
from test_optim import OPTS, _loss, _mlp

FREEZE, SAVE_AT = 3, 6


def _total(states):
    """mean_r(worker error r) + concat_k(server error k), over the real elements (float64)."""
    n = states[0]["numel"]
    worker = torch.stack([s["worker_error"].reshape(-1)[:n].double() for s in states]).mean(0)
    server = torch.cat([s["server_error"].reshape(-1) for s in states])[:n].double()
    return worker + server


def _random_shards(numel, world, block, seed):
    g = torch.Generator().manual_seed(seed)
    m = chunk_size(numel, world)
    shards = []
    for r in range(world):
        w = torch.randn(world * m, generator=g)
        w[numel:] = 0  # pad slots carry no error
        s = torch.randn(m, generator=g)
        s[max(0, min(m, numel - r * m)):] = 0
        shards.append({"numel": numel, "world_size": world, "rank": r, "block_size": block,
                       "worker_error": w.view(world, m), "server_error": s, "calls": 7, "skipped": 1})
    return shards


@pytest.mark.parametrize("old, new", [(4, 2), (2, 4), (3, 5), (4, 1)])
@pytest.mark.parametrize("numel", [1, 1000, 4099])
def test_redistribution_preserves_the_total_error(old, new, numel):
    shards = _random_shards(numel, old, 64, seed=numel + old)
    out = [redistribute_errors(shards, new, r) for r in range(new)]
    m = chunk_size(numel, new)
    for r, sd in enumerate(out):
        assert (sd["numel"], sd["world_size"], sd["rank"], sd["block_size"]) == (numel, new, r, 64)
        assert sd["worker_error"].shape == (new, m) and sd["server_error"].shape == (m,)
        assert sd["calls"] == 7 and sd["skipped"] == 1
        assert not sd["worker_error"].reshape(-1)[numel:].any()  # pad slots hold zero
        assert not sd["server_error"][max(0, min(m, numel - r * m)):].any()
        assert torch.equal(sd["worker_error"], out[0]["worker_error"])  # every rank the same worker error
    # the server errors move exactly; the worker part is the mean (one rounding to fp32)
    assert torch.equal(torch.cat([s["server_error"] for s in out])[:numel],
                       torch.cat([s["server_error"] for s in shards])[:numel])
    torch.testing.assert_close(_total(out), _total(shards), rtol=1e-6, atol=1e-7)


def test_redistributed_state_loads_into_a_compression_state():
    shards = _random_shards(1000, 4, 64, seed=3)
    st = CompressionState(1000, block_size=64)  # one rank: world 1
    sd = redistribute_errors(shards, 1, 0)
    assert st.load_state_dict(sd)
    torch.testing.assert_close(st.worker_error.double()[:1000] + st.server_error.double()[:1000], _total(shards),
                               rtol=1e-6, atol=1e-7)


def test_redistribution_refuses_an_incomplete_world():
    shards = _random_shards(100, 4, 64, seed=1)
    with pytest.raises(ValueError, match="every rank's shard"):
        redistribute_errors(shards[:3], 2, 0)
    with pytest.raises(ValueError, match="every rank's shard"):
        redistribute_errors(shards[::-1], 2, 0)
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        redistribute_errors(shards, 2, 2)


def _make(name):
    model = _mlp(seed=5)
    opt = OPTS[name](model.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=FREEZE, block_size=64)
    return model, opt


def _save(rank, p, ckpt):
    for name in OPTS:
        model, opt = _make(name)
        for t in range(SAVE_AT):
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()
        lbcomm.save_sharded(os.path.join(ckpt, name), opt, model, extra={"step": SAVE_AT})


def _resume(rank, p, ckpt):
    out = {}
    for name in OPTS:
        model, opt = _make(name)
        info = lbcomm.load_sharded(os.path.join(ckpt, name), opt, model)
        loaded = opt.compression_state.state_dict()
        for t in range(SAVE_AT, SAVE_AT + 3):
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()
        out[name] = {"exact": info["exact"], "loaded": loaded,
                     "params": [q.detach().clone() for q in model.parameters()]}
    return out


@pytest.mark.parametrize("old, new", [(4, 2), (2, 4)])
def test_load_sharded_redistributes_the_error_feedback(old, new, tmp_path):
    ckpt = str(tmp_path)
    run_ranks(_save, old, ckpt, timeout=240)
    resumed = run_ranks(_resume, new, ckpt, timeout=240)
    for name in OPTS:
        saved = [torch.load(lbcomm.shard_path(os.path.join(ckpt, name), r, old), weights_only=True)
                 ["optimizer"]["lbcomm"]["compression"] for r in range(old)]
        loaded = [resumed[r][name]["loaded"] for r in range(new)]
        assert all(not resumed[r][name]["exact"] for r in range(new))
        assert [s["world_size"] for s in loaded] == [new] * new and _total(saved).abs().sum() > 0
        torch.testing.assert_close(_total(loaded), _total(saved), rtol=1e-6, atol=1e-7)
        for r in range(1, new):  # training went on as one model
            assert all(torch.equal(a, b) for a, b in zip(resumed[r][name]["params"], resumed[0][name]["params"]))
