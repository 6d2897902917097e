"""The 0.2 path of one flat compressed call. The code lives in `lbcomm.reduce.flatcall`
(`FlatCall`) and `lbcomm.reduce.inputs` (the argument types and checks); this module
re-exports them."""
from .reduce.flatcall import FlatCall
from .reduce.inputs import Cap, ComputedCaps, Sink, Source, check_cap, check_tensor, check_weights

__all__ = ["FlatCall", "check_tensor", "check_weights", "check_cap", "ComputedCaps", "Source", "Sink", "Cap"]
