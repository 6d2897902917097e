"""`OneBitHookState`: the settings, iteration count, error feedback (a `BucketPlanner` of
units) and statistics of `onebit_hook`, and their checkpoints."""
import logging
import math
from typing import Any, Dict, Optional, Sequence, Tuple

import torch.distributed as dist

from ..comm import world_info
from ..common import error_ratio
from ..compressed import CompressionState
from ..config import CommConfig, resolve
from ..reducer import resolve_topology
from ..topology import Topology
from .normalize import GradientStats
from .resume import ResumeCheck
from .units import BucketPlanner, redistribute_units
from .worker import BucketWorker, ensure_idle, units_error_norm

__all__ = ["OneBitHookState"]

_log = logging.getLogger(__name__)

_STATE_VERSION = 1


class OneBitHookState:
    r"""State of `onebit_hook`: 1-bit error-feedback compressed allreduce of DDP's gradient
    buckets, for any optimizer (SGD, AdamW, ...). Under SGD with momentum pass its momentum
    (``momentum=``, with ``normalize="adaptive"``): otherwise SGD's momentum sums the
    gradients' compression errors, so that each step's error reaches the parameters over
    many steps; compressing the momentum itself lets it enter once (see docs/hooks.md).

    Every bucket is reduced by a compressed allreduce (docs/concepts.md): about 1 bit per
    gradient element instead of 32, with the rounding error of every call fed back into the
    next one (per rank, per bucket), so that nothing is lost over time. Before
    ``start_iter`` the buckets are averaged at full precision.

    The compressed allreduces run on a background thread, one bucket after the other in
    bucket order (so every rank issues its collectives in the same order), on a private
    duplicate of the process group (so they never interleave with DDP's own collectives).
    The hook returns at once with a future: compression overlaps the rest of the backward
    pass, and nothing blocks or synchronizes a device inside a hook callback. Results are
    bitwise identical on every rank, so replicas stay identical.

    Checkpoints: `state_dict` holds this rank's error buffers (one shard per rank, like the
    lbcomm optimizers; ``lbcomm.save_sharded(dir, opt, model, hook_state=state)``) and
    `load_state_dict` restores them. They are stored per list of parameters rather than per
    bucket index, because a new DDP instance runs its first iteration with its initial
    buckets before it rebuilds them: in that iteration a bucket is split into the saved
    ones, so that with the same world size the resumed run continues bitwise identically
    to a run that never stopped. Another world size (elastic resume): every saved rank's
    state_dict is needed (``lbcomm.load_sharded(dir, opt, model, hook_state=state)`` reads
    them all); each unit's error feedback is redistributed with
    `CompressionState.redistribute` (the total carried error is preserved) and the replicas
    stay bitwise identical. Without them (or for another model) the errors are reset with a
    logged warning. Create the state and register the hook on a freshly built DDP model,
    as usual, so that the parameter numbering (taken from DDP's first iteration) is stable.
    `check_resume` names the optimizer, so that a resume that restores it but not this
    state is warned about.

    Args:
        start_iter (int, optional): iterations averaged at full precision before
            compression starts; must be > 1 because DDP rebuilds its buckets after
            iteration 1 (default: 100).
        normalize (str or None, optional): ``"warmup"``: each coordinate is divided by its
            gradient RMS over the full-precision start before compression and multiplied
            back after it (the RMS floored at ``normalize_floor`` x its bucket's RMS; the
            same weights on every rank, saved in checkpoints), so that a coordinate's
            compression noise is proportional to its own gradients, not to the largest of
            its block (rarely active features, nearly dead units, rare embedding rows);
            costs one bf16 per gradient element, fused into the compression and the decode
            (fp32 buckets of a flat reduction; half buckets and the hierarchical path take
            two extra elementwise passes). ``"adaptive"``: the weights are re-estimated at
            every compressed call from an EMA (``normalize_beta``) of the ranks' mean
            squares of what is compressed, factored per matrix into rows x columns (as in
            Adafactor: one small allreduce of rows + columns per bucket and call; started
            from the full-precision start), and the error feedback is rescaled by
            w_old / w_new when they change; flat reduction only (a ValueError when the
            topology resolves to several nodes). None: the published algorithm (default:
            "warmup").
        normalize_floor (float, optional): the floor of the weights relative to the RMS of
            the bucket's weights, > 0 (default: 0.1).
        momentum (float or None, optional): compress each rank's momentum of its own gradients
            (m = g + momentum m, started from the momentum of the averaged gradients over the
            full-precision start) instead of its gradient, and return m^_t - momentum m^_{t-1},
            m^ the decoded mean momentum: with ``torch.optim.SGD(momentum=momentum)`` the
            optimizer's buffer is then exactly m^, and a step's compression error enters
            the parameters once (why 1-bit Adam compresses its momentum). For SGD with
            momentum; not for AdamW; costs two fp32 buffers per gradient element. None:
            compress the gradients (default: None).
        normalize_beta (float, optional): the EMA coefficient of ``normalize="adaptive"``, in
            [0, 1) (default: 0.99).
        compression_stats_logging_frequency (int, optional): log the statistics every that
            many iterations once compression has started, at INFO (default: 10000).
        comm (CommConfig, optional): the communication settings (`lbcomm.CommConfig`): the
            DDP model's ``process_group``; ``topology`` ("auto": hierarchical under torchrun
            with several nodes, full precision inside a node and 1-bit between nodes, else
            flat; "flat"; or a `Topology` of the whole world, run on private copies of its
            groups; with a topology ``bytes_sent`` counts the inter-node bytes only);
            ``block_size``; ``nonfinite`` ("skip": a bucket holding NaN/Inf on any rank
            becomes NaN on every rank, as a plain allreduce would, so that a GradScaler
            skips the step, error feedback untouched; "raise": the backward pass raises a
            NonFiniteError on every rank); ``exact_numel`` (parameters of at most that many
            elements are averaged exactly beside the compressed call, counted in
            ``bytes_sent`` as a ring allreduce; a state_dict saved with another value
            resumes with the saved one, warned). The hook runs on torch.distributed
            (backend "auto" or "torch") (default: ``CommConfig()``).

    Example::
        >>> # xdoctest: +SKIP
        >>> state = lbcomm.OneBitHookState(start_iter=100)
        >>> ddp_model.register_comm_hook(state, lbcomm.onebit_hook)
        >>> state.check_resume(optimizer)
        >>> ...
        >>> lbcomm.save_sharded("ckpt", optimizer, ddp_model.module, hook_state=state)
        >>> lbcomm.load_sharded("ckpt", optimizer, ddp_model.module, hook_state=state)  # any world size
    """

    __slots__ = [
        "comm",
        "start_iter",
        "normalize",
        "normalize_floor",
        "normalize_beta",
        "momentum",
        "compression_stats_logging_frequency",
        # Internal state.
        "hier_topology",  # the private Topology the hierarchical calls run on (None: flat)
        "iter",
        "planner",  # BucketPlanner: the units of error feedback and which buckets they reduce
        "grad_stats",  # GradientStats of the full-precision start (normalize="warmup")
        "worker",  # BucketWorker (made at the first hook call): the thread and the private process group
        "resume",  # ResumeCheck: was this state restored where the optimizer was?
        "_next_stats_report",
        "_exact_reported",  # the exact_numel share has been logged (once per state)
        # Statistics.
        "total_bytes_sent",
        "total_bytes_uncompressed",
        "compressed_calls",
        "skipped_calls",
        "__weakref__",
    ]

    _SETTINGS = ("start_iter", "normalize", "normalize_floor", "momentum", "normalize_beta",
                 "compression_stats_logging_frequency")

    def __init__(
        self,
        start_iter: int = 100,
        *,
        normalize: Optional[str] = "warmup",
        normalize_floor: float = 0.1,
        momentum: Optional[float] = None,
        normalize_beta: float = 0.99,
        compression_stats_logging_frequency: int = 10_000,
        comm: Optional[CommConfig] = None,
    ):
        comm = resolve(comm, "OneBitHookState")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter <= 1:
            raise ValueError(f"Invalid start_iter: {start_iter!r} (must be > 1 because DDP rebuilds buckets after "
                             "iteration 1, and the error feedback belongs to the rebuilt buckets)")
        if normalize not in (None, "warmup", "adaptive"):
            raise ValueError(f"Invalid normalize: {normalize!r} (use 'warmup', 'adaptive', or None for the published "
                             "algorithm)")
        if momentum is not None and (isinstance(momentum, bool) or not isinstance(momentum, (int, float))
                                     or not 0 <= momentum < 1):
            raise ValueError(f"Invalid momentum: {momentum!r} (a number in [0, 1): the optimizer's momentum, or None "
                             "to compress the gradients)")
        if isinstance(normalize_beta, bool) or not isinstance(normalize_beta, (int, float)) or \
                not 0 <= normalize_beta < 1:
            raise ValueError(f"Invalid normalize_beta: {normalize_beta!r} (must be in [0, 1))")
        if normalize == "adaptive" and isinstance(comm.topology, Topology) and not comm.topology.flat:
            raise ValueError("OneBitHookState: normalize='adaptive' runs on the flat compressed allreduce; with a "
                             "multi-node topology use normalize='warmup'")
        if isinstance(normalize_floor, bool) or not isinstance(normalize_floor, (int, float)) or \
                not 0 < normalize_floor < math.inf:
            raise ValueError(f"Invalid normalize_floor: {normalize_floor!r} (must be a number > 0)")
        freq = compression_stats_logging_frequency
        if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
            raise ValueError(f"Invalid compression_stats_logging_frequency: {freq!r} (must be an int >= 1)")
        if comm.backend == "mpi":
            raise ValueError("OneBitHookState: DDP's hook runs on torch.distributed; use CommConfig(backend='torch') "
                             "or 'auto'")
        _log.info("OneBitHookState config: start_iter = %s; normalize = %s; momentum = %s; "
                  "compression_stats_logging_frequency = %s; %s", start_iter, normalize, momentum, freq, comm)
        self.comm = comm
        self.start_iter = start_iter
        self.normalize = normalize
        self.normalize_floor = float(normalize_floor)
        self.momentum = None if momentum is None else float(momentum)
        self.normalize_beta = float(normalize_beta)
        self.compression_stats_logging_frequency = freq
        self._init_internal()

    def _init_internal(self) -> None:
        self.iter = 0
        self.planner = BucketPlanner()
        self.grad_stats = GradientStats()
        self.worker: Optional[BucketWorker] = None
        self.hier_topology: Optional[Topology] = None
        self.resume = ResumeCheck()
        self._next_stats_report = self.start_iter
        self._exact_reported = False
        self.total_bytes_sent = 0
        self.total_bytes_uncompressed = 0
        self.compressed_calls = 0
        self.skipped_calls = 0

    @property
    def process_group(self):
        """The DDP model's process group (``comm.process_group``)."""
        return self.comm.process_group

    @property
    def bucket_units(self) -> Dict[int, Tuple[Tuple[int, ...], ...]]:
        """bucket.index() -> the parameter keys of the units (error feedback) that reduced
        that bucket in its last compressed iteration (several in the first iteration of a
        resumed DDP model)."""
        return self.planner.bucket_units

    def check_resume(self, optimizer) -> None:
        """Name the optimizer this hook's gradients feed: at the hook's first call, if it
        already holds state (it was restored from a checkpoint) while this state was not
        restored, a `MissingHookStateWarning` names the missing hook state."""
        self.resume.watch(optimizer)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self):
        """The settings, `comm` without its process group (not serializable; a Topology
        becomes "auto") and `state_dict`."""
        _log.warning("NOTE: the process group is not serializable and is excluded from the saved OneBitHookState.")
        comm = self.comm.replace(process_group=None, topology=self.comm.topology
                                 if isinstance(self.comm.topology, str) else "auto")
        return {**{name: getattr(self, name) for name in self._SETTINGS}, "comm": comm,
                "state_dict": self.state_dict()}

    def __setstate__(self, state):
        """Restore a pickled state; the process group becomes the default group (None)."""
        _log.warning("NOTE: the OneBitHookState's process group is set to the default group (the world); build a "
                     "new state with comm=CommConfig(process_group=...) if another group is desired.")
        for name in self._SETTINGS:
            setattr(self, name, state[name])
        self.comm = state["comm"]
        self._init_internal()
        self.load_state_dict(state["state_dict"])

    # ------------------------------------------------------------------ iterations
    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count iterations on the last bucket of each backward pass."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_iter:
                _log.info("onebit_hook: 1-bit compression of the gradients starts after %s iterations", self.iter)

    def bucket_worker(self) -> BucketWorker:
        """The worker of this state, made at the first call from the process group (whose
        ranks all make it together, as DDP's first hook call); resolves the topology."""
        if self.worker is None:
            self.worker = BucketWorker(self.process_group)
            topo = resolve_topology(self.comm, world_size=self.worker.world_size, who="OneBitHookState")
            if topo is not None:
                if self.normalize == "adaptive":
                    raise ValueError("OneBitHookState: topology='auto' found several nodes; normalize='adaptive' runs "
                                     "on the flat compressed allreduce only (use normalize='warmup' with a topology)")
                self.hier_topology = topo.private()
                _log.info("onebit_hook: hierarchical compression, %s", self.hier_topology)
        return self.worker

    def stats_report_due(self, bucket: dist.GradBucket) -> Optional[int]:
        """The iteration to log statistics for after this bucket, if due (every
        ``compression_stats_logging_frequency`` iterations, on the last bucket)."""
        if not (bucket.is_last() and self.iter >= self._next_stats_report):
            return None
        self._next_stats_report = self.iter + self.compression_stats_logging_frequency
        return self.iter

    def first_compressed(self, bucket: dist.GradBucket) -> bool:
        """True once per state (also after a resume): at the last bucket of the first
        compressed iteration, where the hook logs what it compresses."""
        if not bucket.is_last() or self._exact_reported:
            return False
        self._exact_reported = True
        return True

    def _ensure_idle(self, what: str) -> None:
        ensure_idle(self.worker, f"OneBitHookState.{what}")

    # ------------------------------------------------------------------ statistics
    def error_norm(self) -> float:
        """L2 norm of this rank's error feedback (worker and server errors of every unit).
        Reads device memory: call it outside the backward pass."""
        return units_error_norm(self.planner.units())

    def compression_stats(self) -> Dict[str, Any]:
        """Totals since the start (or since the checkpoint was taken, carried over), plain
        numbers:

        * ``bytes_sent``: what this rank sent through the hook (compressed calls, and the
          full-precision allreduces before ``start_iter`` counted as a ring allreduce);
        * ``bytes_uncompressed``: what ring allreduces of the same buckets would have sent;
        * ``compression_ratio``: their ratio;
        * ``compressed_calls``, ``skipped_calls`` (non-finite buckets), ``iter``;
        * ``error_norm``: see `error_norm`;
        * ``error_ratio``: ``error_norm`` over the norm of what the units last sent (each
          unit's `CompressionState.last_sent_norm`; 0.0 before the first compressed call).
        """
        sent, full = self.total_bytes_sent, self.total_bytes_uncompressed
        err = self.error_norm()
        last = math.sqrt(sum(u.compression.last_sent_norm ** 2 for u in self.planner.units()))
        return {
            "iter": self.iter,
            "bytes_sent": sent,
            "bytes_uncompressed": full,
            "compression_ratio": full / sent if sent else 0.0,
            "compressed_calls": self.compressed_calls,
            "skipped_calls": self.skipped_calls,
            "error_norm": err,
            "error_ratio": error_ratio(err, last),
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """This rank's error feedback, iteration count and statistics (one shard per rank)."""
        self._ensure_idle("state_dict")
        return {
            "version": _STATE_VERSION,
            "iter": self.iter,
            "start_iter": self.start_iter,
            "block_size": self.comm.block_size,
            "exact_numel": self.comm.exact_numel,
            "world_size": self.worker.world_size if self.worker is not None else world_info(self.process_group)[0],
            "units": self.planner.state_dict(),
            "grad_stats": self.grad_stats.state_dict(),
            "stats": {"bytes_sent": self.total_bytes_sent, "bytes_uncompressed": self.total_bytes_uncompressed,
                      "compressed_calls": self.compressed_calls, "skipped_calls": self.skipped_calls},
        }

    def load_state_dict(self, state_dict: Dict[str, Any], *,
                        all_ranks: Optional[Sequence[Dict[str, Any]]] = None) -> bool:
        """Restore a `state_dict` of this rank. The errors are attached to DDP's buckets as
        they appear. Returns True when the error feedback carries into this run (as saved,
        or redistributed), False when it was reset.

        Saved for another world size (elastic resume), pass ``all_ranks``: the `state_dict`
        of every rank of the saved world, in rank order (``state_dict`` is then any one of
        them; `lbcomm.load_sharded` with ``hook_state=`` does this). Each unit's error
        feedback is redistributed onto this world with `CompressionState.redistribute`,
        which preserves the total carried error; the replicas stay bitwise identical.
        Without ``all_ranks`` (or for hierarchical units) the errors are reset with a
        logged warning.
        """
        self._ensure_idle("load_state_dict")
        if not isinstance(state_dict, dict) or state_dict.get("version") != _STATE_VERSION:
            raise ValueError("OneBitHookState.load_state_dict: not a OneBitHookState state_dict (version "
                             f"{state_dict.get('version') if isinstance(state_dict, dict) else None!r}, expected "
                             f"{_STATE_VERSION})")
        world, rank = world_info(self.process_group)
        saved_exact = int(state_dict["exact_numel"])
        if saved_exact != self.comm.exact_numel:
            _log.warning("onebit_hook: the state was saved with exact_numel=%s and this OneBitHookState has %s; it "
                         "resumes with the saved %s so that the run continues as it was trained", saved_exact,
                         self.comm.exact_numel, saved_exact)
            self.comm = self.comm.replace(exact_numel=saved_exact)
        self.iter = int(state_dict["iter"])
        self._next_stats_report = max(self.start_iter, self.iter)
        stats = state_dict["stats"]
        self.total_bytes_sent = int(stats["bytes_sent"])
        self.total_bytes_uncompressed = int(stats["bytes_uncompressed"])
        self.compressed_calls = int(stats["compressed_calls"])
        self.skipped_calls = int(stats["skipped_calls"])
        units = state_dict["units"]
        carried = True
        if state_dict.get("world_size") != world and units:
            if all_ranks is None:
                carried = False
                _log.warning("onebit_hook: the state was saved with world size %s and this run has %s; the error "
                             "feedback is reset to zero and training continues (lbcomm.load_sharded(dir, "
                             "hook_state=state), or load_state_dict(sd, all_ranks=[every saved rank's state_dict]), "
                             "redistributes it)", state_dict.get("world_size"), world)
                units = []
            else:
                units = redistribute_units([_units_of(sd, r, all_ranks) for r, sd in enumerate(all_ranks)], world,
                                           rank, CompressionState.redistribute)
        self.planner.load_state_dict(units)
        self.grad_stats.load_state_dict(state_dict["grad_stats"])  # averaged gradients: any world size
        self.resume.loaded = True
        return carried


def _units_of(sd: Dict[str, Any], r: int, all_ranks: Sequence[Dict[str, Any]]):
    """The units of saved rank `r`, checked to belong to one checkpoint of one world."""
    if not isinstance(sd, dict) or sd.get("version") != _STATE_VERSION or sd.get("world_size") != len(all_ranks):
        raise ValueError(f"OneBitHookState.load_state_dict: all_ranks[{r}] is not the state_dict of rank {r} of "
                         f"a world of {len(all_ranks)} (pass every saved rank's state_dict, in rank order)")
    if sd.get("iter") != all_ranks[0].get("iter"):
        raise ValueError(f"OneBitHookState.load_state_dict: all_ranks[{r}] was saved at iteration {sd.get('iter')} "
                         f"and all_ranks[0] at {all_ranks[0].get('iter')}; pass the state_dicts of one checkpoint")
    return sd["units"]
