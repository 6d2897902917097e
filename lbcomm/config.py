"""The settings objects: `CommConfig`, how lbcomm communicates, and `OneBitOptions`, the
1-bit optimizers' compression-stage math, each in one object with one set of defaults.

Everything that communicates takes ``comm=CommConfig(...)``: the optimizers, the DDP and
FSDP2/HSDP hook states, `CompressionState`, `WarmupAverage`, `save_sharded` /
`load_sharded`. The 1-bit optimizers (`OneBitAdam`, `OneBitLamb`, `ZeroOneAdam`) also take
``options=OneBitOptions(...)``; their own constructors keep the algorithm's
hyperparameters. Leaving either out means its defaults.

Example::

    >>> comm = lbcomm.CommConfig(block_size=4096, nonfinite="raise")
    >>> opt = lbcomm.OneBitLamb(model.parameters(), lr=1e-3, freeze_step=1000, comm=comm,
    ...                         options=lbcomm.OneBitOptions(max_update=None))
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

from .common import NONFINITE_POLICIES
from .wire import check_block_size

__all__ = ["CommConfig", "OneBitOptions", "DEFAULT_BLOCK_SIZE"]

# Elements per scale block: small enough that each block's scale follows the local magnitude
# of the input, large enough that the scales cost little (one fp32 per 2048 sign bits, 1.6 %).
DEFAULT_BLOCK_SIZE = 2048
_BACKENDS = ("auto", "torch", "mpi")


class _Unset:
    """The default of CommConfig's deprecated 1-bit fields: not given (None is a value)."""

    def __repr__(self) -> str:
        return "<unset>"

    def __reduce__(self):
        return "UNSET"


UNSET = _Unset()
# CommConfig fields of 0.2 that are OneBitOptions now (still accepted, with a FutureWarning)
MOVED_TO_OPTIONS = ("mask_threshold", "max_update", "capped_decode")


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
        mask_threshold, max_update, capped_decode: deprecated, `OneBitOptions` now (still
            accepted with a FutureWarning; an optimizer given them and ``options`` too
            raises a TypeError).
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
    detect_averaged_grads: bool = True
    shard_group: Any = None
    mask_threshold: Any = dataclasses.field(default=UNSET, repr=False)
    max_update: Any = dataclasses.field(default=UNSET, repr=False)
    capped_decode: Any = dataclasses.field(default=UNSET, repr=False)

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
        if not isinstance(self.detect_averaged_grads, bool):
            raise ValueError(f"Invalid detect_averaged_grads: {self.detect_averaged_grads!r} (must be a bool)")
        moved = self.moved_options()
        if moved:
            OneBitOptions(**moved)  # validated as the options they now are
            names = ", ".join(f"{k}={v!r}" for k, v in moved.items())
            warnings.warn(f"CommConfig({names}): these are the 1-bit optimizers' math, not communication; pass "
                          f"options=lbcomm.OneBitOptions({names}) to the optimizer instead", FutureWarning,
                          stacklevel=3)

    def moved_options(self) -> Dict[str, Any]:
        """The deprecated 1-bit fields given to this config ({} for a config of 0.3)."""
        return {k: getattr(self, k) for k in MOVED_TO_OPTIONS if getattr(self, k) is not UNSET}

    def replace(self, **changes) -> "CommConfig":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class OneBitOptions:
    """The compression stage's math of the 1-bit optimizers (`OneBitAdam`, `OneBitLamb`,
    `ZeroOneAdam`): what lbcomm adds to the published algorithms so that they converge
    like their full-precision twins at the twins' learning rates (docs/optimizers.md).
    Every default is what the convergence suite was measured with.

    Args:
        max_update (float, "auto", "warmup" or None): the bound of a compression-stage
            update per coordinate, |m^ / (sqrt(v^) + eps)| <= max_update (in units of lr);
            "auto": Adam's own bound for the betas; "warmup": each tensor's largest warmup
            update (OneBitAdam, OneBitLamb); None: unbounded, the published update
            (default: 1.0).
        capped_decode (bool or None): max_update also bounds the compressed allreduce of
            the momentum: each coordinate is decoded to at most the momentum whose step is
            the bound and the error feedback keeps what that held back (instead of the
            step's clamp discarding it). Same bytes on the wire; needs blocks. None or
            True: on; False: off. Without blocks (``CommConfig(block_size=None)``) the
            step's bound is the only one, logged as info with None and as a warning with
            True (default: None).
        mask_threshold (float): at the freeze, coordinates whose variance is at most this
            times the mean variance are held at zero momentum (they never had a gradient,
            or only rounding noise) (default: 1e-10).
        rescale_variance (bool): OneBitAdam and ZeroOneAdam: scale each tensor's frozen
            variance by the change of its ranks' mean squared local gradient norm since the
            freeze (one fp32 per tensor rides in each step's collective); OneBitLamb has its
            own scaling (``factor_range``) and rejects False (default: True).
        bias_correction (bool): divide m by 1-b1^t and v by 1-b2^t (default: True).
    """

    max_update: Union[float, str, None] = 1.0
    capped_decode: Optional[bool] = None
    mask_threshold: float = 1e-10
    rescale_variance: bool = True
    bias_correction: bool = True

    def __post_init__(self) -> None:
        if not (_number(self.mask_threshold) and 0 <= self.mask_threshold < 1):
            raise ValueError(f"Invalid mask_threshold: {self.mask_threshold!r} (need 0 <= mask_threshold < 1)")
        mu = self.max_update
        if not (mu is None or mu in ("auto", "warmup") or _positive(mu)):
            raise ValueError(f"Invalid max_update: {mu!r} (a number > 0, 'auto', 'warmup' or None)")
        if self.capped_decode is not None and not isinstance(self.capped_decode, bool):
            raise ValueError(f"Invalid capped_decode: {self.capped_decode!r} (True, False or None)")
        for name in ("rescale_variance", "bias_correction"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Invalid {name}: {getattr(self, name)!r} (must be True or False)")

    def replace(self, **changes) -> "OneBitOptions":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def resolve_options(options: Optional[OneBitOptions], comm: CommConfig,
                    who: str) -> Tuple[CommConfig, OneBitOptions]:
    """A 1-bit optimizer's (comm, options): `options` or the defaults, or, for a 0.2 call,
    the deprecated fields of `comm` as options (a TypeError naming `who` when both are
    given); the comm returned no longer carries them."""
    if options is not None and not isinstance(options, OneBitOptions):
        raise TypeError(f"{who}: options must be a lbcomm.OneBitOptions, got {type(options).__name__}")
    moved = comm.moved_options()
    if not moved:
        return comm, options if options is not None else OneBitOptions()
    if options is not None:
        raise TypeError(f"{who}: pass {', '.join(moved)} in options (a OneBitOptions), not in comm beside it")
    clean = dataclasses.replace(comm, **{k: UNSET for k in moved})
    return clean, OneBitOptions(**moved)


# CommConfig's communication fields (not its 0.2 fields that moved to OneBitOptions) and
# OneBitOptions' fields: the one place a flat settings dict is told apart
COMM_FIELDS = frozenset(f.name for f in dataclasses.fields(CommConfig)) - frozenset(MOVED_TO_OPTIONS)
OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(OneBitOptions))


def split_settings(flat: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]:
    """One flat dict of settings (a benchmark's or a test's option string) as (CommConfig
    fields, OneBitOptions fields, the rest): ``CommConfig(**c)``, ``OneBitOptions(**o)``
    and the optimizer's own keyword arguments."""
    comm = {k: v for k, v in flat.items() if k in COMM_FIELDS}
    options = {k: v for k, v in flat.items() if k in OPTION_FIELDS}
    rest = {k: v for k, v in flat.items() if k not in comm and k not in options}
    return comm, options, rest


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
