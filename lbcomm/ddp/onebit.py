"""`onebit_hook`: 1-bit error-feedback compressed allreduce of every DDP bucket, for any
optimizer, and its `OneBitHookState` (settings, iteration, error feedback, statistics).
Which error feedback reduces which bucket and the thread that runs the compressed calls
live in `lbcomm.ddp.buckets`.
"""
import functools
import logging
import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ..comm import world_info
from ..common import FLOAT_DTYPES, NONFINITE_POLICIES, completed_future, report_exact_share, ring_allreduce_bytes
from ..compressed import CompressionState
from ..config import DEFAULT_BLOCK_SIZE
from ..topology import HierarchicalState, Topology, exact_mean_bytes
from ..wire import check_block_size
from .buckets import BucketPlanner, BucketWorker, GradientStats, Plan, Transform, Unit
from .claims import HOOK, claim_gradients

__all__ = ["OneBitHookState", "onebit_hook"]

_log = logging.getLogger(__name__)

_STATE_VERSION = 1


class OneBitHookState:
    r"""State of `onebit_hook`: 1-bit error-feedback compressed allreduce of DDP's gradient
    buckets, for any optimizer (SGD, AdamW, ...). Under SGD with momentum pass its momentum
    (``momentum=``, with ``normalize="adaptive"``): otherwise SGD's momentum sums the
    gradients' compression errors, so that each step's error reaches the parameters over
    many steps; compressing the momentum itself lets it enter once (see docs/hooks.md).

    Every bucket is reduced with `lbcomm.compressed_allreduce` (docs/concepts.md): about 1 bit
    per gradient element instead of 32, with the rounding error of every call fed back into
    the next one (per rank, per bucket), so that nothing is lost over time. Before
    ``start_iter`` the buckets are averaged at full precision.

    The compressed allreduces run on a background thread, one bucket after the other in
    bucket order (so every rank issues its collectives in the same order), on a private
    duplicate of ``process_group`` (so they never interleave with DDP's own collectives).
    The hook returns at once with a future: compression overlaps the rest of the backward
    pass, and nothing blocks or synchronizes a device inside a hook callback.

    Results are bitwise identical on every rank, so replicas stay identical.

    Checkpoints: `state_dict` holds this rank's error buffers (one shard per rank, like the
    lbcomm optimizers; ``lbcomm.save_sharded(dir, opt, model, hook_state=state)``)
    and `load_state_dict` restores them. They are stored per list of parameters rather than
    per bucket index, because a new DDP instance runs its first iteration with its initial
    buckets before it rebuilds them: in that iteration a bucket is split into the saved
    ones, so that with the same world size the resumed run continues bitwise identically
    to a run that never stopped. Another world size (elastic resume): every saved rank's
    state_dict is needed (``lbcomm.load_sharded(dir, opt, model, hook_state=state)`` reads
    them all); each unit's error feedback is redistributed onto the new world with
    `lbcomm.CompressionState.redistribute`, preserving the total carried error (the mean
    of the worker errors plus the concatenated server errors), and the replicas stay
    bitwise identical. Without them (or for another
    model) the errors are reset with a logged warning. Create the state and register the
    hook on a freshly built DDP model, as usual, so that the parameter numbering (taken
    from DDP's first iteration) is stable.

    Args:
        process_group (ProcessGroup, optional): the DDP model's process group (default:
            None, the world).
        start_iter (int, optional): iterations averaged at full precision before
            compression starts; must be > 1 because DDP rebuilds its buckets after
            iteration 1 (default: 100).
        block_size (int or None, optional): elements per scale block of the compressed
            allreduce (multiple of 32), or None for the published single-scale algorithm
            (default: 2048).
        nonfinite (str, optional): what a bucket holding NaN/Inf on any rank does: "skip"
            makes the whole bucket NaN on every rank, as a plain allreduce would (so that
            e.g. ``torch.amp.GradScaler`` skips the step), leaving the error buffers
            untouched; "raise" makes the backward pass raise a NonFiniteError on every rank
            (default: "skip").
        compression_stats_logging_frequency (int, optional): log the statistics (bytes
            sent, compression ratio, error norm) every that many iterations once
            compression has started, at INFO (default: 10000).
        normalize (str or None, optional): ``"warmup"``: each coordinate is divided by its
            gradient RMS over the full-precision start before compression and multiplied
            back after it (the RMS floored at ``normalize_floor`` x its bucket's RMS; the
            same weights on every rank, saved in checkpoints), so that a coordinate's
            compression noise is proportional to its own gradients, not to the largest of
            its block (rarely active features, nearly dead units, rare embedding rows, biases
            next to weights); costs one bf16 per gradient element, read by the compression
            and by the decode, into which the division and the multiplication are fused
            (fp32 buckets of a flat topology; half buckets and the hierarchical path take
            two extra elementwise passes). None: the published algorithm, which compresses the
            gradients as they are (default: "warmup").
            ``"adaptive"``: the weights are re-estimated at every compressed call from an EMA
            (``normalize_beta``) of the ranks' mean squares of what is compressed, factored
            per parameter matrix into rows x columns (the rank-1 fit, as in Adafactor: one
            small reduce + broadcast of rows + columns per bucket and call, so that every
            rank makes the same weights; started from the full-precision start),
            and the error feedback is rescaled by w_old / w_new when they change, so that a
            unit that comes alive after the start (a dead ReLU unit, a new embedding row) is
            weighted by its current gradients; flat topology only.
        normalize_floor (float, optional): the floor of the weights relative to the RMS of
            the bucket's weights, > 0 (default: 0.1).
        normalize_beta (float, optional): the EMA coefficient of ``normalize="adaptive"``, in
            [0, 1) (default: 0.99).
        momentum (float or None, optional): compress each rank's momentum of its own gradients
            (m = g + momentum m, started from the momentum of the averaged gradients over the
            full-precision start) instead of its gradient, and return m^_t - momentum m^_{t-1},
            m^ the decoded mean momentum: with ``torch.optim.SGD(momentum=momentum)`` the
            optimizer's buffer is then exactly m^ (plus its weight decay terms), and a
            step's compression error enters the parameters once instead of being summed over
            the momentum's memory (why 1-bit Adam compresses its momentum). For SGD with
            momentum (set it to SGD's ``momentum``); not for AdamW (Adam squares what it is
            handed, and the difference of two decoded momenta inflates its variance), and
            Lars gains nothing from it; costs two fp32 buffers per gradient element. None:
            compress the gradients (default: None).
        exact_numel (int, optional): parameters of at most this many elements (biases,
            norm weights, the small heads and stems of small models) are averaged exactly by
            an fp32 allreduce beside the compressed call instead of being compressed (their
            error feedback stays zero): 1-bit compression saves little on them and costs
            the most accuracy there; their bytes are counted
            in ``bytes_sent`` as a ring allreduce. 0: every parameter compressed, the
            published algorithm (default: 4096). A state_dict saved with another value (or
            before the option existed: 0) resumes with the saved value, with a warning.
        topology (Topology or str or None, optional): nodes of fast-linked ranks
            (`lbcomm.topology`): each bucket is then averaged in full precision inside the
            node and 1-bit compressed only between nodes (`hierarchical_allreduce_`), G
            times less inter-node traffic. A `Topology` of the whole world (the hook runs
            it on private copies of its groups), ``"auto"`` (`Topology.auto()` at the
            first hook call: hierarchical under torchrun with more than one node,
            LOCAL_WORLD_SIZE < WORLD_SIZE, else flat), or None: the flat call over
            ``process_group`` (default: None). With a topology, ``bytes_sent`` counts the
            inter-node bytes only.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = lbcomm.ddp.OneBitHookState(process_group=None, start_iter=100)
        >>> ddp_model.register_comm_hook(state, lbcomm.ddp.onebit_hook)
        >>> ...
        >>> lbcomm.save_sharded("ckpt", optimizer, ddp_model.module, hook_state=state)
        >>> lbcomm.load_sharded("ckpt", optimizer, ddp_model.module, hook_state=state)  # any world size
    """

    __slots__ = [
        "process_group",
        # The settings that are tuned.
        "start_iter",
        "block_size",
        "normalize",
        "normalize_floor",
        "normalize_beta",
        "momentum",
        "exact_numel",
        # The settings that seldom change.
        "nonfinite",
        "compression_stats_logging_frequency",
        "topology",
        # Internal state.
        "hier_topology",  # the private Topology the hierarchical calls run on (None: flat)
        "iter",
        "planner",  # BucketPlanner: the units of error feedback and which buckets they reduce
        "grad_stats",  # GradientStats of the full-precision start (normalize="warmup")
        "worker",  # BucketWorker (made at the first hook call): the thread and the private process group
        "_next_stats_report",
        "_exact_reported",  # the exact_numel share has been logged (once per state)
        # Statistics.
        "total_bytes_sent",
        "total_bytes_uncompressed",
        "compressed_calls",
        "skipped_calls",
        "__weakref__",
    ]

    def __init__(
        self,
        process_group=None,
        start_iter: int = 100,
        block_size: Optional[int] = DEFAULT_BLOCK_SIZE,
        *,
        nonfinite: str = "skip",
        compression_stats_logging_frequency: int = 10_000,
        topology=None,
        normalize: Optional[str] = "warmup",
        normalize_floor: float = 0.1,
        momentum: Optional[float] = None,
        normalize_beta: float = 0.99,
        exact_numel: int = 4096,
    ):
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter <= 1:
            raise ValueError(f"Invalid start_iter: {start_iter!r} (must be > 1 because DDP rebuilds buckets after "
                             "iteration 1, and the error feedback belongs to the rebuilt buckets)")
        check_block_size(block_size)
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
        if normalize == "adaptive" and topology is not None and not (isinstance(topology, Topology) and topology.flat):
            raise ValueError("OneBitHookState: normalize='adaptive' runs on the flat compressed allreduce; with a "
                             "topology use normalize='warmup'")
        if isinstance(normalize_floor, bool) or not isinstance(normalize_floor, (int, float)) or \
                not 0 < normalize_floor < math.inf:
            raise ValueError(f"Invalid normalize_floor: {normalize_floor!r} (must be a number > 0)")
        if isinstance(exact_numel, bool) or not isinstance(exact_numel, int) or exact_numel < 0:
            raise ValueError(f"Invalid exact_numel: {exact_numel!r} (an int >= 0: parameters of at most this many "
                             "elements are averaged exactly; 0 compresses every parameter)")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid nonfinite policy: {nonfinite!r} (use one of {NONFINITE_POLICIES})")
        freq = compression_stats_logging_frequency
        if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
            raise ValueError(f"Invalid compression_stats_logging_frequency: {freq!r} (must be an int >= 1)")
        _log.info("OneBitHookState config: start_iter = %s; block_size = %s; nonfinite = %s; "
                  "compression_stats_logging_frequency = %s; normalize = %s; momentum = %s; exact_numel = %s",
                  start_iter, block_size, nonfinite, freq, normalize, momentum, exact_numel)
        self.process_group = process_group
        self.start_iter = start_iter
        self.block_size = block_size
        self.normalize = normalize
        self.normalize_floor = float(normalize_floor)
        self.momentum = None if momentum is None else float(momentum)
        self.normalize_beta = float(normalize_beta)
        self.exact_numel = exact_numel
        self.nonfinite = nonfinite
        self.compression_stats_logging_frequency = freq
        if not (topology is None or topology == "auto" or isinstance(topology, Topology)):
            raise ValueError(f"Invalid topology: {topology!r} (use None for the flat call, 'auto', or a "
                             "lbcomm.topology.Topology)")
        if topology is not None and process_group is not None:
            raise ValueError("OneBitHookState: a topology spans the whole world; leave process_group=None with it")
        self.topology = topology
        self._init_internal()

    def _init_internal(self) -> None:
        self.iter = 0
        self.planner = BucketPlanner()
        self.grad_stats = GradientStats()
        self.worker: Optional[BucketWorker] = None
        self.hier_topology: Optional[Topology] = None
        self._next_stats_report = self.start_iter
        self._exact_reported = False
        self.total_bytes_sent = 0
        self.total_bytes_uncompressed = 0
        self.compressed_calls = 0
        self.skipped_calls = 0

    @property
    def bucket_units(self) -> Dict[int, Tuple[Tuple[int, ...], ...]]:
        """bucket.index() -> the parameter keys of the units (error feedback) that reduced
        that bucket in its last compressed iteration (several in the first iteration of a
        resumed DDP model)."""
        return self.planner.bucket_units

    @property
    def error_dict(self) -> Dict[int, Tuple[Tuple[int, ...], ...]]:
        """Deprecated alias of `bucket_units` (it holds parameter keys, not errors)."""
        warnings.warn("OneBitHookState.error_dict is deprecated: it holds parameter keys, not errors; use "
                      "OneBitHookState.bucket_units", DeprecationWarning, stacklevel=2)
        return self.bucket_units

    # ------------------------------------------------------------------ pickling
    _CONFIG = ("start_iter", "block_size", "nonfinite", "compression_stats_logging_frequency", "normalize",
               "normalize_floor", "momentum", "normalize_beta", "exact_numel")

    def __getstate__(self):
        """The settings and `state_dict`; the process group is not serializable and is left out."""
        _log.warning("NOTE: the process group is not serializable and is excluded from the saved OneBitHookState.")
        return {**{name: getattr(self, name) for name in self._CONFIG}, "state_dict": self.state_dict()}

    def __setstate__(self, state):
        """Restore a pickled state; ``process_group`` becomes the default group (None)."""
        self.process_group = None
        self.topology = None
        _log.warning("NOTE: the OneBitHookState's process group is set to the default group (the world); set "
                     "`state.process_group` before the next iteration if another group is desired.")
        # pickled before the options existed: as trained then
        defaults = {"normalize": None, "normalize_floor": 0.1, "momentum": None, "normalize_beta": 0.99,
                    "exact_numel": 0}
        for name in self._CONFIG:
            setattr(self, name, state[name] if name in state else defaults[name])
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
        """The worker of this state, made at the first call from ``process_group`` (whose
        ranks all make it together, as DDP's first hook call)."""
        if self.worker is None:
            self.worker = BucketWorker(self.process_group)
            topo = Topology.auto() if self.topology == "auto" else self.topology
            if topo is not None and not topo.flat:
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

    def _ensure_idle(self, what: str) -> None:
        busy = self.worker.busy() if self.worker is not None else 0
        if busy:
            raise RuntimeError(f"OneBitHookState.{what}: {busy} bucket(s) are still being reduced; call it after "
                               "the backward pass (DDP waits for every bucket before backward returns)")

    # ------------------------------------------------------------------ statistics
    def error_norm(self) -> float:
        """L2 norm of this rank's error feedback (worker and server errors of every unit).
        Reads device memory: call it outside the backward pass."""
        total = 0.0
        for unit in self.planner.units():
            st = unit.compression
            total += float(st.worker_error.double().square().sum()) + float(st.server_error.double().square().sum())
        return math.sqrt(total)

    def compression_stats(self) -> Dict[str, Any]:
        """Totals since the start (or since the checkpoint was taken, carried over):

        * ``bytes_sent``: what this rank sent through the hook (compressed calls, and the
          full-precision allreduces before ``start_iter`` counted as a ring allreduce);
        * ``bytes_uncompressed``: what ring allreduces of the same buckets would have sent;
        * ``compression_ratio``: their ratio;
        * ``compressed_calls``, ``skipped_calls`` (non-finite buckets), ``iter``;
        * ``error_norm``: see `error_norm`.
        """
        sent, full = self.total_bytes_sent, self.total_bytes_uncompressed
        return {
            "iter": self.iter,
            "bytes_sent": sent,
            "bytes_uncompressed": full,
            "compression_ratio": full / sent if sent else 0.0,
            "compressed_calls": self.compressed_calls,
            "skipped_calls": self.skipped_calls,
            "error_norm": self.error_norm(),
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """This rank's error feedback, iteration count and statistics (one shard per rank)."""
        self._ensure_idle("state_dict")
        return {
            "version": _STATE_VERSION,
            "iter": self.iter,
            "start_iter": self.start_iter,
            "block_size": self.block_size,
            "exact_numel": self.exact_numel,
            "world_size": self.worker.world_size if self.worker is not None else world_info(self.process_group)[0],
            "units": self.planner.state_dict(),
            "grad_stats": self.grad_stats.state_dict(),
            "stats": {"bytes_sent": self.total_bytes_sent, "bytes_uncompressed": self.total_bytes_uncompressed,
                      "compressed_calls": self.compressed_calls, "skipped_calls": self.skipped_calls},
        }

    def load_state_dict(self, state_dict: Dict[str, Any], *,
                        all_ranks: Optional[Sequence[Dict[str, Any]]] = None) -> None:
        """Restore a `state_dict` of this rank. The errors are attached to DDP's buckets as
        they appear.

        Saved for another world size (elastic resume), pass ``all_ranks``: the `state_dict`
        of every rank of the saved world, in rank order (``state_dict`` is then any one of
        them; `lbcomm.load_sharded` with ``hook_state=`` does this). Each unit's error
        feedback is redistributed onto this world with `lbcomm.CompressionState.redistribute`,
        which preserves the total carried error (mean of worker errors + concatenated
        server errors); the replicas stay bitwise identical (every rank
        decodes the same all-gathered result). Without
        ``all_ranks`` (or for hierarchical units) the errors are reset with a logged warning.
        """
        self._ensure_idle("load_state_dict")
        if not isinstance(state_dict, dict) or state_dict.get("version") != _STATE_VERSION:
            raise ValueError("OneBitHookState.load_state_dict: not a OneBitHookState state_dict (version "
                             f"{state_dict.get('version') if isinstance(state_dict, dict) else None!r}, expected "
                             f"{_STATE_VERSION})")
        world, rank = world_info(self.process_group)
        saved_exact = int(state_dict.get("exact_numel", 0))  # saved before the option: every parameter compressed
        if saved_exact != self.exact_numel:
            _log.warning("onebit_hook: the state was saved with exact_numel=%s and this OneBitHookState has %s; it "
                         "resumes with the saved %s so that the run continues as it was trained (set "
                         "state.exact_numel after loading to change it)", saved_exact, self.exact_numel, saved_exact)
            self.exact_numel = saved_exact
        self.iter = int(state_dict["iter"])
        self._next_stats_report = max(self.start_iter, self.iter)
        stats = state_dict.get("stats", {})
        self.total_bytes_sent = int(stats.get("bytes_sent", 0))
        self.total_bytes_uncompressed = int(stats.get("bytes_uncompressed", 0))
        self.compressed_calls = int(stats.get("compressed_calls", 0))
        self.skipped_calls = int(stats.get("skipped_calls", 0))
        units = state_dict["units"]
        if state_dict.get("world_size") != world and units:
            if all_ranks is None:
                _log.warning("onebit_hook: the state was saved with world size %s and this run has %s; the error "
                             "feedback is reset to zero and training continues (lbcomm.load_sharded(dir, "
                             "hook_state=state), or load_state_dict(sd, all_ranks=[every saved rank's state_dict]), "
                             "redistributes it)", state_dict.get("world_size"), world)
                units = []
            else:
                units = _redistribute_units(all_ranks, world, rank)
        self.planner.load_state_dict(units)
        self.grad_stats.load_state_dict(state_dict.get("grad_stats", []))  # averaged gradients: any world size


def _redistribute_units(all_ranks: Sequence[Dict[str, Any]], world: int, rank: int) -> List[Dict[str, Any]]:
    """The unit entries of `rank` in a world of `world` ranks from every saved rank's
    `OneBitHookState.state_dict` (elastic resume): each unit's errors through
    `CompressionState.redistribute`. Hierarchical units are dropped with a warning."""
    saved_world = len(all_ranks)
    for r, sd in enumerate(all_ranks):
        if not isinstance(sd, dict) or sd.get("version") != _STATE_VERSION or sd.get("world_size") != saved_world:
            raise ValueError(f"OneBitHookState.load_state_dict: all_ranks[{r}] is not the state_dict of rank {r} of "
                             f"a world of {saved_world} (pass every saved rank's state_dict, in rank order)")
        if sd.get("iter") != all_ranks[0].get("iter"):
            raise ValueError(f"OneBitHookState.load_state_dict: all_ranks[{r}] was saved at iteration {sd.get('iter')} "
                             f"and all_ranks[0] at {all_ranks[0].get('iter')}; pass the state_dicts of one checkpoint")
    per_rank = [{tuple(e["params"]): e for e in sd["units"]} for sd in all_ranks]
    if any(set(units) != set(per_rank[0]) for units in per_rank):
        raise ValueError("OneBitHookState.load_state_dict: the saved ranks hold different units; all_ranks must be "
                         "the state_dicts of one checkpoint")
    out, dropped = [], 0
    for key, entry in per_rank[0].items():
        shards = [units[key]["compression"] for units in per_rank]
        if "worker_error" not in shards[0]:  # a HierarchicalState: its layout depends on the node shape
            dropped += 1
            continue
        tr = entry.get("transform")
        if tr is not None and tr.get("local") is not None:  # every new rank: the mean of the saved momenta
            tr = {**tr, "local": torch.stack([units[key]["transform"]["local"].double() for units in per_rank])
                  .mean(0).float()}
        out.append({"params": list(key), "shapes": entry["shapes"],
                    "compression": CompressionState.redistribute(shards, world, rank),
                    "weights": entry.get("weights"),  # the same on every rank: any world size
                    "transform": tr})
    if dropped:
        _log.warning("onebit_hook: %s hierarchical unit(s) cannot be redistributed onto another world size; their "
                     "error feedback is reset to zero", dropped)
    _log.info("onebit_hook: the error feedback of %s unit(s) saved by %s ranks was redistributed onto %s ranks (its "
              "total is preserved)", len(out), saved_world, world)
    return out


def _new_compression(state: OneBitHookState, numel: int, device: torch.device):
    """The error feedback of a new unit, on the worker's private group (or topology)."""
    if state.hier_topology is not None:
        return HierarchicalState(numel, state.hier_topology, device=device, block_size=state.block_size,
                                 nonfinite=state.nonfinite)
    return CompressionState(numel, group=state.worker.group, device=device, block_size=state.block_size,
                            nonfinite=state.nonfinite, backend="torch")


def _set_transform(state: OneBitHookState, unit: Unit) -> None:
    """Give `unit` the Transform of the state's momentum / adaptive settings (started from
    the full-precision start's statistics), or none."""
    adaptive = state.normalize == "adaptive"
    if state.momentum is None and not adaptive:
        unit.transform = None
        return
    tr = unit.transform
    if tr is None:
        stats, mom = state.grad_stats.start(unit.key, unit.shapes)
        tr = unit.transform = Transform(state.momentum, adaptive, state.normalize_beta, state.normalize_floor,
                                        state.worker.group, local=mom, ema=stats if adaptive else None)
    else:  # restored from a checkpoint: this run's settings
        tr.momentum, tr.adaptive, tr.beta, tr.floor, tr.group = (state.momentum, adaptive, state.normalize_beta,
                                                                 state.normalize_floor, state.worker.group)
        if tr.momentum is None:
            tr.local = tr.decoded = None
        if not adaptive:
            tr.ema = None


def _reduce_bucket(state: OneBitHookState, plan: Plan, report_iter: Optional[int], buf: Tensor) -> None:
    """The compressed allreduce of one bucket, in place, on the worker thread; counts it in
    the statistics and logs them when `report_iter` is given."""
    skipped = False
    for unit, slices in plan:
        st = unit.reduce(buf, slices)
        skipped = skipped or unit.last_skipped
        world = state.worker.world_size
        if not unit.fully_exact():
            state.compressed_calls += 1
            state.total_bytes_sent += st.bytes_per_call()
            if unit.transform is not None:
                state.total_bytes_sent += unit.transform.extra_bytes(unit)
        state.total_bytes_sent += exact_mean_bytes(unit.exact_numel(), world, st)
        state.total_bytes_uncompressed += int(ring_allreduce_bytes(st.numel * buf.element_size(), world))
    if skipped:
        state.skipped_calls += 1
        buf.fill_(float("nan"))  # what a plain allreduce of NaN/Inf gives, on every rank
        _log.warning("onebit_hook: a bucket held NaN or Inf on some rank at iteration %s; it is NaN on every "
                     "rank and the error feedback is unchanged", state.iter)
    if report_iter is not None:
        stats = state.compression_stats()
        _log.info("onebit_hook stats: iter %s, %s bytes sent, %s uncompressed (ratio %.2f), %s compressed calls "
                  "(%s skipped), error norm %.6g", report_iter, stats["bytes_sent"], stats["bytes_uncompressed"],
                  stats["compression_ratio"], stats["compressed_calls"], stats["skipped_calls"],
                  stats["error_norm"])


def onebit_hook(state: OneBitHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: 1-bit error-feedback compressed allreduce of every bucket.

    Before ``state.start_iter`` the bucket is averaged at full precision (torch's
    ``allreduce_hook``); from then on it is reduced with `lbcomm.compressed_allreduce` on a
    background thread (in bucket order) and decoded in place into ``bucket.buffer()``; the
    returned future completes then. The result, about the mean of the ranks' gradients, is
    bitwise identical on every rank. See `OneBitHookState`.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = lbcomm.ddp.OneBitHookState(process_group=None, start_iter=100)
        >>> ddp_model.register_comm_hook(state, lbcomm.ddp.onebit_hook)
    """
    if not isinstance(state, OneBitHookState):
        raise TypeError(f"onebit_hook: the hook state must be a OneBitHookState, got {type(state).__name__}")
    buf = bucket.buffer()
    if buf.dtype not in FLOAT_DTYPES:
        raise TypeError(f"onebit_hook: buckets of {buf.dtype} cannot be compressed (float32, float16 or bfloat16); "
                        "use torch's allreduce_hook for this model")
    key, params, fresh = state.planner.number(bucket)  # numbered in DDP's first iteration
    if fresh:
        claim_gradients(fresh, state, HOOK)  # a 1-bit optimizer on them would compress twice
    worker = state.bucket_worker()
    if worker.world_size == 1:
        state.maybe_increase_iter(bucket)
        return completed_future(buf, buf.device)
    if state.iter < state.start_iter:
        nbytes = int(ring_allreduce_bytes(buf.numel() * buf.element_size(), worker.world_size))
        state.total_bytes_sent += nbytes
        state.total_bytes_uncompressed += nbytes
        fut = allreduce_hook(state.process_group, bucket)
        if state.normalize is not None or state.momentum is not None:
            # statistics per parameter: DDP's initial and rebuilt buckets alike
            stats, numels, mu = state.grad_stats, [p.numel() for p in params], state.momentum
            fut = fut.then(lambda f: (stats.add(key, numels, f.value(), mu), f.value())[1])
        state.maybe_increase_iter(bucket)
        return fut
    new_weights = None
    if state.normalize == "warmup":
        new_weights = functools.partial(state.grad_stats.weights, floor=state.normalize_floor)
    plan = state.planner.plan(bucket, key, params, functools.partial(_new_compression, state),
                              *([new_weights] if new_weights else []))
    for unit, _ in plan:
        _set_transform(state, unit)
        unit.set_exact(state.exact_numel, worker.group, buf.device)
    fut = worker.submit(buf, functools.partial(_reduce_bucket, state, plan, state.stats_report_due(bucket)))
    if bucket.is_last() and not state._exact_reported:  # the first compressed iteration, also after a resume
        state._exact_reported = True
        _report_exact(state)
    state.maybe_increase_iter(bucket)
    return fut


def _report_exact(state: OneBitHookState) -> None:
    """Say how much of the model `exact_numel` leaves uncompressed."""
    units = state.planner.units()
    report_exact_share(_log, "onebit_hook", "gradient", sum(u.exact_numel() for u in units),
                       sum(u.compression.numel for u in units), state.exact_numel)
