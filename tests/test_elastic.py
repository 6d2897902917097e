"""Elastic resume (another world size): the error feedback of every saved rank is
redistributed so that the total carried error of the error-feedback invariant,
mean_r(worker error r) + concat_k(server error k), is preserved (to float rounding).
The pure function against a direct computation, and `load_sharded` 4 -> 2 and 2 -> 4
ranks in real processes."""
import os

import pytest
import torch

import lbcomm
from dist_util import run_ranks
from lbcomm.compressed import CompressionState
from lbcomm.reducer import redistribute
from lbcomm.wire import chunk_size
from optim_util import OPTS, _loss, _mlp

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


@pytest.mark.parametrize("old, new", [(4, 2), (2, 4)])
def test_lightning_checkpoint_entries_are_redistributed(old, new):
    """Lightning's checkpoint holds every rank's entry: resumed on another number of ranks,
    each new rank's error feedback is the redistribution of all of them (total preserved)
    and the hook's units go to OneBitHookState.load_state_dict(all_ranks=...)."""
    pytest.importorskip("lightning")
    from lbcomm.integrations.lightning import _redistributed_entry

    shards = _random_shards(1000, old, 64, seed=old)
    hooks = [{"rank": r} for r in range(old)]
    entries = [_redistributed_entry([{"compression": c, "hook": h} for c, h in zip(shards, hooks)], new, r)
               for r in range(new)]
    assert all(e["hook_all_ranks"] == hooks for e in entries)
    assert [e["compression"]["rank"] for e in entries] == list(range(new))
    torch.testing.assert_close(_total([e["compression"] for e in entries]), _total(shards), rtol=1e-6, atol=1e-6)
    one = _redistributed_entry([{"compression": c, "hook": None} for c in shards], 1, 0)
    assert one["compression"] is None and one["compression_reset"]  # one rank compresses nothing
    with pytest.raises(ValueError, match="inconsistent"):
        _redistributed_entry([{"compression": shards[0], "hook": None}, {"compression": None, "hook": None}], new, 0)


@pytest.mark.parametrize("old, new", [(4, 2), (2, 4), (3, 5), (4, 1)])
@pytest.mark.parametrize("numel", [1, 1000, 4099])
def test_redistribution_preserves_the_total_error(old, new, numel):
    shards = _random_shards(numel, old, 64, seed=numel + old)
    out = [CompressionState.redistribute(shards, new, r) for r in range(new)]
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
    sd = CompressionState.redistribute(shards, 1, 0)
    assert st.load_state_dict(sd)
    torch.testing.assert_close(st.worker_error.double()[:1000] + st.server_error.double()[:1000], _total(shards),
                               rtol=1e-6, atol=1e-7)


def test_redistribute_is_the_one_entry_of_every_checkpoint_path(caplog):
    """lbcomm.reducer.redistribute: flat states through CompressionState.redistribute,
    None (start from zero) for nothing saved, one rank, or hierarchical states; an
    inconsistent checkpoint raises."""
    shards = _random_shards(1000, 4, 64, seed=5)
    for r in range(3):
        got, want = redistribute(shards, 3, r), CompressionState.redistribute(shards, 3, r)
        assert all(torch.equal(got[k], want[k]) if torch.is_tensor(want[k]) else got[k] == want[k] for k in want)
    assert redistribute([None] * 4, 2, 0) is None
    with caplog.at_level("WARNING", logger="lbcomm.reducer"):
        assert redistribute(shards, 1, 0) is None
        hier = [{"layout": (1000, 2, 2, r // 2, r % 2, 64), "calls": 1, "skipped": 0, "compression": sd}
                for r, sd in enumerate(shards)]
        assert redistribute(hier, 2, 0, where="ckpt-x") is None
    assert "nothing is compressed" in caplog.text and "ckpt-x" in caplog.text and "hierarchical" in caplog.text
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] of the checkpoint hold no compression state"):
        redistribute([shards[0], None, shards[2], shards[3]], 2, 0)


def test_redistribution_refuses_an_incomplete_world():
    shards = _random_shards(100, 4, 64, seed=1)
    with pytest.raises(ValueError, match="every rank's shard"):
        CompressionState.redistribute(shards[:3], 2, 0)
    with pytest.raises(ValueError, match="every rank's shard"):
        CompressionState.redistribute(shards[::-1], 2, 0)
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        CompressionState.redistribute(shards, 2, 2)


def _make(name):
    model = _mlp(seed=5)
    opt = OPTS[name](model.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=FREEZE,
                     comm=lbcomm.CommConfig(block_size=64, exact_numel=0))  # every parameter compressed
    return model, opt


def _save(rank, p, ckpt):
    for name in OPTS:
        model, opt = _make(name)
        for t in range(SAVE_AT):
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()
        lbcomm.save_sharded(os.path.join(ckpt, name), opt, model, extra={"step": SAVE_AT})


def _resume(rank, p, ckpt, old):
    from test_checkpoint import _capture_warnings

    warnings = _capture_warnings()
    out = {}
    for name in OPTS:
        model, opt = _make(name)
        # first what a framework does (rank 0's optimizer on every rank: a reset, logged at INFO) ...
        opt.load_state_dict(torch.load(lbcomm.checkpoint.shard_path(os.path.join(ckpt, name), 0, old),
                                       weights_only=True)["optimizer"])
        # ... then the redistribution, so the reset is never warned about
        info = lbcomm.load_sharded(os.path.join(ckpt, name), opt, model)
        loaded = opt.compression_state.state_dict()
        own = [opt.state[q]["exp_avg_local"].clone() for q in model.parameters()] if name == "lamb" else None
        for t in range(SAVE_AT, SAVE_AT + 3):
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()
        out[name] = {"exact": info["exact"], "loaded": loaded, "own": own,
                     "params": [q.detach().clone() for q in model.parameters()]}
    out["warnings"] = warnings
    return out


@pytest.mark.parametrize("old, new", [(4, 2), (2, 4)])
def test_load_sharded_redistributes_the_error_feedback(old, new, tmp_path):
    ckpt = str(tmp_path)
    run_ranks(_save, old, ckpt, timeout=240)
    resumed = run_ranks(_resume, new, ckpt, old, timeout=240)
    assert all(r["warnings"] == [] for r in resumed), [r["warnings"] for r in resumed]
    for name in OPTS:
        saved = [torch.load(lbcomm.checkpoint.shard_path(os.path.join(ckpt, name), r, old), weights_only=True)
                 ["optimizer"]["lbcomm"]["compression"] for r in range(old)]
        loaded = [resumed[r][name]["loaded"] for r in range(new)]
        assert all(not resumed[r][name]["exact"] for r in range(new))
        assert [s["world_size"] for s in loaded] == [new] * new and _total(saved).abs().sum() > 0
        torch.testing.assert_close(_total(loaded), _total(saved), rtol=1e-6, atol=1e-7)
        for r in range(1, new):  # training went on as one model
            assert all(torch.equal(a, b) for a, b in zip(resumed[r][name]["params"], resumed[0][name]["params"]))
    # OneBitLamb's momenta of each rank's own gradients: every new rank starts from the saved
    # ranks' mean (the momentum an uncompressed allreduce would have given), not from one of them
    states = [torch.load(lbcomm.checkpoint.shard_path(os.path.join(ckpt, "lamb"), r, old), weights_only=True)
              ["optimizer"]["state"] for r in range(old)]
    for j in range(len(resumed[0]["lamb"]["own"])):
        saved_own = [s[j]["exp_avg_local"] for s in states]
        assert not torch.equal(saved_own[0], saved_own[1])
        mean = torch.stack(saved_own).sum(0) / old
        for r in range(new):
            assert torch.equal(resumed[r]["lamb"]["own"][j].reshape(-1), mean.reshape(-1))


# ------------------------------------------------ OneBitHookState, and both through DCP
# Ranks save (6 steps: OneBitAdam frozen after 3, onebit_hook compressing from iteration 3)
# with lbcomm.save_sharded(hook_state=) and with torch.distributed.checkpoint (RankLocal);
# another world size resumes both ways (load_sharded(hook_state=); dcp.load with
# LoadPlanner), trains 2 steps and saves again; 4 -> 2 -> 4 ranks. Every resume must
# keep the total carried error of the optimizer and of every hook unit, and the replicas
# must stay bitwise identical. The saved states travel through files: handing saved tensors
# to spawned ranks as arguments shares their memory between ranks that load the same shard,
# and SGD's load_state_dict keeps such tensors, so two ranks would update one momentum
# buffer (what made the replicas of a first prototype of this test differ).
def _hook_objects():
    from test_ddp_checkpoint import START_ITER, _build

    model_a, opt = _make("adam")
    model_b, ddp, sgd = _build()
    hook = lbcomm.OneBitHookState(START_ITER, comm=lbcomm.CommConfig(block_size=256, exact_numel=0))
    model_c, ddp_c, sgd_c = _build()  # the same SGD model resumed through load_sharded
    hook_c = lbcomm.OneBitHookState(START_ITER, comm=lbcomm.CommConfig(block_size=256, exact_numel=0))
    return {"a": model_a, "opt": opt, "b": model_b, "ddp": ddp, "sgd": sgd, "hook": hook,
            "c": model_c, "ddp_c": ddp_c, "sgd_c": sgd_c, "hook_c": hook_c}


def _hook_steps(o, rank, first, n):
    from test_ddp_checkpoint import _train

    for t in range(first, first + n):
        o["opt"].zero_grad()
        _loss(o["a"], rank, t).backward()
        o["opt"].step()
    _train(o["ddp"], o["sgd"], rank, first, n)
    _train(o["ddp_c"], o["sgd_c"], rank, first, n)


def _dcp_items(o, step):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from lbcomm.integrations import RankLocal

    model_b, sgd = get_state_dict(o["ddp"], o["sgd"])  # DCP's helper: also a fresh SGD's (lazy) momentum
    return {"a": o["a"].state_dict(), "b": model_b, "sgd": sgd, "opt": RankLocal(o["opt"]),
            "hook": RankLocal(o["hook"]), "step": step}


def _errors(o):
    return {"opt": o["opt"].compression_state.state_dict(), "hook": o["hook"].state_dict(),
            "hook_c": o["hook_c"].state_dict()}


def _params(o):
    return {k: torch.cat([q.detach().reshape(-1) for q in o[k].parameters()]).clone() for k in ("a", "b", "c")}


def _save_both(o, ckpt, step):
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_items(o, step), checkpoint_id=os.path.join(ckpt, "dcp"))
    lbcomm.save_sharded(os.path.join(ckpt, "shards"), o["sgd_c"], o["c"], hook_state=o["hook_c"], extra=step)


def _hook_save_run(rank, p, ckpt):
    o = _hook_objects()
    o["ddp"].register_comm_hook(o["hook"], lbcomm.onebit_hook)
    o["ddp_c"].register_comm_hook(o["hook_c"], lbcomm.onebit_hook)
    _hook_steps(o, rank, 0, SAVE_AT)
    _save_both(o, ckpt, SAVE_AT)
    saved = _errors(o)
    _hook_steps(o, rank, SAVE_AT, 2)
    expected = _params(o)["c"]
    same = _hook_resume_run(rank, p, ckpt, None)  # fresh DDP models in this process, the same world size
    return {"saved": saved, "same": same, "expected": expected}


def _hook_resume_run(rank, p, ckpt, save_to):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from lbcomm.integrations import LoadPlanner

    o = _hook_objects()
    items = _dcp_items(o, 0)
    dcp.load(items, checkpoint_id=os.path.join(ckpt, "dcp"), planner=LoadPlanner())
    set_state_dict(o["ddp"], o["sgd"], model_state_dict=items["b"], optim_state_dict=items["sgd"])
    info = lbcomm.load_sharded(os.path.join(ckpt, "shards"), o["sgd_c"], o["c"], hook_state=o["hook_c"])
    assert info["extra"] == items["step"]
    loaded = _errors(o)  # before the first backward: the hooks' units are not matched to buckets yet
    o["ddp"].register_comm_hook(o["hook"], lbcomm.onebit_hook)
    o["ddp_c"].register_comm_hook(o["hook_c"], lbcomm.onebit_hook)
    _hook_steps(o, rank, items["step"], 2)
    out = {"loaded": loaded, "params": _params(o), "exact": info["exact"],
           "iter": (o["hook"].iter, o["hook_c"].iter), "unmatched": o["hook_c"].planner.num_saved()}
    if save_to is not None:
        _save_both(o, save_to, items["step"] + 2)
        out["saved"] = _errors(o)
    return out


def _check_totals(before, after):
    """The total carried error of the optimizer and of every unit of both hooks, saved
    states `before` (one per old rank) against loaded states `after` (one per new rank)."""
    new = len(after)
    pairs = [([s["opt"] for s in before], [s["opt"] for s in after])]
    for which in ("hook", "hook_c"):
        units = [{tuple(e["params"]): e["compression"] for e in s[which]["units"]} for s in before + after]
        assert units[0] and all(set(u) == set(units[0]) for u in units)
        pairs += [([u[k] for u in units[:len(before)]], [u[k] for u in units[len(before):]]) for k in units[0]]
        # the normalization weights (the same on every rank) move with the units unchanged
        weights = [{tuple(e["params"]): e["weights"] for e in s[which]["units"]} for s in before + after]
        for k in units[0]:
            assert weights[0][k] is not None and all(torch.equal(w[k], weights[0][k]) for w in weights), k
    for old, cur in pairs:
        assert [s["world_size"] for s in cur] == [new] * new and [s["rank"] for s in cur] == list(range(new))
        assert _total(old).abs().sum() > 0
        # the mean of the worker errors is rounded to fp32 once: absolute rounding on the scale of the summands
        scale = max(float(s["worker_error"].abs().max()) for s in old + cur)
        torch.testing.assert_close(_total(cur), _total(old), rtol=1e-6, atol=1e-6 * max(scale, 0.1))


def test_hook_and_dcp_elastic_resume_4_to_2_to_4(tmp_path):
    w4, w2 = str(tmp_path / "w4"), str(tmp_path / "w2")
    first = run_ranks(_hook_save_run, 4, w4, timeout=300)
    for r, out in enumerate(first):  # the same world size: exact, also through load_sharded(hook_state=)
        assert out["same"]["exact"] and torch.equal(out["same"]["params"]["c"], out["expected"]), r
    at2 = run_ranks(_hook_resume_run, 2, w4, w2, timeout=300)
    _check_totals([r["saved"] for r in first], [r["loaded"] for r in at2])
    at4 = run_ranks(_hook_resume_run, 4, w2, None, timeout=300)
    _check_totals([r["saved"] for r in at2], [r["loaded"] for r in at4])
    for res in (at2, at4):
        for r, out in enumerate(res):
            assert not out["exact"] and out["unmatched"] == 0
            for k in ("a", "b", "c"):  # the replicas went on as one model
                assert torch.isfinite(out["params"][k]).all() and torch.equal(out["params"][k], res[0]["params"][k])
            # DCP and load_sharded redistribute one way: the two SGD models stay equal
            assert torch.equal(out["params"]["b"], out["params"]["c"]), r
    assert [r["iter"] for r in at4] == [(SAVE_AT + 4, SAVE_AT + 4)] * 4
