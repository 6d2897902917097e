"""The 0.2 path of the `Reducer` protocol and its factory. The code lives in
`lbcomm.reduce.reducer`; this module re-exports it."""
from .reduce.reducer import STATS_KEYS, Reducer, compressor_stats, make_reducer, redistribute, resolve_topology

__all__ = ["Reducer", "make_reducer", "resolve_topology", "redistribute", "compressor_stats", "STATS_KEYS"]
