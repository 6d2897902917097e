"""The README recipes for torchrun + DDP (OneBitHookState, lbcomm.save_sharded) and for
torch.distributed.checkpoint (OneBitAdam, lbcomm.integrations.RankLocal), run as a user
runs them: torchrun, 2 gloo ranks; a run resumed from the mid-compression checkpoint
(step 6, compression from step 5) ends bitwise where the uninterrupted run ends."""
import os
import re

import pytest

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


def test_rank_local_refuses_other_world_size(tmp_path):
    from lbcomm.integrations import RankLocal

    class Obj:
        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            raise AssertionError("must not be reached")

    with pytest.raises(KeyError, match="rank0-of-1.*ElasticLoadPlanner"):
        RankLocal(Obj()).load_state_dict({"rank0-of-2": b""})
    blob = RankLocal(Obj()).state_dict()["rank0-of-1"]
    with pytest.raises(KeyError, match="only lbcomm optimizers and OneBitHookState"):  # all ranks there, not lbcomm
        RankLocal(Obj()).load_state_dict({"rank0-of-2": blob, "rank1-of-2": blob})
    with pytest.raises(TypeError, match="state_dict"):
        RankLocal(object())
