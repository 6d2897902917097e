"""The 0.2 path of the exactly averaged small tensors (``exact_numel``). The code lives in
`lbcomm.reduce.exact`; this module re-exports it."""
from .reduce.exact import ExactMean, exact_index, exact_members

__all__ = ["exact_members", "exact_index", "ExactMean"]
