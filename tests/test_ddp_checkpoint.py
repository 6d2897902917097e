"""OneBitHookState checkpoints written by an earlier lbcomm still load and continue bitwise.

tests/data/ddp_hook_state_v1/ holds, per rank r (rank{r}.pt) of a 2-rank gloo run, what
``tests/data/make_ddp_hook_state.py`` saved with the code of commit 80a1b96 (before the
hooks became a package): the model, the SGD optimizer and the `OneBitHookState` (its
`state_dict` and the pickled object) after `CUT` iterations, and the parameters after
`MORE` further iterations of that same run (expected{r}.pt). The test resumes from the files with today's
code and must reach exactly those parameters.
"""
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from dist_util import run_ranks
from lbcomm.ddp import OneBitHookState, onebit_hook

P = 2
CUT, MORE = 6, 4
START_ITER = 3
BUCKET_MB = 0.01  # several DDP buckets, so the first resumed iteration splits its bucket into saved units
DATA = os.path.join(os.path.dirname(__file__), "data", "ddp_hook_state_v1")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def _train(ddp, opt, rank, first, steps):
    for s in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randn(32, 16, generator=g)
        y = torch.sin(x[:, :4])
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _build(state=None):
    model = _model()
    if state is not None:
        model.load_state_dict(state["model"])
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if state is not None:
        opt.load_state_dict(state["opt"])
    return model, ddp, opt


def generate(rank, p):
    """Run by make_ddp_hook_state.py with the code whose format is being frozen. The
    checkpoint is written at once (its tensors are the live ones, changed by later steps)."""
    model, ddp, opt = _build()
    hook = OneBitHookState(None, start_iter=START_ITER, block_size=256)
    ddp.register_comm_hook(hook, onebit_hook)
    _train(ddp, opt, rank, 0, CUT)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": hook.state_dict(), "pickled": hook},
               os.path.join(DATA, f"rank{rank}.pt"))
    _train(ddp, opt, rank, CUT, MORE)
    torch.save(_flat(model), os.path.join(DATA, f"expected{rank}.pt"))


def _resume(rank, p, how):
    saved = torch.load(os.path.join(DATA, f"rank{rank}.pt"), weights_only=False)
    model, ddp, opt = _build(saved)
    if how == "state_dict":
        hook = OneBitHookState(None, start_iter=START_ITER, block_size=256)
        hook.load_state_dict(saved["hook"])
    else:  # the pickled object itself (__setstate__)
        hook = saved["pickled"]
    ddp.register_comm_hook(hook, onebit_hook)
    _train(ddp, opt, rank, CUT, MORE)
    expected = torch.load(os.path.join(DATA, f"expected{rank}.pt"))
    return {"params": _flat(model), "expected": expected, "iter": hook.iter, "type": type(hook).__name__}


def _both(rank, p):
    return {how: _resume(rank, p, how) for how in ("state_dict", "pickle")}


def test_v1_hook_checkpoint_resumes_bitwise():
    results = run_ranks(_both, P, timeout=180)
    for r, res in enumerate(results):
        for how, out in res.items():
            assert out["type"] == "OneBitHookState" and out["iter"] == CUT + MORE, (how, out["iter"])
            assert torch.equal(out["params"], out["expected"]), f"rank {r}, {how}: resumed run differs"


# ---------------------------------------------------------------- elastic resume (another world size)
# Through the user path, lbcomm.save_sharded / load_sharded(hook_state=): every new rank reads
# every saved shard from disk. (Handing the saved tensors to the spawned ranks as arguments
# instead shares their memory between the ranks that load the same shard: SGD's
# load_state_dict keeps such tensors, so two ranks then update one momentum buffer and the
# replicas drift apart; that was a fault of the test harness, not of the redistribution.)
def _total(states):
    """mean_r(worker error r) + concat_k(server error k) of one unit, over its real elements (float64)."""
    n = states[0]["numel"]
    worker = torch.stack([s["worker_error"].reshape(-1)[:n].double() for s in states]).mean(0)
    server = torch.cat([s["server_error"].reshape(-1) for s in states])[:n].double()
    return worker + server


def _units(hook_sd):
    return {tuple(e["params"]): e["compression"] for e in hook_sd["units"]}


def _save_and_continue(rank, p, ckpt):
    model, ddp, opt = _build()
    hook = OneBitHookState(None, start_iter=START_ITER, block_size=256)
    ddp.register_comm_hook(hook, onebit_hook)
    _train(ddp, opt, rank, 0, CUT)
    lbcomm.save_sharded(ckpt, opt, model, hook_state=hook, extra={"step": CUT})
    _train(ddp, opt, rank, CUT, MORE)
    same = _elastic_resume(rank, p, ckpt)  # a new DDP model in this process, the same world size
    return {"expected": _flat(model), "same": same}


def _elastic_resume(rank, p, ckpt):
    model, ddp, opt = _build()
    hook = OneBitHookState(None, start_iter=START_ITER, block_size=256)
    info = lbcomm.load_sharded(ckpt, opt, model, hook_state=hook)
    loaded = hook.state_dict()  # the redistributed units, not yet matched to buckets
    ddp.register_comm_hook(hook, onebit_hook)
    _train(ddp, opt, rank, info["extra"]["step"], MORE)
    return {"exact": info["exact"], "loaded": loaded, "params": _flat(model), "iter": hook.iter,
            "unmatched": hook.planner.num_saved(), "error_norm": hook.error_norm()}


def test_hook_elastic_resume_preserves_total_error_and_replicas(tmp_path):
    ckpt = str(tmp_path)
    first = run_ranks(_save_and_continue, P, ckpt, timeout=180)
    saved = [_units(torch.load(lbcomm.shard_path(ckpt, r, P), weights_only=True)["hook_state"]) for r in range(P)]
    assert saved[0] and all(float(c["worker_error"].abs().sum()) > 0 for c in saved[0].values())
    for r, out in enumerate(first):  # the same world size: bitwise exact
        assert out["same"]["exact"] and torch.equal(out["same"]["params"], out["expected"]), f"rank {r} differs"

    new_world = 3
    resumed = run_ranks(_elastic_resume, new_world, ckpt, timeout=240)
    for key in saved[0]:
        new = [_units(out["loaded"])[key] for out in resumed]
        assert [(c["world_size"], c["rank"]) for c in new] == [(new_world, r) for r in range(new_world)]
        before, after = _total([units[key] for units in saved]), _total(new)
        assert before.abs().max() > 0
        torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-7)
    for r, out in enumerate(resumed):  # training went on as one model, on the redistributed units
        assert not out["exact"] and out["iter"] == CUT + MORE and out["unmatched"] == 0 and out["error_norm"] > 0
        assert torch.isfinite(out["params"]).all()
        assert torch.equal(out["params"], resumed[0]["params"]), f"rank {r}: replicas differ after the resume"
