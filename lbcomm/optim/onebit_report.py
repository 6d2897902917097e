"""What a `OneBitStage` reports: why nothing is compressed yet (`not_compressing`), the
warning that a run never compressed, the warning that the lr rose after the freeze
(`watch_lr`), the freeze's log, the reducer's statistics and the bytes sent per step.
`StageReport` is the stage's ``report``."""
from __future__ import annotations

import atexit
import logging
import warnings
import weakref
from typing import Any, Dict, List, Optional

from ..common import compressor_stats, report_exact_share, ring_allreduce_bytes
from ..errors import NotCompressedWarning
from .flat import FlatLayout
from .freeze import AUTO, MAX_STEP

__all__ = ["StageReport", "LR_RISE"]

_log = logging.getLogger("lbcomm.optim.onebit")  # the stage's own logger, as before the split

# watch_lr's threshold: an lr this many times the lr at the freeze is warned about
LR_RISE = 1.5

_LIVE: "weakref.WeakSet[StageReport]" = weakref.WeakSet()


@atexit.register
def _warn_never_compressed() -> None:
    """At exit: a run of several ranks that never compressed says so (once per optimizer)."""
    for report in list(_LIVE):
        try:
            report.warn_uncompressed("the run ended")
        except Exception:  # noqa: BLE001 - the process group may be gone at exit
            pass


class StageReport:
    """The reports of the 1-bit stage `stage` (its flags: each warning is given once)."""

    def __init__(self, stage):
        self.stage = stage
        self.fs = stage.fs
        self._freeze_lrs: Optional[List[float]] = None  # each group's lr at the freeze (see watch_lr)
        self._warned_lr_rise = False
        self._warned_uncompressed = False
        self._warned_none = False
        _LIVE.add(self)  # warned at exit if it never compressed

    def not_compressing(self) -> Optional[str]:
        """Why nothing is compressed now, or None once the compression stage runs."""
        fs = self.fs
        if fs.transport.world_size == 1 and not fs.sharded():
            return ("one rank: nothing to communicate (is torch.distributed initialized with the job's world size, "
                    "or comm.process_group the group you meant?)")
        if self.stage.frozen:
            return None
        option = self.stage.freeze_option
        value = fs.option(option)
        if fs.global_step == 0:
            return "no step taken yet"
        if value == AUTO:
            last = self.stage.auto.last_change
            return (f"warmup: step {fs.global_step}, {option}='auto' has not frozen the variance yet (its last "
                    f"relative change {'not measured yet' if last is None else format(last, '.3g')}; freezes at "
                    f"most after step {MAX_STEP})")
        return f"warmup: step {fs.global_step} of {option}={value}; full-precision averaging until then"

    def warn_uncompressed(self, when: str) -> None:
        """Warn once that `when` (a checkpoint, the end of the run) comes before any compression."""
        if self._warned_uncompressed or self.stage.frozen or self.fs.global_step == 0:
            return
        why, option = self.not_compressing(), self.stage.freeze_option
        if why is None or why.startswith("one rank"):
            return
        self._warned_uncompressed = True
        fix = ("" if self.fs.option(option) == AUTO else
               f". If the run is shorter than {option}, set it below the run's length, or to 'auto'")
        warnings.warn(f"{self.fs.name}: {when} after {self.fs.global_step} steps without ever "
                      f"compressing ({why}); every step so far averaged the gradients in full precision{fix}",
                      NotCompressedWarning, stacklevel=3)

    def watch_lr(self, option: str = "freeze_step") -> None:
        """Log a warning, once, when a group's lr in the compression stage rises above
        LR_RISE times its lr at the first step this is called at (the one after the freeze,
        `option`, the optimizer's freeze option; after a resume, the first in this process):
        the variance frozen while the lr was still warming up under-preconditions the larger
        steps, which costs the top lrs (docs/optimizers.md, "Same hyperparameters as the
        twin"); the fix is freeze_step at the end of the lr warmup."""
        if self._warned_lr_rise:
            return
        lrs = [g["lr"] for g in self.fs.param_groups]
        if self._freeze_lrs is None or len(self._freeze_lrs) != len(lrs):
            self._freeze_lrs = lrs
            return
        rose = [i for i, (now, then) in enumerate(zip(lrs, self._freeze_lrs)) if then > 0 and now > LR_RISE * then]
        if rose:
            i = rose[0]
            _log.warning("%s: the lr of param group %s rose from %.3g at the freeze (step %s) to %.3g: the variance "
                         "was frozen while the lr was still warming up, which costs convergence at the larger lrs; "
                         "set %s to the end of the lr warmup", self.fs.name, i,
                         self._freeze_lrs[i], self.fs.option(option), lrs[i], option)
            self._warned_lr_rise = True

    def log_freeze(self, L: FlatLayout) -> None:
        fs, name = self.fs, self.fs.name
        exact, below = self.stage.masks.counts
        p = fs.transport.world_size
        if self.stage.reducer is not None:
            sent = self.bytes_per_step()
            part = self.stage.exact.part(L)
            fp32 = ring_allreduce_bytes(4 * L.total, p)
            _log.info("%s: the compression stage sends %s bytes per step and rank (compressed allreduce %s + "
                      "exact parameters %s + finiteness agreement %s) against %d for an fp32 ring allreduce of the "
                      "gradients: %.1fx less", name, sent["total"], sent["compressed"], sent["exact"],
                      sent["agreement"], fp32, fp32 / sent["total"])
            if part is not None:
                report_exact_share(_log, name, "momentum", part[0].numel(), L.total, self.stage.exact.limit)
        _log.info("%s: variance frozen after step %s; from now on one compressed allreduce of %s momentum elements "
                  "per step over %s ranks (block_size %s); %s coordinates held at zero (variance exactly zero: %s, "
                  "at most mask_threshold x mean: %s, user masks: %s params)", name, fs.global_step, L.total, p,
                  self.stage.comm.block_size, self.stage.masked_coordinates, exact, below, len(self.stage.masks.user))

    def stats(self) -> Dict[str, Any]:
        """The reducer's `lbcomm.common.compressor_stats` (its calls are checked: the step's
        own agreement, counted in `bytes_per_step`'s ``agreement``, replaces the reducer's)
        and ``status``: "compressing", or why nothing is compressed (`not_compressing`)."""
        return {**compressor_stats(self.stage.reducer, checked=True), "status": self.not_compressing() or "compressing"}

    def bytes_per_step(self) -> Optional[Dict[str, int]]:
        """What this rank sends per compression-stage step (see `OneBitAdam.bytes_per_step`);
        None before the freeze and with one rank, with a warning, once, that says why."""
        L, st = self.fs.layout, self.stage.reducer
        if st is None or L is None:
            why = self.not_compressing() or "no step taken yet"
            if not self._warned_none:
                self._warned_none = True
                warnings.warn(f"{self.fs.name}.bytes_per_step() is None: nothing is compressed yet ({why})",
                              NotCompressedWarning, stacklevel=3)
            return None
        p = self.fs.transport.world_size
        part = self.stage.exact.part(L)
        k = 0 if part is None else part[0].numel()
        out = {"compressed": int(st.bytes_per_call(checked=True)), "exact": self.stage.exact.exact_mean().bytes(k),
               # one fp32 scalar, + the optimizer's own slots (rescale_variance: one per parameter)
               "agreement": int(ring_allreduce_bytes(4 * (1 + self.fs.local_slots(L)), p))}
        out["total"] = sum(out.values())
        return out
