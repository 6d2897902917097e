"""The reduction engine: the 1-bit compressed allreduce with two-stage error feedback, flat
and hierarchical, and the `Reducer` protocol the optimizers and hooks use.

Modules, from the bottom up (each imports only those above it, and `lbcomm.common`,
`lbcomm.config`, `lbcomm.comm` and `lbcomm.ops`):

* `wire`: the padded layout, the piece plan and the wire rows' format (headers, agreement);
* `inputs`: the source, sink and cap types of a call and their checks (`ComputedCaps`);
* `buffers`: `FlatBuffers`, the wire rows and staging of one flat state (its buffer API);
* `flatcall`: `FlatCall`, one flat call: validation, collective schedule and phases;
* `compression`: `CompressionState`, the flat error-feedback state and its checkpoints;
* `compressed`: the flat entry points `reduce_`, `compressed_allreduce_`, `compressed_allreduce`;
* `topology`: `Topology`, which ranks share a node, and `slice_spans`;
* `hiercall`: the hierarchical call's schedule (`steps`);
* `hierarchical`: `HierarchicalState`, `hierarchical_allreduce_`, `hierarchical_mean_`;
* `exact`: the few tensors averaged exactly beside a compressed call (`ExactMean`);
* `reducer`: the `Reducer` protocol, `make_reducer`, `resolve_topology`, `redistribute`.

The names below are importable from this package too (loaded on first use, so that
importing one module of the engine does not import all of it). The 0.2 paths
(`lbcomm.compressed`, `lbcomm.flatcall`, `lbcomm.topology`, `lbcomm.nodes`, `lbcomm.wire`,
`lbcomm.exact`, `lbcomm.reducer`, `lbcomm.hiercall`) re-export these modules.
"""
from __future__ import annotations

import importlib
from typing import Any, List

_EXPORTS = {
    "CompressionState": "compression",
    "reduce_": "compressed",
    "compressed_allreduce_": "compressed",
    "compressed_allreduce": "compressed",
    "FlatCall": "flatcall",
    "FlatBuffers": "buffers",
    "ComputedCaps": "inputs",
    "Topology": "topology",
    "HierarchicalState": "hierarchical",
    "hierarchical_allreduce_": "hierarchical",
    "hierarchical_mean_": "hierarchical",
    "ExactMean": "exact",
    "exact_index": "exact",
    "exact_members": "exact",
    "Reducer": "reducer",
    "make_reducer": "reducer",
    "resolve_topology": "reducer",
    "redistribute": "reducer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
