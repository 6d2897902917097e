"""The README's framework recipes are the files in tests/integrations_recipes/, verbatim.

The Trainer and Lightning recipes run here as a user runs them (torchrun, 2 gloo ranks);
the torchrun + DDP, DCP and Accelerate recipes run (with a resume) in
test_integrations_dcp.py and test_integrations_accelerate.py. Deeper checks of the
Trainer and Lightning callbacks (wire bytes, local gradients, bitwise resume) are in
test_integrations_transformers.py and test_integrations_lightning.py."""
import os
import re

import pytest

from integrations_util import RECIPES, REPO, torchrun

NAMES = ["trainer", "accelerate", "lightning", "torchrun_ddp", "dcp"]


def _readme_blocks():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    return dict(re.findall(r"<!-- recipe: (\w+) -->\n```python\n(.*?)```\n<!-- /recipe -->", text, flags=re.S))


@pytest.mark.parametrize("name", NAMES)
def test_readme_holds_the_tested_recipe(name):
    with open(os.path.join(RECIPES, f"recipe_{name}.py")) as f:
        assert _readme_blocks().get(name) == f.read(), (
            f"README.md's recipe {name!r} differs from tests/integrations_recipes/recipe_{name}.py; "
            "regenerate the README section from the recipe files")


@pytest.mark.parametrize("name,package", [("trainer", "transformers"), ("lightning", "lightning")])
def test_recipe_runs(name, package, tmp_path):
    pytest.importorskip(package)
    out = torchrun(os.path.join(RECIPES, f"recipe_{name}.py"), tmp_path)
    sent = re.findall(r"rank (\d): compression stage sends (\d+) bytes per step, (\d+) bytes of fp32", out)
    assert sorted(r for r, _, _ in sent) == ["0", "1"], out
    for _, onebit, fp32 in sent:  # the compressed call and the exact small parameters (exact_numel)
        assert 0 < int(onebit) * 4 < int(fp32)
    assert "that is most of this model" not in out  # the recipe's model is compressed, not averaged exactly
