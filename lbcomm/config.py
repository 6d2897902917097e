"""`CommConfig`: how lbcomm communicates, in one object with one set of defaults.

The optimizers (`OneBitAdam`, `OneBitLamb`, `ZeroOneAdam`, `Lamb`), the DDP hook state and
the FSDP2/HSDP hook state all take ``comm=CommConfig(...)``; their own constructors keep the
algorithm's hyperparameters only. Leaving `comm` out means ``CommConfig()``.

Example::

    >>> comm = lbcomm.CommConfig(block_size=4096, nonfinite="raise")
    >>> opt = lbcomm.OneBitLamb(model.parameters(), lr=1e-3, freeze_step=1000, comm=comm)
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from .common import NONFINITE_POLICIES
from .wire import check_block_size

__all__ = ["CommConfig", "DEFAULT_BLOCK_SIZE"]

# Elements per scale block: small enough that each block's scale follows the local magnitude
# of the input, large enough that the scales cost little (one fp32 per 2048 sign bits, 1.6 %).
DEFAULT_BLOCK_SIZE = 2048
_BACKENDS = ("auto", "torch", "mpi")


@dataclass(frozen=True)
class CommConfig:
    """Communication and robustness settings shared by every lbcomm compressor.

    Args:
        process_group: the torch.distributed group (or mpi4py communicator) the compressed
            reduction runs over (default: None, the world).
        backend (str): "torch", "mpi" or "auto" (torch.distributed when initialized, else
            MPI under an MPI launcher) (default: "auto").
        topology: "auto" (hierarchical when torchrun reports several nodes, i.e.
            LOCAL_WORLD_SIZE < WORLD_SIZE; flat otherwise), "flat", or a
            `lbcomm.topology.Topology` (full precision inside each node, 1-bit between
            nodes). A topology spans the whole world: leave `process_group` at None with it
            (default: "auto").
        block_size (int or None): elements per scale block of the 1-bit wire format, a
            multiple of 32; None: one scale per tensor, the published algorithm (default: 2048).
        exact_numel (int): tensors (parameters) of at most this many elements — biases,
            norms — are averaged exactly in fp32 beside the compressed call instead of
            being compressed; 0 compresses everything (default: 4096).
        nonfinite (str): what happens when a gradient holds NaN/Inf on any rank: "skip"
            the step or call on every rank with the error feedback untouched (what a
            GradScaler expects; counted and logged), or "raise" a `NonFiniteError` on every
            rank (default: "skip").
        bucket_cap_mb (float): the optimizers' full-precision warmup averages the flat
            gradient in buckets of this size, all in flight at once (default: 25).
        mask_threshold (float): 1-bit optimizers: coordinates whose frozen variance is at
            most this are held at zero momentum (they never had a gradient) (default: 1e-10).
        max_update (float, "auto", "warmup" or None): 1-bit optimizers: the bound of a
            compression-stage update per parameter tensor, relative to the warmup's (see
            docs/optimizers.md); None: unbounded (default: 1.0).
        capped_decode (bool or None): 1-bit optimizers: max_update also bounds the
            compressed allreduce of the momentum: each coordinate is decoded to at most the
            momentum whose step is the bound, and the error feedback keeps what that held
            back for later steps (instead of the step's clamp discarding it). Same bytes on
            the wire; needs block_size. None or True: on; False: off. Without blocks
            (block_size=None) the step's bound is the only one, logged as info with None
            and as a warning with True (default: None).
        detect_averaged_grads (bool): 1-bit optimizers: raise when their gradients arrive
            already averaged by a DDP without lbcomm's hook (two reductions) (default: True).
        shard_group: FSDP2: the group of the other shards of the same parameters (set by
            `lbcomm.fsdp.onebit_optimizer`; default: None, unsharded).
    """

    process_group: Any = None
    backend: str = "auto"
    topology: Any = "auto"
    block_size: Optional[int] = DEFAULT_BLOCK_SIZE
    exact_numel: int = 4096
    nonfinite: str = "skip"
    bucket_cap_mb: float = 25.0
    mask_threshold: float = 1e-10
    max_update: Union[float, str, None] = 1.0
    capped_decode: Optional[bool] = None
    detect_averaged_grads: bool = True
    shard_group: Any = None

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"Invalid backend: {self.backend!r} (use one of {_BACKENDS})")
        if not (self.topology in ("auto", "flat") or _is_topology(self.topology)):
            raise ValueError(f"Invalid topology: {self.topology!r} (use 'auto', 'flat' or a "
                             "lbcomm.topology.Topology)")
        if _is_topology(self.topology) and self.process_group is not None:
            raise ValueError("CommConfig: a Topology spans the whole world; leave process_group=None with it")
        check_block_size(self.block_size)
        if isinstance(self.exact_numel, bool) or not isinstance(self.exact_numel, int) or self.exact_numel < 0:
            raise ValueError(f"Invalid exact_numel: {self.exact_numel!r} (an int >= 0: tensors of at most this many "
                             "elements are averaged exactly; 0 compresses every tensor)")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid nonfinite policy: {self.nonfinite!r} (use one of {NONFINITE_POLICIES})")
        if not _positive(self.bucket_cap_mb):
            raise ValueError(f"Invalid bucket_cap_mb: {self.bucket_cap_mb!r} (must be a number > 0)")
        if not (_number(self.mask_threshold) and 0 <= self.mask_threshold < 1):
            raise ValueError(f"Invalid mask_threshold: {self.mask_threshold!r} (need 0 <= mask_threshold < 1)")
        mu = self.max_update
        if not (mu is None or mu in ("auto", "warmup") or _positive(mu)):
            raise ValueError(f"Invalid max_update: {mu!r} (a number > 0, 'auto', 'warmup' or None)")
        if self.capped_decode is not None and not isinstance(self.capped_decode, bool):
            raise ValueError(f"Invalid capped_decode: {self.capped_decode!r} (True, False or None)")
        if not isinstance(self.detect_averaged_grads, bool):
            raise ValueError(f"Invalid detect_averaged_grads: {self.detect_averaged_grads!r} (must be a bool)")

    def replace(self, **changes) -> "CommConfig":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def resolve(comm: Optional[CommConfig], who: str) -> CommConfig:
    """`comm`, or the defaults for None; a TypeError naming `who` for anything else."""
    if comm is None:
        return CommConfig()
    if not isinstance(comm, CommConfig):
        raise TypeError(f"{who}: comm must be a lbcomm.CommConfig, got {type(comm).__name__}")
    return comm


def from_comm(comm: Optional[CommConfig], who: str, **given) -> Dict[str, Any]:
    """The communication settings of an object that takes either `comm` or the 0.2 keyword
    arguments `given` ({name: (value, default)}; names as in CommConfig): with `comm`, its
    values, and a TypeError naming `who` when a keyword argument was given too; without it,
    the arguments."""
    if comm is None:
        return {k: v for k, (v, _) in given.items()}
    comm = resolve(comm, who)
    both = [k for k, (v, default) in given.items() if v is not default and v != default]
    if both:
        raise TypeError(f"{who}: pass {', '.join(both)} in comm (a CommConfig), not beside it")
    return {k: getattr(comm, k) for k in given}


def _number(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _positive(x) -> bool:
    return _number(x) and x > 0


def _is_topology(x) -> bool:
    from .nodes import Topology  # nodes imports the transports, which this module does not need

    return isinstance(x, Topology)
