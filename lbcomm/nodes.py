"""The 0.2 path of `Topology` (which ranks share a node). The code lives in
`lbcomm.reduce.topology`; this module re-exports it."""
from .reduce.topology import INTRA_NODE, Topology, slice_spans

__all__ = ["Topology", "slice_spans", "INTRA_NODE"]
