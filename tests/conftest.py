import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # dist_util for the spawned ranks too


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _no_namespaces_left():
    """Whatever a failed or interrupted test left of an emulated cluster (its launcher is
    dead by now) is removed at the end of the session; live runs of others are kept."""
    yield
    from lbcomm.cli import netns

    if netns.available()[0]:
        for prefix in ("lbctest", netns.DEFAULT_PREFIX):
            netns.cleanup_stale(prefix)
