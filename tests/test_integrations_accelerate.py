"""The README recipe for Accelerate, run as a user runs it (torchrun, 2 gloo ranks):
attach() after accelerator.prepare, every rank's shard written by a save_state pre-hook,
loaded after load_state; the run resumed at the epoch-2 checkpoint (mid-compression) ends
bitwise where the uninterrupted run ends."""
import re

import pytest

pytest.importorskip("accelerate")

from integrations_util import assert_same_shards, run_recipe_and_resume  # noqa: E402


def test_accelerate_recipe_resumes_bitwise(tmp_path):
    full, resumed = run_recipe_and_resume("accelerate", tmp_path)
    assert sorted(p.name for p in (tmp_path / "epoch-2").iterdir() if p.name.startswith("shard-")) == [
        "shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]
    assert_same_shards(tmp_path / "final-0", tmp_path / "final-2")
    losses = lambda out: sorted(re.findall(r"rank (\d): loss (\S+),", out))  # noqa: E731
    assert losses(full) == losses(resumed) and len(losses(full)) == 2
