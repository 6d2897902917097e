"""HSDP with 1 bit across nodes: FSDP2 shards inside a node, and the gradient shards are
averaged across nodes by the 1-bit error-feedback compressed allreduce (docs/topology.md).

Two ways, on the same sharding (``fully_shard(module, mesh=mesh["local"])``):

* `onebit_hsdp`: an all-reduce hook compresses each gradient shard across nodes; any optimizer.
* `onebit_optimizer`: a 1-bit optimizer (`OneBitAdam`, `OneBitLamb`; or `Lamb` at full
  precision) on the local shards owns the traffic across nodes: in the warmup it averages
  the gradient shards over the replicate group in full precision (what HSDP's all-reduce
  does), from the freeze on it compresses its sharded momentum across the replicate group
  with 1 bit and error feedback (one call for the whole shard per step). LAMB's norms of
  whole parameters come from a scalar allreduce over the shard group.

Layout: a 2-D DeviceMesh with a replicate dimension (the nodes, default "node") and a shard
dimension (the ranks of a node, default "local"). The model is sharded with FSDP2 over the
SHARD dimension only (``fully_shard(module, mesh=mesh["local"])``), so FSDP's own
collectives (all-gather of parameters, reduce-scatter of gradients) stay inside the node
in full precision. `onebit_hsdp` then sets an all-reduce hook on every FSDP module
(``FSDPModule.set_all_reduce_hook``): FSDP calls it with the reduce-scatter output of that
module's parameter group (this rank's gradient shard, the same shard on every node) and the
hook replaces it in place by its 1-bit compressed mean over the replicate group, one
`CompressionState` per FSDP parameter group; FSDP's post-division follows (the mean is
linear). FSDP's native HSDP (a 2-D mesh given to fully_shard) all-reduces across the
replicate dimension in full precision before any hook runs, so `onebit_hsdp` refuses
2-D-sharded modules. Replicas stay bitwise identical: the compressed call's result is
identical on the ranks of a replicate group.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .comm import get_transport, world_info
from .common import error_ratio, report_exact_share
from .compressed import CompressionState
from .config import CommConfig, resolve
from .ddp.normalize import GradientStats
from .ddp.resume import ResumeCheck
from .ddp.units import Unit
from .exact import ExactMean
from .reducer import make_reducer

__all__ = ["OneBitHSDPState", "onebit_hsdp", "onebit_optimizer"]

_log = logging.getLogger(__name__)


class OneBitHSDPState:
    """Error feedback of `onebit_hsdp`: one reducer (a `CompressionState` over the
    replicate group) per FSDP parameter group, made at its first compressed call, the call
    counts and statistics.

    Args:
        replicate_group (ProcessGroup): the ranks that hold the same shard, one per node
            (`onebit_hsdp` takes it from the mesh).
        start_iter (int, optional): hook calls of each parameter group averaged at full
            precision before compression starts (default: 0).
        normalize (str or None, optional): "warmup": each group compresses g / w and
            decodes times w, w the per-coordinate RMS of its averaged gradient shard over
            the full-precision start, floored at ``normalize_floor`` x the group's RMS
            (rounded to bfloat16), as `onebit_hook`'s normalize="warmup"; it needs a start
            (start_iter > 0: without one the shards are compressed unweighted, said at INFO).
            None: unweighted, as published (default: "warmup").
        normalize_floor (float, optional): the weights' floor relative to the group's RMS
            (default: 0.1).
        comm (CommConfig, optional): ``block_size``, ``nonfinite`` ("skip": the shard
            becomes NaN on every rank, as a plain allreduce would, so that a GradScaler
            skips the step, error feedback untouched; or "raise") and ``exact_numel`` (the
            shards of parameters of at most that many elements, whole parameters, are
            averaged exactly across the nodes beside the compressed call). The reduction
            runs over the replicate group: ``process_group`` must stay None and
            ``topology`` "auto" or "flat" (default: ``CommConfig()``).

    Checkpoints: `state_dict` / `load_state_dict` (one shard per rank, with every saved
    rank's for another number of nodes: ``all_ranks``), `compression_stats`, and
    `check_resume` as `OneBitHookState`'s.
    """

    __slots__ = ("replicate_group", "transport", "comm", "start_iter", "normalize", "normalize_floor", "states",
                 "calls", "bytes_sent", "skipped_calls", "layouts", "units", "grad_stats", "saved_weights", "resume",
                 "__weakref__")

    def __init__(self, replicate_group, start_iter: int = 0, *, normalize: Optional[str] = "warmup",
                 normalize_floor: float = 0.1, comm: Optional[CommConfig] = None):
        comm = resolve(comm, "OneBitHSDPState")
        if comm.process_group is not None:
            raise ValueError("OneBitHSDPState: the reduction runs over the mesh's replicate group; leave "
                             "comm.process_group=None (pass the mesh to onebit_hsdp)")
        if comm.topology not in ("auto", "flat"):
            raise ValueError("OneBitHSDPState: the replicate group (one rank per node) is the reduction; leave "
                             "comm.topology at 'auto' (or 'flat')")
        if comm.backend == "mpi":
            raise ValueError("OneBitHSDPState: FSDP2's hook runs on torch.distributed; use CommConfig(backend='torch') "
                             "or 'auto'")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"Invalid start_iter: {start_iter!r} (must be an int >= 0)")
        if normalize not in (None, "warmup"):
            raise ValueError(f"Invalid normalize: {normalize!r} (use 'warmup', or None for the published algorithm)")
        if isinstance(normalize_floor, bool) or not isinstance(normalize_floor, (int, float)) or \
                not 0 < normalize_floor < math.inf:
            raise ValueError(f"Invalid normalize_floor: {normalize_floor!r} (must be a number > 0)")
        if normalize == "warmup" and start_iter == 0:
            _log.info("onebit_hsdp: normalize='warmup' estimates its weights over the full-precision start, and "
                      "start_iter=0 has none: the gradient shards are compressed unweighted, as published (pass "
                      "start_iter > 0, e.g. a few hundred steps, for the weights)")
        self.replicate_group, self.comm, self.start_iter = replicate_group, comm, start_iter
        self.transport = get_transport(replicate_group, backend="torch")
        self.normalize, self.normalize_floor = normalize, float(normalize_floor)
        self.grad_stats = GradientStats()  # the start's sums of squares per group (its index in `layouts`)
        self.saved_weights: Dict[str, Tensor] = {}  # from a checkpoint, for the units made after it
        # per parameter group: (padded shard numel, whole parameter numel) of its parameters in
        # the reduce-scatter output's order (set by onebit_hsdp), and the Unit reducing it
        self.layouts: Dict[str, Tuple[List[int], List[int]]] = {}
        self.units: Dict[str, Unit] = {}
        self.states: Dict[str, CompressionState] = {}
        self.calls: Dict[str, int] = {}
        self.bytes_sent = 0
        self.skipped_calls = 0
        self.resume = ResumeCheck()

    def check_resume(self, optimizer) -> None:
        """Name the optimizer of the sharded parameters: at the first hook call, if it
        already holds state (restored from a checkpoint) while this state was not restored,
        a `lbcomm.ddp.MissingHookStateWarning` names the missing state."""
        self.resume.watch(optimizer)

    def compression_stats(self) -> Dict[str, Any]:
        """Totals since the start (carried over by checkpoints), plain numbers: ``calls``
        (hook calls of every group), ``compressed_calls``, ``skipped_calls`` (non-finite
        shards), ``bytes_sent`` (across the nodes, compressed calls and exact means; the
        full-precision start is not counted), ``error_norm`` (this rank's error feedback) and
        ``error_ratio`` (that norm over the root-sum-square of what each group's reducer last
        sent, its ``last_sent_norm``; 0.0 before the first compressed call)."""
        err = math.sqrt(sum(float(st.worker_error.double().square().sum()) +
                            float(st.server_error.double().square().sum()) for st in self.states.values()))
        sent = math.sqrt(sum(st.last_sent_norm ** 2 for st in self.states.values()))
        return {"calls": sum(self.calls.values()), "compressed_calls": sum(st.calls for st in self.states.values()),
                "skipped_calls": self.skipped_calls, "bytes_sent": self.bytes_sent, "error_norm": err,
                "error_ratio": error_ratio(err, sent)}

    def state_dict(self) -> Dict[str, Any]:
        """This rank's error feedback per parameter group (one shard per rank)."""
        weights = dict(self.saved_weights)
        weights.update({k: u.weights for k, u in self.units.items() if u.weights is not None})
        return {"calls": dict(self.calls), "states": {k: st.state_dict() for k, st in self.states.items()},
                "bytes_sent": self.bytes_sent, "skipped_calls": self.skipped_calls,
                "exact_numel": self.comm.exact_numel, "normalize": self.normalize,
                "stats": self.grad_stats.state_dict(), "weights": weights,
                "replicate": world_info(self.replicate_group)}

    def load_state_dict(self, sd: Dict[str, Any], *, all_ranks: Optional[Sequence[Dict[str, Any]]] = None) -> bool:
        """Restore a `state_dict` of this rank (before the next backward pass). Saved for
        another number of nodes, pass ``all_ranks`` (every saved rank's `state_dict`, in
        rank order): the error feedback of each parameter group is redistributed from the
        saved ranks that held this rank's shard with `CompressionState.redistribute` (its
        total is preserved); without it the errors are reset with a logged warning.
        Returns True when the error feedback carries into this run, False when reset."""
        self.calls = dict(sd["calls"])
        self.bytes_sent, self.skipped_calls = int(sd["bytes_sent"]), int(sd["skipped_calls"])
        if sd["exact_numel"] != self.comm.exact_numel:
            _log.warning("onebit_hsdp: the state was saved with exact_numel=%s and this OneBitHSDPState has %s; it "
                         "continues with %s as it was trained", sd["exact_numel"], self.comm.exact_numel,
                         sd["exact_numel"])
            self.comm = self.comm.replace(exact_numel=int(sd["exact_numel"]))
        if sd["normalize"] != self.normalize:
            _log.warning("onebit_hsdp: the state was saved with normalize=%r and this OneBitHSDPState has %r; it "
                         "continues with %r as it was trained", sd["normalize"], self.normalize, sd["normalize"])
            self.normalize = sd["normalize"]
        self.grad_stats.load_state_dict(sd["stats"])
        self.saved_weights = {k: w.clone() for k, w in sd["weights"].items()}
        self.units = {}
        states, replicate = sd["states"], world_info(self.replicate_group)
        carried = True
        if sd["replicate"][0] != replicate[0] and all_ranks is not None:
            states = _redistribute(all_ranks, replicate, world_info())
        elif sd["replicate"][0] != replicate[0]:
            _log.warning("onebit_hsdp: the state was saved by %s nodes and this run has %s; the error feedback is "
                         "reset to zero (load_state_dict(sd, all_ranks=[every saved rank's state_dict]) "
                         "redistributes it)", sd["replicate"][0], replicate[0])
            states, carried = {}, False
        for key, saved in states.items():
            st = self.states.get(key)
            if st is None:
                st = self.states[key] = _new_reducer(self, int(saved["numel"]), None)
            carried = st.load_state_dict(saved) and carried
        self.resume.loaded = True
        return carried


def _redistribute(all_ranks: Sequence[Dict[str, Any]], replicate: Tuple[int, int],
                  world: Tuple[int, int]) -> Dict[str, Dict[str, Any]]:
    """The reducers' state_dicts of this rank (`replicate`: its (size, rank) in the new
    replicate group; `world`: in the world) from every saved rank's
    `OneBitHSDPState.state_dict`: each group's error feedback of the saved ranks that held
    this rank's shard, through `CompressionState.redistribute`. The mesh is node-major, as
    ``init_device_mesh(device, (nodes, ranks_per_node))`` builds it: world rank = node x
    ranks_per_node + shard index; the number of ranks per node must stay the same (the
    shards keep their layout)."""
    size, rank = replicate
    world, me = world
    old_world, old_size = len(all_ranks), int(all_ranks[0]["replicate"][0])
    local = old_world // old_size
    if world // size != local:
        raise ValueError(f"OneBitHSDPState.load_state_dict: the checkpoint has {local} ranks per node and this run "
                         f"{world // size}; the gradient shards change with it: resume with {local} ranks per node")
    holders = [sd for r, sd in enumerate(all_ranks) if r % local == me % local]
    if [int(sd["replicate"][1]) for sd in holders] != list(range(old_size)):
        raise ValueError("OneBitHSDPState.load_state_dict: all_ranks must be every saved rank's state_dict, in rank "
                         "order, of a node-major mesh")
    out = {key: CompressionState.redistribute([sd["states"][key] for sd in holders], size, rank)
           for key in holders[0]["states"]}
    _log.info("onebit_hsdp: the error feedback of %s parameter group(s) saved by %s nodes was redistributed onto %s "
              "(its total is preserved)", len(out), old_size, size)
    return out


def _new_reducer(state: OneBitHSDPState, numel: int, device) -> CompressionState:
    """The one place that builds the hook's reducers: a flat compressed allreduce over the
    replicate group, on the state's transport."""
    return make_reducer(numel, state.comm, device=device, transport=state.transport)


def _hook(state: OneBitHSDPState, key: str, reduce_output: Tensor) -> None:
    """FSDP's all-reduce hook for parameter group `key`: in place, the mean of this shard
    over the replicate group (full precision for the first start_iter calls)."""
    calls = state.calls.get(key, 0)
    state.calls[key] = calls + 1
    state.resume.check("onebit_hsdp", "OneBitHSDPState", fresh=sum(state.calls.values()) == 1)
    if calls < state.start_iter:
        state.transport.all_reduce(reduce_output, "mean")
        if state.normalize == "warmup" and key in state.layouts:
            state.grad_stats.add(_stats_key(state, key), [reduce_output.numel()], reduce_output)
        return
    st = state.states.get(key)
    if st is None or st.numel != reduce_output.numel():
        st = state.states[key] = _new_reducer(state, reduce_output.numel(), reduce_output.device)
    unit = _unit(state, key, st, reduce_output)
    unit.reduce(reduce_output, None)  # the exact shards' mean beside the compressed call
    state.bytes_sent += unit.bytes_per_call()
    if unit.last_skipped:
        state.skipped_calls += 1
        reduce_output.fill_(float("nan"))
        _log.warning("onebit_hsdp: a gradient shard of %s held NaN or Inf on some rank; it is NaN on every rank and "
                     "the error feedback is unchanged", key)


def onebit_hsdp(model: torch.nn.Module, mesh, *, replicate_dim: str = "node", shard_dim: str = "local",
                state: Optional[OneBitHSDPState] = None, optimizer=None, **kwargs) -> OneBitHSDPState:
    """Set the 1-bit all-reduce hook on every FSDP module of `model` (already sharded with
    ``fully_shard(..., mesh=mesh[shard_dim])``); returns the state (error feedback).

    Args:
        model (nn.Module): the model, its FSDP modules sharded over `shard_dim` only.
        mesh (DeviceMesh): 2-D, dimensions (replicate_dim, shard_dim).
        state (OneBitHSDPState, optional): an existing state; else one is made with
            ``kwargs`` (start_iter, normalize, normalize_floor, comm) on
            ``mesh.get_group(replicate_dim)``.
        optimizer (optional): the optimizer of the sharded parameters: a resume that
            restores it but not the state is warned about (`OneBitHSDPState.check_resume`).

    Example::

        >>> mesh = init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("node", "local"))
        >>> for block in model.blocks:
        ...     fully_shard(block, mesh=mesh["local"])
        >>> fully_shard(model, mesh=mesh["local"])
        >>> hsdp = lbcomm.fsdp.onebit_hsdp(model, mesh)
    """
    from torch.distributed.fsdp import FSDPModule

    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh.ndim != 2 or replicate_dim not in names or shard_dim not in names:
        raise ValueError(f"onebit_hsdp: expected a 2-D DeviceMesh with dimensions ({replicate_dim!r}, {shard_dim!r}), "
                         f"got {mesh.ndim} dimension(s) named {names}")
    if state is None:
        state = OneBitHSDPState(mesh.get_group(replicate_dim), **kwargs)
    elif kwargs:
        raise ValueError(f"onebit_hsdp: pass either state= or settings, not both (got {sorted(kwargs)})")
    if optimizer is not None:
        state.check_resume(optimizer)
    found: List[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        for p in module.parameters():
            pm = getattr(p, "device_mesh", None)
            if pm is not None and pm.ndim != 1:
                raise ValueError(f"onebit_hsdp: module {name or '<root>'} is sharded on a {pm.ndim}-D mesh (FSDP's "
                                 "native HSDP all-reduces across nodes in full precision itself); shard it with "
                                 f"fully_shard(module, mesh=mesh[{shard_dim!r}]) and let onebit_hsdp reduce across "
                                 "nodes")
        layout = _group_layout(module, name or "<root>", state.comm.exact_numel)
        if layout is not None:
            state.layouts[name or "<root>"] = layout
        module.set_all_reduce_hook(functools.partial(_hook, state, name or "<root>"))
        found.append(name or "<root>")
    if not found:
        raise ValueError("onebit_hsdp: the model has no FSDP module; call fully_shard(module, mesh=mesh[shard_dim]) "
                         "first")
    _log.info("onebit_hsdp: 1-bit all-reduce hook on %s FSDP module(s) across %s ranks per shard", len(found),
              mesh.size(list(names).index(replicate_dim)))
    sizes = [(c, w) for chunks, whole in state.layouts.values() for c, w in zip(chunks, whole)]
    limit = state.comm.exact_numel
    report_exact_share(_log, "onebit_hsdp", "gradient shard", sum(c for c, w in sizes if 0 < w <= limit),
                       sum(c for c, _ in sizes), limit)
    return state


def _stats_key(state: OneBitHSDPState, key: str) -> tuple:
    """GradientStats' key of parameter group `key`: its index in `layouts` (ints, as saved)."""
    return (list(state.layouts).index(key),)


def _unit(state: OneBitHSDPState, key: str, st: CompressionState, out: Tensor) -> Unit:
    """The Unit reducing parameter group `key` (its exact shards from the group's layout)."""
    unit = state.units.get(key)
    if unit is not None and unit.compression is st:
        return unit
    chunks, whole = state.layouts.get(key, ([out.numel()], [out.numel()]))
    if sum(chunks) != out.numel():
        raise RuntimeError(f"onebit_hsdp: parameter group {key} reduced {out.numel()} gradient elements, its FSDP "
                           f"parameters' padded shards hold {sum(chunks)}; this torch's FSDP2 lays them out "
                           "differently than lbcomm expects: pass comm=lbcomm.CommConfig(exact_numel=0)")
    weights = state.saved_weights.pop(key, None)
    if weights is None and state.normalize == "warmup" and key in state.layouts:
        weights = state.grad_stats.weights(_stats_key(state, key), state.normalize_floor)
    if weights is not None and weights.numel() != out.numel():
        raise RuntimeError(f"onebit_hsdp: the weights of parameter group {key} hold {weights.numel()} elements, its "
                           f"gradient shard {out.numel()}")
    unit = state.units[key] = Unit(key, [(c,) for c in chunks], st,
                                   None if weights is None else weights.to(out.device))
    unit.set_exact(state.comm.exact_numel, ExactMean(transport=state.transport), out.device, whole)
    return unit


def _group_layout(module, name: str, exact_numel: int) -> Optional[Tuple[List[int], List[int]]]:
    """(padded shard numel, whole numel) of the parameters of `module`'s FSDP parameter group,
    in the order FSDP2 concatenates their gradient shards; None without a group. Read from
    FSDP2's parameter group (not public API): refused clearly when it is not there."""
    try:
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            return None
        return ([fp.padded_sharded_param_size.numel() for fp in group.fsdp_params],
                [fp._orig_size.numel() for fp in group.fsdp_params])
    except AttributeError as exc:
        if not exact_numel:
            return None
        raise ValueError(f"onebit_hsdp: cannot read the parameter layout of FSDP module {name} from this torch "
                         f"({exc}); exact_numel needs it: pass comm=lbcomm.CommConfig(exact_numel=0)") from None


def _check_mesh(mesh, replicate_dim: str, shard_dim: str, who: str) -> None:
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh.ndim != 2 or replicate_dim not in names or shard_dim not in names:
        raise ValueError(f"{who}: expected a 2-D DeviceMesh with dimensions ({replicate_dim!r}, {shard_dim!r}), "
                         f"got {mesh.ndim} dimension(s) named {names}; build it with init_device_mesh(device, (nodes, "
                         f"ranks_per_node), mesh_dim_names=({replicate_dim!r}, {shard_dim!r}))")


def onebit_optimizer(model: torch.nn.Module, mesh, optimizer_class=None, *, replicate_dim: str = "node",
                     shard_dim: str = "local", params=None, **kwargs):
    """A 1-bit optimizer for a model sharded with FSDP2 inside each node: the warmup is
    HSDP (FSDP's reduce-scatter in the node, the optimizer's fp32 mean across nodes), the
    compression stage compresses the sharded momentum across the nodes.

    Args:
        model (nn.Module): the model, every parameter in an FSDP module sharded with
            ``fully_shard(module, mesh=mesh[shard_dim])`` (sharded inside the node only).
        mesh (DeviceMesh): 2-D, dimensions (replicate_dim, shard_dim), e.g.
            ``init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("node", "local"))``.
        optimizer_class (type, optional): `lbcomm.OneBitAdam` (default), `lbcomm.OneBitLamb`
            or `lbcomm.Lamb` (full precision throughout), or a subclass of them.
        replicate_dim, shard_dim (str, optional): the mesh's dimension names (default:
            "node", "local").
        params (iterable, optional): parameters or param groups (default: model.parameters()).
        **kwargs: the optimizer's options (lr, freeze_step, ..., comm); the comm settings
            process_group, shard_group, backend and topology are set here.

    Returns:
        The optimizer (process_group = the replicate group, shard_group = the shard group).

    Why the model is sharded on mesh[shard_dim] and not on the 2-D mesh (FSDP's native
    HSDP): native HSDP all-reduces every gradient shard across the nodes in fp32 itself, and
    switching that off (``set_requires_all_reduce(False)``) does not hand the optimizer the
    node's gradient: on torch 2.13 (checked on CPU/gloo) ``.grad`` stays None and FSDP keeps
    the reduce-scatter output in a private accumulation buffer. Sharding inside the node
    gives the optimizer exactly that reduce-scatter output (the node's mean of its shard), and
    the optimizer does the across-node step that HSDP would do: a full-precision mean in the
    warmup (the same arithmetic as HSDP's all-reduce), the compressed momentum after it.
    Checkpoints: the optimizer's state is per rank (`lbcomm.save_sharded`, or DCP with
    `lbcomm.integrations.dcp.RankLocal`).

    Example::

        >>> mesh = init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("node", "local"))
        >>> for block in model.blocks:
        ...     fully_shard(block, mesh=mesh["local"])
        >>> fully_shard(model, mesh=mesh["local"])
        >>> opt = lbcomm.fsdp.onebit_optimizer(model, mesh, lbcomm.OneBitAdam, lr=1e-3, freeze_step=1000)
    """
    from torch.distributed.fsdp import FSDPModule

    from .config import resolve
    from .optim import Lamb, OneBitAdam, OneBitLamb

    _check_mesh(mesh, replicate_dim, shard_dim, "onebit_optimizer")
    cls = OneBitAdam if optimizer_class is None else optimizer_class
    if not (isinstance(cls, type) and issubclass(cls, (OneBitAdam, OneBitLamb, Lamb))):
        raise TypeError(f"onebit_optimizer: optimizer_class must be lbcomm.OneBitAdam, lbcomm.OneBitLamb or "
                        f"lbcomm.Lamb (or a subclass), got {cls!r}")
    comm = resolve(kwargs.pop("comm", None), "onebit_optimizer")
    for name in ("process_group", "shard_group"):
        if getattr(comm, name) is not None:
            raise ValueError(f"onebit_optimizer: comm.{name} is set from the mesh (the replicate group is the "
                             f"topology's cross-node step); do not pass it")
    if comm.topology not in ("auto", "flat"):
        raise ValueError("onebit_optimizer: comm.topology is set from the mesh (the replicate group is the topology's "
                         "cross-node step); do not pass it")
    fsdp_modules = [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise ValueError(f"onebit_optimizer: the model has no FSDP module; call fully_shard(module, "
                         f"mesh=mesh[{shard_dim!r}]) on its blocks and on the model first")
    shard_mesh = mesh[shard_dim]
    for pname, p in model.named_parameters():
        pm = getattr(p, "device_mesh", None)
        if pm is None:
            raise ValueError(f"onebit_optimizer: parameter {pname} is not sharded by FSDP (not a DTensor); its "
                             "gradient would not be averaged inside the node. Wrap every module with parameters "
                             f"(at least the root: fully_shard(model, mesh=mesh[{shard_dim!r}]))")
        if pm.ndim != 1:
            raise ValueError(f"onebit_optimizer: parameter {pname} is sharded on a {pm.ndim}-D mesh (FSDP's native "
                             "HSDP, which all-reduces across nodes in fp32 itself; turning that off with "
                             "set_requires_all_reduce(False) leaves .grad empty on torch 2.13). Shard with "
                             f"fully_shard(module, mesh=mesh[{shard_dim!r}]) and let the optimizer reduce across nodes")
        if pm.mesh.tolist() != shard_mesh.mesh.tolist():
            raise ValueError(f"onebit_optimizer: parameter {pname} is sharded over ranks {pm.mesh.tolist()}, not over "
                             f"this rank's {shard_dim!r} dimension {shard_mesh.mesh.tolist()}")
    comm = comm.replace(process_group=mesh.get_group(replicate_dim), shard_group=mesh.get_group(shard_dim),
                        backend="torch", topology="flat")
    opt = cls(model.parameters() if params is None else params, comm=comm, **kwargs)
    _log.info("onebit_optimizer: %s on %s FSDP module(s), shards averaged across %s nodes", cls.__name__,
              len(fsdp_modules), mesh.size(list(mesh.mesh_dim_names).index(replicate_dim)))
    return opt
