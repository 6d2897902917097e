"""`dct_hook` with its `DCTHookState`: DCT (Dynamic Communication Thresholding) of every
DDP bucket, for any optimizer. Each bucket's gradient plus this rank's residual is cut at
a threshold refreshed every ``refresh_every`` iterations; what passes is exchanged as
(index, value) pairs (`lbcomm.dct.DCTReducer`), the rest stays in the residual. The units
(which residual reduces which bucket, across DDP's bucket rebuild and checkpoints) and the
background thread are those of `onebit_hook` (`lbcomm.ddp.units`, `lbcomm.ddp.worker`).
"""
import functools
import logging
import math
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ..comm import world_info
from ..common import FLOAT_DTYPES, completed_future, error_ratio, report_exact_share, ring_allreduce_bytes
from ..config import CommConfig, resolve
from ..dct import DCTReducer, check_density, check_refresh_every
from ..exact import ExactMean
from ..topology import Topology
from .resume import ResumeCheck
from .units import BucketPlanner, Plan, redistribute_units
from .worker import BucketWorker, ensure_idle, reduce_planned, units_error_norm

__all__ = ["DCTHookState", "dct_hook"]

_log = logging.getLogger(__name__)

_STATE_VERSION = 1


class DCTHookState:
    r"""State of `dct_hook`: DCT sparse exchange of DDP's gradient buckets with residuals,
    for any optimizer (SGD, AdamW, ...).

    Each rank adds its residual to its bucket, sends the entries of magnitude at least its
    threshold as (int32 index, fp32 value) pairs to every rank (an all-gather: a rank sends
    (p - 1) x 8 bytes per pair, where a ring allreduce sends 2 (p - 1) / p x 4 bytes per
    element, so density d saves about 1 / (p d)), and keeps the rest in its residual. Every
    rank adds the contributions in rank order and divides by the world size: the replicas
    stay bitwise identical. The threshold of each bucket and rank is refreshed every
    ``refresh_every`` compressed iterations from the top ``density`` share of the bucket's
    magnitudes (`torch.topk`); in between, a bucket costs one comparison pass. Before
    ``start_iter`` the buckets are averaged at full precision (torch's allreduce).

    Pick it over `onebit_hook` where the gradients are sparse or heavy-tailed (embedding
    tables, recommendation models: most rows receive no gradient in a step) and more than
    32x less traffic is wanted; on dense gradients 1-bit compression keeps more of the
    signal per byte (see docs/dct.md).

    Checkpoints and elastic resume work as `OneBitHookState`'s: `state_dict` holds this
    rank's residuals and thresholds (``lbcomm.save_sharded(dir, opt, model,
    hook_state=state)``); with the same world size the resumed run continues bitwise;
    with another one, ``load_state_dict(sd, all_ranks=...)`` (what `lbcomm.load_sharded`
    passes) gives every new rank the mean of the saved residuals (their contribution to the
    mean is kept) and refreshes the thresholds at the next iteration.

    Args:
        start_iter (int, optional): iterations averaged at full precision first; > 1,
            because DDP rebuilds its buckets after iteration 1 (default: 100).
        density (float): the share of each bucket's entries the refreshed threshold lets
            through, in (0, 1] (default: 0.01).
        refresh_every (int): iterations between threshold refreshes, >= 1 (default: 1000).
        compression_stats_logging_frequency (int, optional): log the statistics every that
            many iterations once compression has started (default: 10000).
        comm (CommConfig, optional): ``process_group``, ``nonfinite`` ("skip": a bucket
            holding NaN/Inf on any rank becomes NaN on every rank, residuals untouched;
            "raise"), ``exact_numel`` (parameters of at most that many elements are
            averaged exactly beside the sparse exchange). The exchange is flat: a
            multi-node ``topology`` is refused; block_size is unused (default: ``CommConfig()``).

    Example::
        >>> # xdoctest: +SKIP
        >>> state = lbcomm.DCTHookState(100, density=0.01, refresh_every=1000)
        >>> ddp_model.register_comm_hook(state, lbcomm.dct_hook)
    """

    def __init__(self, start_iter: int = 100, *, density: float = 0.01, refresh_every: int = 1000,
                 compression_stats_logging_frequency: int = 10_000, comm: Optional[CommConfig] = None):
        comm = resolve(comm, "DCTHookState")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter <= 1:
            raise ValueError(f"DCTHookState: invalid start_iter {start_iter!r} (must be > 1 because DDP rebuilds "
                             "buckets after iteration 1, and the residuals belong to the rebuilt buckets)")
        density = check_density(density, "DCTHookState")
        refresh_every = check_refresh_every(refresh_every, "DCTHookState")
        freq = compression_stats_logging_frequency
        if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
            raise ValueError(f"DCTHookState: invalid compression_stats_logging_frequency {freq!r} (an int >= 1)")
        if comm.backend == "mpi":
            raise ValueError("DCTHookState: DDP's hook runs on torch.distributed; use CommConfig(backend='torch') "
                             "or 'auto'")
        if isinstance(comm.topology, Topology) and not comm.topology.flat:
            raise ValueError("DCTHookState: the sparse exchange is flat (an all-gather over the DDP group); a "
                             "multi-node topology is not supported, use CommConfig(topology='flat')")
        if density > 0.5:
            _log.warning("DCTHookState: density=%s sends (index, value) pairs for over half of the entries: more "
                         "bytes than a full-precision allreduce on any number of ranks", density)
        self.comm = comm
        self.start_iter, self.density, self.refresh_every = start_iter, density, refresh_every
        self.compression_stats_logging_frequency = freq
        self._init_internal()

    def stats_report_due(self, last: bool) -> bool:
        """Whether the hook logs statistics after this bucket (the last bucket of every
        ``compression_stats_logging_frequency``-th iteration); schedules the next report."""
        if not (last and self.iter + 1 >= self._next_stats_report):
            return False
        self._next_stats_report = self.iter + 1 + self.compression_stats_logging_frequency
        return True

    def first_compressed(self, last: bool) -> bool:
        """True once per state (also after a resume): at the last bucket of the first sparse
        iteration, where the hook logs what it compresses."""
        if not last or self._first_reported:
            return False
        self._first_reported = True
        return True

    def dense_warning_due(self) -> bool:
        """True the first time a sparse exchange sent more than a dense one would (warned once)."""
        if self._dense_warned:
            return False
        self._dense_warned = True
        return True

    def _init_internal(self) -> None:
        self.iter = 0
        self.planner = BucketPlanner()
        self.worker: Optional[BucketWorker] = None
        self.resume = ResumeCheck()
        self._next_stats_report = self.start_iter
        self._first_reported = False
        self._dense_warned = False
        self.total_bytes_sent = 0
        self.total_bytes_uncompressed = 0
        self.compressed_calls = 0
        self.skipped_calls = 0

    @property
    def process_group(self):
        return self.comm.process_group

    def check_resume(self, optimizer) -> None:
        """Name the optimizer the hook feeds: a resume that restored it but not this state
        is warned about at the first call (`MissingHookStateWarning`)."""
        self.resume.watch(optimizer)

    def bucket_worker(self) -> BucketWorker:
        if self.worker is None:
            self.worker = BucketWorker(self.process_group)
            if self.worker.world_size == 1:
                _log.warning("dct_hook: the process group has one rank; nothing is communicated or sparsified")
        return self.worker

    def _ensure_idle(self, what: str) -> None:
        ensure_idle(self.worker, f"DCTHookState.{what}")

    # ------------------------------------------------------------------ statistics
    def error_norm(self) -> float:
        """L2 norm of this rank's residuals (every unit)."""
        return units_error_norm(self.planner.units(), server=False)

    def compression_stats(self) -> Dict[str, Any]:
        """Totals since the start (carried over by checkpoints), plain numbers: ``bytes_sent``
        (sparse exchanges, exact means, and the full-precision start as ring allreduces),
        ``bytes_uncompressed`` (ring allreduces of the same buckets), ``compression_ratio``,
        ``compressed_calls``, ``skipped_calls`` (non-finite buckets), ``iter``, ``error_norm``
        (the residuals), ``error_ratio`` (``error_norm`` over the norm of the values the units
        sent in their last exchange, each unit's `lbcomm.dct.DCTReducer.last_sent_norm`; 0.0
        before the first compressed call) and ``sent_fraction`` (pairs sent / entries
        offered, over the compressed calls: the density actually reached)."""
        sent, full = self.total_bytes_sent, self.total_bytes_uncompressed
        units = self.planner.units()
        offered = sum(u.compression.offered_entries for u in units)
        err = self.error_norm()
        last = math.sqrt(sum(u.compression.last_sent_norm ** 2 for u in units))
        return {"iter": self.iter, "bytes_sent": sent, "bytes_uncompressed": full,
                "compression_ratio": full / sent if sent else 0.0, "compressed_calls": self.compressed_calls,
                "skipped_calls": self.skipped_calls, "error_norm": err, "error_ratio": error_ratio(err, last),
                "sent_fraction": sum(u.compression.sent_entries for u in units) / offered if offered else 0.0}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals, thresholds, iteration count and statistics (one shard per rank)."""
        self._ensure_idle("state_dict")
        return {"version": _STATE_VERSION, "kind": "dct", "iter": self.iter, "start_iter": self.start_iter,
                "exact_numel": self.comm.exact_numel,
                "world_size": self.worker.world_size if self.worker is not None else world_info(self.process_group)[0],
                "units": self.planner.state_dict(),
                "stats": {"bytes_sent": self.total_bytes_sent, "bytes_uncompressed": self.total_bytes_uncompressed,
                          "compressed_calls": self.compressed_calls, "skipped_calls": self.skipped_calls}}

    def load_state_dict(self, state_dict: Dict[str, Any], *,
                        all_ranks: Optional[Sequence[Dict[str, Any]]] = None) -> bool:
        """Restore a `state_dict` of this rank; saved with another world size, pass
        ``all_ranks`` (every saved rank's state_dict, in rank order) to redistribute the
        residuals (`DCTReducer.redistribute`); without it they are reset with a warning.
        Returns True when the residuals carry into this run, False when they were reset."""
        self._ensure_idle("load_state_dict")
        if not isinstance(state_dict, dict) or state_dict.get("kind") != "dct" or \
                state_dict.get("version") != _STATE_VERSION:
            raise ValueError("DCTHookState.load_state_dict: not a DCTHookState state_dict")
        world, rank = world_info(self.process_group)
        if int(state_dict["exact_numel"]) != self.comm.exact_numel:
            _log.warning("dct_hook: the state was saved with exact_numel=%s; it resumes with it (this state had %s)",
                         state_dict["exact_numel"], self.comm.exact_numel)
            self.comm = self.comm.replace(exact_numel=int(state_dict["exact_numel"]))
        self.iter = int(state_dict["iter"])
        self._next_stats_report = max(self.start_iter, self.iter)
        stats = state_dict["stats"]
        self.total_bytes_sent, self.total_bytes_uncompressed = int(stats["bytes_sent"]), int(stats["bytes_uncompressed"])
        self.compressed_calls, self.skipped_calls = int(stats["compressed_calls"]), int(stats["skipped_calls"])
        units = state_dict["units"]
        carried = True
        if state_dict["world_size"] != world and units:
            if all_ranks is None:
                carried = False
                _log.warning("dct_hook: the state was saved with world size %s and this run has %s; the residuals are "
                             "reset to zero (pass all_ranks=[every saved rank's state_dict], or use "
                             "lbcomm.load_sharded(dir, hook_state=state), to redistribute them)",
                             state_dict["world_size"], world)
                units = []
            else:
                for r, sd in enumerate(all_ranks):
                    if not isinstance(sd, dict) or sd.get("kind") != "dct" or sd.get("world_size") != len(all_ranks) \
                            or sd.get("iter") != state_dict["iter"]:
                        raise ValueError(f"DCTHookState.load_state_dict: all_ranks[{r}] is not rank {r}'s state_dict "
                                         f"of one checkpoint of a world of {len(all_ranks)}")
                units = redistribute_units([sd["units"] for sd in all_ranks], world, rank, DCTReducer.redistribute)
        self.planner.load_state_dict(units)
        self.resume.loaded = True
        return carried


# ---------------------------------------------------------------------- the hook
def _new_reducer(state: DCTHookState, numel: int, device: torch.device) -> DCTReducer:
    return DCTReducer(numel, state.worker.transport, density=state.density, refresh_every=state.refresh_every,
                      nonfinite=state.comm.nonfinite, device=device)


def _reduce_bucket(state: DCTHookState, plan: Plan, report: bool, buf: torch.Tensor) -> None:
    """The sparse exchange of one bucket, in place, on the worker thread."""
    def warn_dense(unit, sent: int, dense: int) -> None:
        if sent > dense and state.dense_warning_due():
            _log.warning("dct_hook: a bucket's sparse exchange sent %s bytes where a full-precision allreduce sends "
                         "%s (too many entries pass the threshold for %s ranks: lower density)", sent, dense,
                         state.worker.world_size)

    skipped = reduce_planned(state, plan, buf, warn_dense)
    if skipped:
        state.skipped_calls += 1
        buf.fill_(float("nan"))
        _log.warning("dct_hook: a bucket held NaN or Inf on some rank at iteration %s; it is NaN on every rank and "
                     "the residuals are unchanged", state.iter)
    if report:
        s = state.compression_stats()
        _log.info("dct_hook stats: iter %s, %s bytes sent, %s uncompressed (ratio %.2f), sent fraction %.4g, %s "
                  "compressed calls (%s skipped), residual norm %.6g", s["iter"], s["bytes_sent"],
                  s["bytes_uncompressed"], s["compression_ratio"], s["sent_fraction"], s["compressed_calls"],
                  s["skipped_calls"], s["error_norm"])


def dct_hook(state: DCTHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: DCT sparse exchange of every bucket with residuals.

    Before ``state.start_iter`` the bucket is averaged at full precision; from then on it
    is exchanged sparsely on a background thread (in bucket order) and the mean written
    into ``bucket.buffer()``, bitwise identical on every rank. See `DCTHookState`.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(lbcomm.DCTHookState(100, density=0.01), lbcomm.dct_hook)
    """
    if not isinstance(state, DCTHookState):
        raise TypeError(f"dct_hook: the hook state must be a DCTHookState, got {type(state).__name__}")
    buf = bucket.buffer()
    if buf.dtype not in FLOAT_DTYPES:
        raise TypeError(f"dct_hook: buckets of {buf.dtype} cannot be sparsified (float32, float16 or bfloat16)")
    key, params = state.planner.number(bucket)
    state.resume.check("dct_hook", "DCTHookState", fresh=state.iter == 0)
    worker = state.bucket_worker()
    last = bucket.is_last()
    if worker.world_size == 1:
        state.iter += last
        return completed_future(buf, buf.device)
    if state.iter < state.start_iter:
        nbytes = int(ring_allreduce_bytes(buf.numel() * buf.element_size(), worker.world_size))
        state.total_bytes_sent += nbytes
        state.total_bytes_uncompressed += nbytes
        fut = allreduce_hook(state.process_group, bucket)
        state.iter += last
        return fut
    plan = state.planner.plan(bucket, key, params, functools.partial(_new_reducer, state))
    for unit, _ in plan:
        if unit.exact_mean is None:
            unit.exact_mean = ExactMean(transport=worker.transport)
        unit.set_exact(state.comm.exact_numel, unit.exact_mean, buf.device)
        unit.compression.exclude(unit.exact[1])
        sp = unit.compression.sparsifier  # this state's settings, also for units restored from a checkpoint
        sp.density, sp.refresh_every = state.density, state.refresh_every
    report = state.stats_report_due(last)
    fut = worker.submit(buf, functools.partial(_reduce_bucket, state, plan, report))
    if state.first_compressed(last):
        units = state.planner.units()
        report_exact_share(_log, "dct_hook", "gradient", sum(u.exact_numel() for u in units),
                           sum(u.compression.numel for u in units), state.comm.exact_numel)
        _log.info("dct_hook: sparse exchange of the gradients from iteration %s on (density %s, threshold refreshed "
                  "every %s iterations)", state.iter + 1, state.density, state.refresh_every)
    state.iter += last
    return fut
