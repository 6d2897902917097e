"""OneBitHookState checkpoints written by an earlier lbcomm still load and continue bitwise.

tests/data/ddp_hook_state_v1/ holds, per rank r (rank{r}.pt) of a 2-rank gloo run, what
``tests/data/make_ddp_hook_state.py`` saved with the code of commit 80a1b96 (before the
hooks became a package): the model, the SGD optimizer and the `OneBitHookState` (its
`state_dict` and the pickled object) after `CUT` iterations, and the parameters after
`MORE` further iterations of that same run (expected{r}.pt). The test resumes from the files with today's
code and must reach exactly those parameters.
"""
import copy
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

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
def _total(states):
    """mean_r(worker error r) + concat_k(server error k) of one unit, over its real elements (float64)."""
    n = states[0]["numel"]
    worker = torch.stack([s["worker_error"].reshape(-1)[:n].double() for s in states]).mean(0)
    server = torch.cat([s["server_error"].reshape(-1) for s in states])[:n].double()
    return worker + server


def _save_and_continue(rank, p):
    model, ddp, opt = _build()
    hook = OneBitHookState(None, start_iter=START_ITER, block_size=256)
    ddp.register_comm_hook(hook, onebit_hook)
    _train(ddp, opt, rank, 0, CUT)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "hook": hook.state_dict()})
    _train(ddp, opt, rank, CUT, MORE)
    return {"saved": saved, "expected": _flat(model)}


def _elastic_resume(rank, p, saved):
    model, ddp, opt = _build(saved[rank % len(saved)])
    hook = OneBitHookState(None, start_iter=START_ITER, block_size=256)
    hook.load_state_dict(saved[rank % len(saved)]["hook"], all_ranks=[s["hook"] for s in saved])
    loaded = copy.deepcopy(hook.state_dict())  # the redistributed units, not yet matched to buckets
    ddp.register_comm_hook(hook, onebit_hook)
    _train(ddp, opt, rank, CUT, MORE)
    return {"loaded": loaded, "params": _flat(model), "iter": hook.iter, "unmatched": hook.planner.num_saved(),
            "error_norm": hook.error_norm()}


def test_hook_elastic_resume_preserves_total_error():
    first = run_ranks(_save_and_continue, P, timeout=180)
    saved = [r["saved"] for r in first]
    saved_units = [{tuple(e["params"]): e["compression"] for e in s["hook"]["units"]} for s in saved]
    assert saved_units[0] and all(float(c["worker_error"].abs().sum()) > 0 for c in saved_units[0].values())

    # the same world size with all_ranks given: the continuation stays bitwise exact
    same = run_ranks(_elastic_resume, P, saved, timeout=180)
    for r, out in enumerate(same):
        assert torch.equal(out["params"], first[r]["expected"]), f"rank {r}: same-world resume differs"

    # 2 -> 3 ranks: every unit's total carried error is preserved
    new_world = 3
    resumed = run_ranks(_elastic_resume, new_world, saved, timeout=240)
    for key, comp in saved_units[0].items():
        new = []
        for r, out in enumerate(resumed):
            entry = {tuple(e["params"]): e["compression"] for e in out["loaded"]["units"]}[key]
            assert (entry["world_size"], entry["rank"]) == (new_world, r)
            new.append(entry)
        before = _total([units[key] for units in saved_units])
        after = _total(new)
        assert before.abs().max() > 0
        torch.testing.assert_close(after, before, rtol=0, atol=1e-6 * float(before.abs().max()) + 1e-12)
    for out in resumed:  # training continued on the redistributed units
        assert out["iter"] == CUT + MORE and out["unmatched"] == 0
        assert torch.isfinite(out["params"]).all() and out["error_norm"] > 0
