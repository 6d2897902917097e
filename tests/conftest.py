import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # dist_util for the spawned ranks too


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
