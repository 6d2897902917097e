"""The pieces onebit_hook and dct_hook share around their bucket worker (lbcomm.ddp.worker)."""
import math
from types import SimpleNamespace

import pytest
import torch

from lbcomm.ddp.worker import ensure_idle, units_error_norm


class _Busy:
    def __init__(self, n):
        self.n = n

    def busy(self):
        return self.n


def test_ensure_idle_refuses_while_buckets_are_in_flight():
    ensure_idle(None, "OneBitHookState.state_dict")  # no worker yet: nothing in flight
    ensure_idle(_Busy(0), "OneBitHookState.state_dict")
    with pytest.raises(RuntimeError, match=r"DCTHookState\.load_state_dict: 2 bucket\(s\) are still being reduced"):
        ensure_idle(_Busy(2), "DCTHookState.load_state_dict")


def test_units_error_norm_with_and_without_server_errors():
    def unit(w, s):
        return SimpleNamespace(compression=SimpleNamespace(worker_error=torch.tensor(w), server_error=torch.tensor(s)))

    units = [unit([3.0, 0.0], [1.0]), unit([0.0, 4.0], [2.0])]
    assert units_error_norm(units, server=False) == 5.0
    assert units_error_norm(units) == pytest.approx(math.sqrt(25.0 + 5.0), rel=0, abs=1e-12)
    assert units_error_norm([]) == 0.0
