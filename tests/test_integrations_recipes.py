"""The framework recipes of docs/integrations.md are the files in tests/integrations_recipes/,
included verbatim by mkdocs snippets (`--8<-- "tests/integrations_recipes/recipe_trainer.py"`).

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


INTEGRATIONS_PAGE = os.path.join(REPO, "docs", "integrations.md")


def _snippet_lines():
    """The files docs/integrations.md includes with a mkdocs snippet line `--8<-- "path"`."""
    with open(INTEGRATIONS_PAGE) as f:
        return set(re.findall(r'^\s*--8<--\s+"([^"]+)"\s*$', f.read(), flags=re.M))


@pytest.mark.parametrize("name", NAMES)
def test_docs_include_the_tested_recipe(name):
    if not os.path.exists(INTEGRATIONS_PAGE):
        pytest.skip("docs/integrations.md does not exist yet: nothing includes the recipes")
    path = f"tests/integrations_recipes/recipe_{name}.py"
    assert os.path.exists(os.path.join(REPO, path)), path
    assert path in _snippet_lines(), (
        f"docs/integrations.md does not include {path}: add a line `--8<-- \"{path}\"` inside "
        "a python code fence, so that the page shows the tested file verbatim")


@pytest.mark.parametrize("name,package", [("trainer", "transformers"), ("lightning", "lightning")])
def test_recipe_runs(name, package, tmp_path):
    pytest.importorskip(package)
    out = torchrun(os.path.join(RECIPES, f"recipe_{name}.py"), tmp_path)
    sent = re.findall(r"rank (\d): compression stage sends (\d+) bytes per step, (\d+) bytes of fp32", out)
    assert sorted(r for r, _, _ in sent) == ["0", "1"], out
    for _, onebit, fp32 in sent:  # the compressed call and the exact small parameters (exact_numel)
        assert 0 < int(onebit) * 4 < int(fp32)
    assert "that is most of this model" not in out  # the recipe's model is compressed, not averaged exactly
