"""Deprecated: the names of the former lbcomm/bench/model.py, now in lbcomm.cli.model
(LoopTransport: lbcomm.comm.LoopTransport)."""
from ..cli.model import (PAYLOAD_FRACTION, compute_times, fp32_compute_s, onebit_compute_s, predict,
                         wire_bytes)
from ..comm import LoopTransport

__all__ = ["LoopTransport", "onebit_compute_s", "fp32_compute_s", "compute_times", "predict", "wire_bytes",
           "PAYLOAD_FRACTION"]
