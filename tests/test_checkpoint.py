"""Per-rank checkpoints: save in the compression stage, resume in fresh
processes. Same world size: bitwise identical to a run that never stopped. Another world
size: a logged warning, error buffers reset, training goes on and the loss keeps falling."""
import logging
import os

import pytest
import torch
from torch import nn

import lbcomm
from dist_util import run_ranks, same as _same
from optim_util import OPTS, _flat_state, _loss, _mlp, _snapshot

SAVE_AT, TOTAL, FREEZE = 8, 16, 4  # saved 4 steps into the compression stage


def _make(name):
    model = _mlp(seed=5)
    opt = OPTS[name](model.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=FREEZE,
                     comm=lbcomm.CommConfig(block_size=64, exact_numel=0))  # every parameter compressed: errors to save
    return model, opt


def _step(model, opt, rank, t):
    opt.zero_grad()
    loss = _loss(model, rank, t)
    loss.backward()
    opt.step()
    return loss.item()


def _capture_warnings():
    records = []

    class _Handler(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("lbcomm")
    logger.addHandler(_Handler(level=logging.WARNING))
    logger.setLevel(logging.INFO)
    return records


def _uninterrupted(rank, p, ckpt):
    out = {}
    for name in OPTS:
        model, opt = _make(name)
        for t in range(TOTAL):
            if t == SAVE_AT:
                assert opt.frozen
                lbcomm.save_sharded(os.path.join(ckpt, name), opt, model, extra={"step": t})
            _step(model, opt, rank, t)
        out[name] = _snapshot(model, opt)
    return out


def _resume(rank, p, ckpt, steps, elastic=True):
    warnings = _capture_warnings()
    out = {}
    for name in OPTS:
        model, opt = _make(name)
        info = lbcomm.load_sharded(os.path.join(ckpt, name), opt, model, elastic=elastic)
        start = info["extra"]["step"]
        comp = opt.compression_state
        res = {"exact": info["exact"], "start": start, "loaded": _snapshot(model, opt),
               "errors_zero": comp is not None and not comp.worker_error.any() and not comp.server_error.any(),
               "eval": [_loss(model, 99, 999).item()]}
        train = [_step(model, opt, rank, t) for t in range(start, start + steps)]
        res.update(after=_snapshot(model, opt), train=train, eval_after=_loss(model, 99, 999).item())
        out[name] = res
    out["warnings"] = warnings
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    return ckpt, run_ranks(_uninterrupted, 2, ckpt, timeout=180)


def test_shards_are_one_file_per_rank(saved):
    ckpt, _ = saved
    for name in OPTS:
        assert sorted(os.listdir(os.path.join(ckpt, name))) == ["shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]
        shards = [torch.load(lbcomm.checkpoint.shard_path(os.path.join(ckpt, name), r, 2), weights_only=True) for r in range(2)]
        errors = [s["optimizer"]["lbcomm"]["compression"]["worker_error"] for s in shards]
        assert errors[0].abs().sum() > 0 and not torch.equal(errors[0], errors[1])  # each rank its own errors


def test_resume_with_the_same_world_size_is_bitwise_identical(saved):
    ckpt, full = saved
    resumed = run_ranks(_resume, 2, ckpt, TOTAL - SAVE_AT, timeout=180)
    for rank in range(2):
        for name in OPTS:
            res = resumed[rank][name]
            assert res["exact"] and res["start"] == SAVE_AT
            ref = full[rank][name]
            for key in ("params", "buffers", "vectors", "errors", "global_step"):
                assert _same(res["after"][key], ref[key]), (rank, name, key)
        assert resumed[rank]["warnings"] == []


def test_resume_with_another_world_size_without_elastic_warns_resets_and_keeps_learning(saved):
    ckpt, full = saved
    resumed = run_ranks(_resume, 3, ckpt, 12, False, timeout=180)  # elastic=False: the reset (test_elastic.py)
    for rank in range(3):
        warnings = resumed[rank]["warnings"]
        assert any("saved by 2 ranks and this run has 3" in w for w in warnings), warnings
        assert any("resetting them to zero" in w for w in warnings), warnings
        for name in OPTS:
            res = resumed[rank][name]
            assert not res["exact"] and res["errors_zero"]
            # the model and the moments come back as saved (they are the same on every rank)
            saved_state = torch.load(lbcomm.checkpoint.shard_path(os.path.join(ckpt, name), rank % 2, 2), weights_only=True)
            assert _same(res["loaded"]["buffers"], _flat_state(saved_state["optimizer"])["buffers"])
            assert res["after"]["global_step"] == SAVE_AT + 12
            assert all(torch.isfinite(q).all() for q in res["after"]["params"])
            assert res["eval_after"] < res["eval"][0], (name, res["eval"], res["eval_after"])
    for name in OPTS:  # still one model: identical on all three ranks
        for rank in (1, 2):
            assert _same(resumed[rank][name]["after"]["params"], resumed[0][name]["after"]["params"])


def test_save_and_load_on_one_rank(tmp_path):
    model, opt = _make("adam")
    for t in range(6):
        _step(model, opt, 0, t)
    path = lbcomm.save_sharded(str(tmp_path), opt, model, extra={"step": 6, "note": "x"})
    assert os.path.basename(path) == "shard-00000-of-00001.pt"
    model2, opt2 = _make("adam")
    info = lbcomm.load_sharded(str(tmp_path), opt2, model2)
    assert info["exact"] and info["extra"] == {"step": 6, "note": "x"} and info["saved_world_size"] == 1
    for t in range(6, 10):
        _step(model, opt, 0, t)
        _step(model2, opt2, 0, t)
    assert _same(_snapshot(model, opt), _snapshot(model2, opt2))


def test_loading_problems_are_reported(tmp_path):
    model, opt = _make("lamb")
    with pytest.raises(FileNotFoundError, match="no lbcomm checkpoint shards"):
        lbcomm.load_sharded(str(tmp_path / "missing"), opt, model)
    lbcomm.save_sharded(str(tmp_path), model=model)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        lbcomm.load_sharded(str(tmp_path), opt, model)
    lbcomm.load_sharded(str(tmp_path), model=nn.Sequential(*list(_mlp(seed=9))))
    other = tmp_path / "other"
    other.mkdir()
    torch.save({"not": "a shard"}, lbcomm.checkpoint.shard_path(str(other), 0, 1))
    with pytest.raises(ValueError, match="not an lbcomm checkpoint shard"):
        lbcomm.load_sharded(str(other), opt)
