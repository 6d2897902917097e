"""lbcomm.OneBitLocalUpdates (local updates with 1-bit compressed outer pseudo-gradients):
real gloo ranks against the pure-torch reference (lbcomm.testing.local) bit for
bit — flat on 2 and 4 ranks, hierarchical on 2 nodes x 2 ranks, compress=False (fp32
DiLoCo), fragments — replicas identical after every sync, exact and elastic resume, the
DDP refusal, non-finite pseudo-gradients, and bad input."""
import contextlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from dist_util import run_ranks, same
from lbcomm.common import STATS_KEYS, NonFiniteError
from lbcomm.errors import AveragedGradientsError
from lbcomm.integrations.dcp import LoadPlanner, RankLocal
from lbcomm.local import fragment_bounds
from lbcomm.testing.local import simulate_local_updates
from lbcomm.topology import Topology

H = 3
STEPS = 10  # 3 full rounds and one inner step of the next
EXACT = 64  # the biases are averaged exactly, the weights compressed
RUNS = {  # name -> OneBitLocalUpdates keywords
    "onebit": {},
    "fp32": {"compress": False},
    "frag": {"fragments": 2},
    "overlap": {"overlap": 1},  # each sync applied one inner step after it starts
    "frag_overlap": {"fragments": 2, "overlap": 1},
    "plain_sgd": {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False, "block_size": None},
}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))


def _batch(rank, t):
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _inner_step(model, inner, rank, t):
    inner.zero_grad()
    x, y = _batch(rank, t)
    torch.nn.functional.mse_loss(model(x), y).backward()
    inner.step()


def _make(kw, topology="flat", **comm):
    model = _mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw = dict(kw)
    block = kw.pop("block_size", 2048)
    cfg = lbcomm.CommConfig(exact_numel=EXACT, topology=topology, block_size=block, **comm)
    return model, inner, lbcomm.OneBitLocalUpdates(model.parameters(), inner, H, comm=cfg, **kw)


def _train(model, inner, local, rank, t0, t1):
    hist, synced = {}, []
    for t in range(t0, t1 + 1):
        _inner_step(model, inner, rank, t)
        if local.step():
            synced.append(t)
        hist[t] = [p.detach().clone() for p in model.parameters()]
    return hist, synced


def _reference(p, steps, kw, nodes=None):
    """The reference's run: per rank its own model and AdamW (the same inner steps)."""
    models = [_mlp() for _ in range(p)]
    inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]

    def local_step(r, t, params):
        with torch.no_grad():
            for q, x in zip(models[r].parameters(), params):
                q.copy_(x)
        _inner_step(models[r], inners[r], r, t)
        with torch.no_grad():
            for q, x in zip(models[r].parameters(), params):
                x.copy_(q)

    kw = dict(kw)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        return simulate_local_updates(list(_mlp().parameters()), local_step, world_size=p, steps=steps,
                                      sync_every=H, exact_numel=EXACT, nodes=nodes,
                                      block_size=kw.pop("block_size", 2048), **kw)
    finally:
        torch.set_num_threads(threads)


def _explicit_topology(rank, p, G=2):
    local_group = cross_group = None
    for a in range(p // G):
        g = dist.new_group(list(range(a * G, (a + 1) * G)))
        if a == rank // G:
            local_group = g
    for l in range(G):
        g = dist.new_group(list(range(l, p, G)))
        if l == rank % G:
            cross_group = g
    return Topology(local_group, cross_group, intra_node="group")


# ---------------------------------------------------------------------------- 2 ranks
def _two(rank, p):
    out = {"runs": {}}
    for name, kw in RUNS.items():
        model, inner, local = _make(kw)
        hist, synced = _train(model, inner, local, rank, 1, STEPS)
        out["runs"][name] = {"hist": hist, "synced": synced, "stats": local.compression_stats(),
                             "anchors": local.state_dict()["anchors"],
                             "bytes": local.bytes_per_sync(), "fp32": local.fp32_bytes_per_step()}
    # exact resume mid-round: 5 steps, state_dicts, fresh objects, 5 more (and through save_sharded)
    model, inner, local = _make({})
    _train(model, inner, local, rank, 1, 5)
    saved = {"model": model.state_dict(), "inner": inner.state_dict(), "local": local.state_dict()}
    model2, inner2, local2 = _make({})
    model2.load_state_dict(saved["model"])
    inner2.load_state_dict(saved["inner"])
    local2.load_state_dict(saved["local"])
    out["resumed"] = _train(model2, inner2, local2, rank, 6, STEPS)[0]
    out["resumed_state"] = local2.state_dict()
    # the same with a synchronization in flight at the checkpoint (overlap: started at step H)
    model, inner, local = _make(RUNS["overlap"])
    _train(model, inner, local, rank, 1, H)
    saved = {"model": model.state_dict(), "inner": inner.state_dict(), "local": local.state_dict()}
    model2, inner2, local2 = _make(RUNS["overlap"])
    model2.load_state_dict(saved["model"])
    inner2.load_state_dict(saved["inner"])
    local2.load_state_dict(saved["local"])
    out["in_flight"] = saved["local"]["in_flight"]
    out["resumed_overlap"] = _train(model2, inner2, local2, rank, H + 1, STEPS)[0]
    model3, inner3, local3 = _make({})
    _train(model3, inner3, local3, rank, 1, STEPS)
    out["straight_state"] = local3.state_dict()
    # DDP averaging every step: refused at the first inner step; opting out trains through
    for detect in (True, False):
        ddp = DDP(_mlp())
        inner = torch.optim.SGD(ddp.parameters(), lr=1e-2)
        local = lbcomm.OneBitLocalUpdates(ddp.parameters(), inner, H,
                                          comm=lbcomm.CommConfig(detect_averaged_grads=detect))
        try:
            _train(ddp, inner, local, rank, 1, 2)
            out[("ddp", detect)] = None
        except AveragedGradientsError as exc:
            out[("ddp", detect)] = (local.inner_steps, str(exc))
    # non-finite pseudo-gradient on rank 1 in round 2: skipped (or raised) on every rank
    for policy in ("skip", "raise"):
        model, inner, local = _make({}, nonfinite=policy)
        _train(model, inner, local, rank, 1, H)
        start = [p.detach().clone() for p in model.parameters()]  # round 2 starts here
        _train(model, inner, local, rank, H + 1, 2 * H - 1)
        if rank == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        try:
            _train(model, inner, local, rank, 2 * H, 2 * H)
            raised = None
        except NonFiniteError as exc:
            raised = str(exc)
        out[("nonfinite", policy)] = {"raised": raised, "back": all(torch.equal(a, b) for a, b in
                                                                      zip(start, model.parameters())),
                                      "stats": local.compression_stats()}
        if policy == "skip":  # and training goes on
            out["after_skip"] = _train(model, inner, local, rank, 2 * H + 1, 3 * H)[0][3 * H]
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two, 2, timeout=300)


@pytest.mark.parametrize("run", list(RUNS))
def test_two_ranks_match_the_reference_bitwise(two_ranks, run):
    ref = _reference(2, STEPS, RUNS[run])
    for t in range(1, STEPS + 1):
        for r in range(2):
            got = two_ranks[r]["runs"][run]["hist"][t]
            worst = max((a - b).abs().max().item() for a, b in zip(got, ref[t][r]))
            assert worst == 0.0, f"{run}: rank {r} step {t}: max |implementation - reference| = {worst}"
    synced = two_ranks[0]["runs"][run]["synced"]
    late = 1 if "overlap" in run else 0  # applied one step after the start
    assert synced == [t + late for t in ([2, 3, 5, 6, 8, 9] if "frag" in run else [3, 6, 9])]
    # every rank holds the same θ_start after every sync
    assert same(two_ranks[0]["runs"][run]["anchors"], two_ranks[1]["runs"][run]["anchors"])
    if "overlap" in run:  # the replicas keep their own step since the start: not identical
        assert not same(two_ranks[0]["runs"][run]["hist"][synced[0]], two_ranks[1]["runs"][run]["hist"][synced[0]])
    elif run != "frag":  # replicas identical after every sync, different in between
        for t in synced:
            assert same(two_ranks[0]["runs"][run]["hist"][t], two_ranks[1]["runs"][run]["hist"][t])
        assert not same(two_ranks[0]["runs"][run]["hist"][STEPS], two_ranks[1]["runs"][run]["hist"][STEPS])
    else:  # each fragment identical after its own sync
        b = fragment_bounds([p.numel() for p in _mlp().parameters()], 2)
        for t, f in ((2, 0), (3, 1)):
            h0, h1 = (two_ranks[r]["runs"][run]["hist"][t][b[f]:b[f + 1]] for r in range(2))
            assert same(h0, h1)


def test_compression_really_differs_from_fp32(two_ranks):
    a, b = (two_ranks[0]["runs"][k]["hist"][9] for k in ("onebit", "fp32"))
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) > 1e-6


def test_stats_and_bytes(two_ranks):
    for run, res in two_ranks[0]["runs"].items():
        st = res["stats"]
        assert set(STATS_KEYS) <= set(st) and st["inner_steps"] == STEPS
        assert st["syncs"] == len(res["synced"]) * (1 if run != "frag" else 1)
        assert st["bytes_sent"] == st["bytes_per_sync"] * 3 or "frag" in run
        assert st["skipped_calls"] == 0
        if run == "fp32":
            assert st["compressed_calls"] == 0 and st["error_norm"] == 0.0
            assert res["bytes"] == res["fp32"]  # one fp32 allreduce per H steps
        else:
            assert st["compressed_calls"] == st["syncs"] and st["error_norm"] > 0
            assert res["bytes"] < res["fp32"] / 10


def test_resume_is_bitwise(two_ranks):
    for r in range(2):
        assert same(two_ranks[r]["resumed"][STEPS], two_ranks[r]["runs"]["onebit"]["hist"][STEPS])
        assert same(two_ranks[r]["resumed_state"], two_ranks[r]["straight_state"])


def test_resume_with_a_synchronization_in_flight_is_bitwise(two_ranks):
    for r in range(2):
        fl = two_ranks[r]["in_flight"]
        assert fl[0] is not None and fl[0]["due"] == H + 1 and fl[0]["result"] is True
        for t in range(H + 1, STEPS + 1):
            assert same(two_ranks[r]["resumed_overlap"][t], two_ranks[r]["runs"]["overlap"]["hist"][t]), t


def test_ddp_averaging_every_step_is_refused(two_ranks):
    for r in range(2):
        step, msg = two_ranks[r][("ddp", True)]
        assert step == 1 and "DistributedDataParallel" in msg and "detect_averaged_grads=False" in msg
        assert two_ranks[r][("ddp", False)] is None


def test_nonfinite_pseudo_gradient_is_skipped_or_raised_on_every_rank(two_ranks):
    for r in range(2):
        skip, raised = two_ranks[r][("nonfinite", "skip")], two_ranks[r][("nonfinite", "raise")]
        assert skip["raised"] is None and skip["back"] and skip["stats"]["skipped_calls"] == 1
        assert raised["raised"] is not None and raised["back"] and raised["stats"]["skipped_calls"] == 1
        assert all(torch.isfinite(x).all() for x in two_ranks[r]["after_skip"])
    assert same(two_ranks[0]["after_skip"], two_ranks[1]["after_skip"])


# ---------------------------------------------------------------------------- 4 ranks
def _four(rank, p, ckpt):
    out = {}
    model, inner, local = _make({})
    out["flat"], _ = _train(model, inner, local, rank, 1, 2 * H)
    lbcomm.save_sharded(ckpt, inner, model, hook_state=local)  # at a sync: replicas identical
    dcp.save({"local": RankLocal(local)}, checkpoint_id=ckpt + "-dcp")
    out["saved"] = local.state_dict()
    topo = _explicit_topology(rank, p)
    model, inner, local = _make({}, topology=topo)
    out["hier"], _ = _train(model, inner, local, rank, 1, STEPS)
    out["hier_kind"] = type(local.fragments[0].reducer).__name__
    model, inner, local = _make(RUNS["overlap"], topology=topo)  # on the worker thread, on the node groups
    out["hier_overlap"], _ = _train(model, inner, local, rank, 1, STEPS)
    return out


def _elastic(rank, p, ckpt):
    model, inner, local = _make({})
    info = lbcomm.load_sharded(ckpt, inner, model, hook_state=local)
    loaded = local.state_dict()
    _, _, by_dcp = _make({})  # the same redistribution through torch.distributed.checkpoint
    dcp.load({"local": RankLocal(by_dcp)}, checkpoint_id=ckpt + "-dcp", planner=LoadPlanner())
    hist, _ = _train(model, inner, local, rank, 2 * H + 1, 4 * H)
    return {"info": info, "loaded": loaded, "dcp": by_dcp.state_dict(), "hist": hist}


@pytest.fixture(scope="module")
def four_ranks():
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        four = run_ranks(_four, 4, ckpt, timeout=300)
        elastic = run_ranks(_elastic, 2, ckpt, timeout=120)
    return four, elastic


def test_four_ranks_flat_and_hierarchical_match_the_reference_bitwise(four_ranks):
    four, _ = four_ranks
    assert four[0]["hier_kind"] == "HierarchicalState"
    for key, nodes, steps in (("flat", None, 2 * H), ("hier", 2, STEPS), ("hier_overlap", 2, STEPS)):
        ref = _reference(4, steps, RUNS["overlap"] if key == "hier_overlap" else {}, nodes=nodes)
        for t in range(1, steps + 1):
            for r in range(4):
                worst = max((a - b).abs().max().item() for a, b in zip(four[r][key][t], ref[t][r]))
                assert worst == 0.0, f"{key}: rank {r} step {t}: max |implementation - reference| = {worst}"
        for t in (H, 2 * H):
            if key != "hier_overlap":  # with overlap the replicas keep their own last step
                assert all(same(four[r][key][t], four[0][key][t]) for r in range(4))


def test_elastic_resume_4_to_2(four_ranks):
    four, two = four_ranks
    saved = [four[r]["saved"] for r in range(4)]
    for r in range(2):
        info, loaded = two[r]["info"], two[r]["loaded"]
        assert info["saved_world_size"] == 4 and not info["exact"]
        assert loaded["world_size"] == 2 and loaded["inner_steps"] == 2 * H
        assert same(loaded["anchors"], saved[0]["anchors"]) and same(loaded["outer"], saved[0]["outer"])
        assert same(two[r]["dcp"], loaded)  # RankLocal + LoadPlanner redistribute as load_sharded does
    # the total carried error (mean worker error + server errors) is preserved
    n = saved[0]["numels"][0]
    old = (torch.stack([s["reducers"][0]["worker_error"].reshape(-1)[:n].double() for s in saved]).mean(0)
           + torch.cat([s["reducers"][0]["server_error"].reshape(-1) for s in saved])[:n].double())
    new = (two[0]["loaded"]["reducers"][0]["worker_error"].reshape(-1)[:n].double()
           + torch.cat([two[r]["loaded"]["reducers"][0]["server_error"].reshape(-1) for r in range(2)])[:n].double())
    assert torch.allclose(old, new, atol=1e-6) and old.abs().sum() > 0
    for t in (3 * H, 4 * H):  # the 2-rank run goes on with identical replicas
        assert same(two[0]["hist"][t], two[1]["hist"][t])
        assert all(torch.isfinite(x).all() for x in two[0]["hist"][t])


# ---------------------------------------------------------------------------- one process
def test_one_rank_runs_the_outer_loop_without_communication():
    model, inner, local = _make({})
    hist, synced = _train(model, inner, local, 0, 1, 2 * H)
    ref = _reference(1, 2 * H, {})
    assert synced == [H, 2 * H] and same(hist[2 * H], ref[2 * H][0])
    assert local.bytes_per_sync() == 0 and local.compression_stats()["bytes_sent"] == 0


def test_bad_input_is_refused_clearly():
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    make = lbcomm.OneBitLocalUpdates
    with pytest.raises(ValueError, match="sync_every"):
        make(model.parameters(), inner, 0)
    with pytest.raises(ValueError, match="inner optimizer's parameters"):
        make(list(model.parameters())[:2], inner, 4)
    with pytest.raises(ValueError, match="inner optimizer's parameters"):
        make(list(_mlp().parameters()), inner, 4)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        make(model.parameters(), "adam", 4)
    with pytest.raises(ValueError, match="fragments"):
        make(model.parameters(), inner, 2, fragments=3)
    with pytest.raises(ValueError, match="fragments"):
        make(model.parameters(), inner, 8, fragments=5)  # more fragments than parameters
    with pytest.raises(ValueError, match="nesterov"):
        make(model.parameters(), inner, 4, outer_momentum=0.0, nesterov=True)
    plain = make(model.parameters(), inner, 4, outer_lr=1.0, outer_momentum=0.0)  # plain averaging: no Nesterov
    assert plain.outer.param_groups[0]["nesterov"] is False and plain.outer.param_groups[0]["momentum"] == 0.0
    with pytest.raises(ValueError, match="outer_lr"):
        make(model.parameters(), inner, 4, outer_lr=-1.0)
    for bad in (4, -1, 1.0, True):
        with pytest.raises(ValueError, match="overlap"):
            make(model.parameters(), inner, 4, overlap=bad)
    with pytest.raises(ValueError, match="overlap"):  # a checkpoint of another overlap
        make(model.parameters(), inner, 4, overlap=1).load_state_dict(make(model.parameters(), inner, 4).state_dict())
    with pytest.raises(TypeError, match="compress"):
        make(model.parameters(), inner, 4, compress=1)
    local = make(model.parameters(), inner, 4)
    with pytest.raises(ValueError, match="sync_every"):
        make(model.parameters(), inner, 5).load_state_dict(local.state_dict())
    with pytest.raises(ValueError, match="state_dict"):
        local.load_state_dict({"format": "something else"})


def test_fragment_bounds():
    assert fragment_bounds([10], 1) == [0, 1]
    assert fragment_bounds([5, 5, 5, 5], 2) == [0, 2, 4]
    assert fragment_bounds([100, 1, 1], 3) == [0, 1, 2, 3]
    assert fragment_bounds([1, 1, 100], 2) == [0, 2, 3]
    with contextlib.suppress(ValueError):
        fragment_bounds([1], 2)
        raise AssertionError("more fragments than parameters must raise")


def test_at_anchor_holds_theta_start_and_restores_the_weights():
    model, inner, local = _make({})
    start = [p.detach().clone() for p in model.parameters()]
    _train(model, inner, local, 0, 1, H - 1)  # mid-round: the weights moved, θ_start did not
    trained = [p.detach().clone() for p in model.parameters()]
    assert not same(trained, start)
    with local.at_anchor():
        assert same([p.detach().clone() for p in model.parameters()], start)
    assert same([p.detach().clone() for p in model.parameters()], trained)


def test_flush_applies_a_synchronization_in_flight():
    model, inner, local = _make({"overlap": 2})  # one rank: the mean is this rank's own
    _train(model, inner, local, 0, 1, H)  # started at step H, due at H + 2
    start = local.state_dict()["anchors"]
    assert local.fragments[0].due == H + 2 and local.flush() and local.fragments[0].due is None
    assert not same(local.state_dict()["anchors"], start) and not local.flush()
