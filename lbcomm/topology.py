"""The 0.2 path of the hierarchical compressed allreduce. The code lives in
`lbcomm.reduce.hierarchical` (`HierarchicalState`, `hierarchical_allreduce_`,
`hierarchical_mean_`) and `lbcomm.reduce.topology` (`Topology`); this module re-exports
them."""
from .reduce.hierarchical import HierarchicalState, hierarchical_allreduce_, hierarchical_mean_
from .reduce.topology import INTRA_NODE, Topology, slice_spans

__all__ = ["Topology", "HierarchicalState", "hierarchical_allreduce_", "hierarchical_mean_", "slice_spans",
           "INTRA_NODE"]
