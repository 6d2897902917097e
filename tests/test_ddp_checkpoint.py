"""OneBitHookState checkpoints of format version 1, frozen in files, load and continue bitwise.

tests/data/ddp_hook_state_v1/ holds, per rank r (rank{r}.pt) of a 2-rank gloo run, what
``tests/data/make_ddp_hook_state.py`` saved: the model, the SGD optimizer and the
`OneBitHookState` (its `state_dict` and the pickled object) after `CUT` iterations, and the
parameters after `MORE` further iterations of that same run (expected{r}.pt). The test
resumes from the files with today's code and must reach exactly those parameters: a change
of the checkpoint format or of the numbers shows here.
"""
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_util import run_ranks
from lbcomm.config import CommConfig
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
    hook = OneBitHookState(START_ITER, comm=CommConfig(block_size=256, exact_numel=0))
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
        hook = OneBitHookState(START_ITER, comm=CommConfig(block_size=256, exact_numel=0))
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

