"""The README recipes for torchrun + DDP (OneBitHookState, lbcomm.save_sharded) and for
torch.distributed.checkpoint (OneBitAdam, lbcomm.integrations.RankLocal), run as a user
runs them: torchrun, 2 gloo ranks; a run resumed from the mid-compression checkpoint
(step 6, compression from step 5) ends bitwise where the uninterrupted run ends. A resume
that leaves a compressor's state out is named, not silently continued (one process)."""
import os
import re

import pytest
import torch

from integrations_util import assert_same_shards, run_recipe_and_resume


@pytest.mark.parametrize("name", ["torchrun_ddp", "dcp"])
def test_recipe_resumes_bitwise(name, tmp_path):
    full, resumed = run_recipe_and_resume(name, tmp_path)
    assert_same_shards(tmp_path / "final-0", tmp_path / "final-6")
    if name == "dcp":  # DCP wrote one optimizer item per rank
        assert os.path.isfile(tmp_path / "step-6" / ".metadata")
        sent = set(re.findall(r"sends (\d+) bytes per step", full))
    else:
        sent = set(re.findall(r"ratio (\d+\.\d)x", full))
    assert len(sent) == 1, full  # both ranks report the same


@pytest.mark.filterwarnings("ignore:RankLocal.*was loaded without")  # called directly, without DCP's planner
def test_rank_local_refuses_other_world_size(tmp_path):
    from lbcomm.integrations import RankLocal

    class Obj:
        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            raise AssertionError("must not be reached")

    with pytest.raises(KeyError, match="rank0-of-1.*LoadPlanner"):
        RankLocal(Obj()).load_state_dict({"rank0-of-2": b""})
    blob = RankLocal(Obj()).state_dict()["rank0-of-1"]
    with pytest.raises(KeyError, match="only lbcomm optimizers and objects whose load_state_dict takes all_ranks="):
        RankLocal(Obj()).load_state_dict({"rank0-of-2": blob, "rank1-of-2": blob})  # all ranks there, no all_ranks=

    class Elastic(Obj):  # what the hook states and OneBitLocalUpdates offer: it gets every saved rank's state
        def load_state_dict(self, sd, *, all_ranks=None):
            self.got = (sd, all_ranks)

    e = Elastic()
    RankLocal(e).load_state_dict({"rank0-of-2": blob, "rank1-of-2": blob})
    assert e.got == ({}, [{}, {}])
    with pytest.raises(TypeError, match="state_dict"):
        RankLocal(object())


def _hook_run(steps, state=None):
    """A one-process model whose updates go through a compressor with error feedback (the
    stand-in for a hook state: its error feedback changes the next steps)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comp = _Compressor() if state is None else state
    for step in range(steps):
        model.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        for slot, p in enumerate(model.parameters()):
            p.grad = comp.compress(p.grad, slot)
        opt.step()
    return model, opt, comp


class _Compressor:
    """Sign compression with error feedback, per slot: what a hook state keeps per rank."""

    def __init__(self):
        self.errors = {}

    def compress(self, g, slot):
        e = self.errors.get(slot, torch.zeros_like(g))
        x = g + e
        out = x.sign() * x.abs().mean()
        self.errors[slot] = x - out
        return out

    def state_dict(self):
        return {"errors": dict(self.errors)}

    def load_state_dict(self, sd):
        self.errors = dict(sd["errors"])


def test_a_resume_without_the_compressor_state_is_named(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from lbcomm.integrations.dcp import LoadPlanner, MissingRankLocalError, RankLocal

    ckpt = str(tmp_path / "ckpt")
    model, opt, comp = _hook_run(3)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "hook": RankLocal(comp)}, checkpoint_id=ckpt)

    def fresh():
        model, opt, comp = _hook_run(0)
        return model, opt, comp, {"model": model.state_dict(), "optim": opt.state_dict()}

    # model and optimizer restored, the compressor's error feedback left out: named, with the fix
    model, opt, comp, state = fresh()
    with pytest.raises(CheckpointException) as raised:  # DCP reports the planner's error per rank
        dcp.load(state, checkpoint_id=ckpt, planner=LoadPlanner())
    (error, _), = raised.value.failures.values()
    assert isinstance(error, MissingRankLocalError)
    assert re.search(r"under 'hook' \(_Compressor\).*state\['hook'\] = RankLocal", str(error)), str(error)
    # allow_partial_load=True: the user says so; logged, not raised
    model, opt, comp, state = fresh()
    dcp.load(state, checkpoint_id=ckpt, planner=LoadPlanner(allow_partial_load=True))
    # with the compressor: restored exactly
    model, opt, comp, state = fresh()
    state["hook"] = RankLocal(comp)
    dcp.load(state, checkpoint_id=ckpt, planner=LoadPlanner())
    assert comp.errors.keys() == {0, 1} and all(torch.equal(comp.errors[k], _hook_run(3)[2].errors[k]) for k in (0, 1))
    # without the planner nothing can be checked: a RankLocal says so
    model, opt, comp, state = fresh()
    state["hook"] = RankLocal(comp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load(state, checkpoint_id=ckpt)
    assert any("without lbcomm.integrations.dcp.LoadPlanner" in str(w.message) for w in caught)
    assert all(torch.equal(comp.errors[k], _hook_run(3)[2].errors[k]) for k in (0, 1))
