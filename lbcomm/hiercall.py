"""The 0.2 path of the hierarchical call's schedule. The code lives in
`lbcomm.reduce.hiercall`; this module re-exports it."""
from .reduce.hiercall import FLAG_BYTES, steps

__all__ = ["steps", "FLAG_BYTES"]
