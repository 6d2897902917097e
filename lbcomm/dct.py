"""DCT (Dynamic Communication Thresholding): hard-threshold sparsification with residuals.

Of ``acc = residual + x`` the entries of magnitude at least a threshold are sent as
(index, value) pairs; the others stay in this rank's residual and are added to the next
input (error feedback), so that nothing is lost, only delayed. The threshold is refreshed
every ``refresh_every`` calls as the magnitude of the k-th largest entry of ``acc``, k =
ceil(density x the entries that may be sent) (`torch.topk`, on the refresh call only); in
between, a call costs one comparison pass and the gather of what passes. Between refreshes
the share that passes follows the gradients: it is what ``density`` aims at, not a cap.

* `Sparsifier`: the threshold, its refresh and the residual of one flat tensor (used by
  the data-parallel reducer here and by the model-parallel boundary, `lbcomm.dct_mp`);
* `DCTReducer`: the sparse mean over the ranks of one flat tensor with a `Sparsifier`, a
  `lbcomm.reducer.Reducer` (the DDP hook's units hold one, `lbcomm.ddp.dct`). Every rank
  sends its pairs through the transport's `all_gather_v`; each rank adds the ranks'
  contributions in rank order into zeros and divides by the world size, so the result is
  bitwise identical on every rank.

Wire format of one contribution (uint8): an int64 header (the number of pairs k, or -1
when this rank's input holds NaN/Inf, so that every rank agrees to skip), k indices
(int32, or int64 for tensors of 2**31 elements or more), k fp32 values.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .common import NONFINITE_POLICIES, NonFiniteError, error_ratio

__all__ = ["Sparsifier", "DCTReducer", "check_density", "check_refresh_every", "pack", "unpack", "gather_v_bytes"]

_log = logging.getLogger(__name__)

# a threshold of zero would send every zero entry too: the smallest positive normal float
# instead, so that exact zeros (rows without gradient) are never sent
_TINY = torch.finfo(torch.float32).tiny


def check_density(density, who: str) -> float:
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(f"{who}: invalid density {density!r} (the share of entries to send, in (0, 1])")
    return float(density)


def check_refresh_every(refresh_every, who: str) -> int:
    if isinstance(refresh_every, bool) or not isinstance(refresh_every, int) or refresh_every < 1:
        raise ValueError(f"{who}: invalid refresh_every {refresh_every!r} (calls between threshold refreshes, an "
                         "int >= 1)")
    return refresh_every


class Sparsifier:
    """The threshold and residual of one flat fp32 tensor of `numel` elements.

    Args:
        numel (int): elements of the tensors it sparsifies.
        density (float): the share of entries the refreshed threshold lets through, in (0, 1].
        refresh_every (int): calls between threshold refreshes (the first call refreshes).
        residual (bool): keep what is not sent and add it to the next input (default: True).
        threshold (float, optional): a fixed threshold instead (never refreshed; 0 sends
            every nonzero entry) (default: None).
    """

    __slots__ = ("numel", "density", "refresh_every", "keep_residual", "fixed", "residual", "threshold", "steps",
                 "_sent_norm")

    def __init__(self, numel: int, density: float, refresh_every: int, *, residual: bool = True,
                 threshold: Optional[float] = None, device=None):
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or not 0 <= threshold < math.inf):
            raise ValueError(f"Sparsifier: invalid threshold {threshold!r} (a number >= 0, or None to refresh it)")
        self.numel = int(numel)
        self.density = check_density(density, "Sparsifier")
        self.refresh_every = check_refresh_every(refresh_every, "Sparsifier")
        self.keep_residual = bool(residual)
        self.fixed = None if threshold is None else float(threshold)
        self.residual = torch.zeros(self.numel, dtype=torch.float32, device=device) if residual else None
        self.threshold: Optional[float] = self.fixed  # None: refresh at the next call
        self.steps = 0
        self._sent_norm: Optional[Tensor] = None  # norm of the last committed call's values (0-dim float64)

    def due(self) -> bool:
        """The next call refreshes the threshold."""
        return self.fixed is None and (self.threshold is None or self.steps % self.refresh_every == 0)

    def select(self, x: Tensor, exclude: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, float]:
        """(acc, index, threshold): acc = residual + x (fp32, a new tensor; the state is not
        changed until `commit`), the ascending int64 positions to send, and the threshold
        used. `exclude`: positions never sent (nor kept: exact parameters)."""
        acc = x.reshape(-1).float()
        acc = acc + self.residual if self.residual is not None else acc.clone()
        mag = acc.abs()
        if exclude is not None:
            mag.index_fill_(0, exclude, 0.0)
        thr = self.threshold
        if self.due():
            k = math.ceil(self.density * (self.numel - (0 if exclude is None else exclude.numel())))
            thr = float(torch.topk(mag, k, sorted=False).values.min()) if k > 0 else math.inf
        index = (mag >= max(thr, _TINY)).nonzero().squeeze(1)
        return acc, index, thr

    def commit(self, acc: Tensor, index: Tensor, threshold: float, exclude: Optional[Tensor] = None,
               sent: Optional[Tensor] = None) -> None:
        """The call went through: what was not sent becomes the residual. `sent`: the values
        sent (acc at index), as gathered for the wire; their norm is kept for
        `last_sent_norm` (gathered here when not given)."""
        sent = acc.index_select(0, index) if sent is None else sent
        self._sent_norm = torch.linalg.vector_norm(sent, dtype=torch.float64)  # no device sync here
        if self.residual is not None:
            acc.index_fill_(0, index, 0.0)
            if exclude is not None:
                acc.index_fill_(0, exclude, 0.0)
            self.residual = acc
        self.threshold = threshold
        self.steps += 1

    @property
    def last_sent_norm(self) -> float:
        """L2 norm of the values the last committed call sent (the denominator of
        ``error_ratio``); 0.0 before the first one of this process, after `reset` and after
        `load_state_dict`."""
        return 0.0 if self._sent_norm is None else float(self._sent_norm)

    def reset(self) -> None:
        if self.residual is not None:
            self.residual.zero_()
        self.threshold, self.steps = self.fixed, 0
        self._sent_norm = None

    def state_dict(self) -> Dict[str, Any]:
        return {"residual": None if self.residual is None else self.residual.clone(), "threshold": self.threshold,
                "steps": self.steps}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        res = sd["residual"]
        if (res is None) != (self.residual is None) or (res is not None and res.numel() != self.numel):
            raise ValueError(f"Sparsifier.load_state_dict: a residual of {None if res is None else res.numel()} "
                             f"elements does not fit this sparsifier ({self.numel} elements, residual="
                             f"{self.keep_residual})")
        if res is not None:
            self.residual = res.to(self.residual.device, torch.float32, copy=True).reshape(-1)
        self.threshold = self.fixed if self.fixed is not None else sd["threshold"]
        self.steps = int(sd["steps"])
        self._sent_norm = None  # what was last sent belongs to the residual just replaced


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def pack(index: Tensor, values: Optional[Tensor], numel: int, ok: bool = True) -> Tensor:
    """One contribution: the int64 header (k, or -1 for not ok), the indices, the values
    (fp32; None: indices only)."""
    if not ok:
        return torch.tensor([-1], dtype=torch.int64, device=index.device).view(torch.uint8)
    head = torch.tensor([index.numel()], dtype=torch.int64, device=index.device).view(torch.uint8)
    parts = [head, index.to(index_dtype(numel)).view(torch.uint8)]
    if values is not None:
        parts.append(values.float().contiguous().view(torch.uint8))
    return torch.cat(parts)


def unpack(buf: Tensor, numel: int, values: bool = True) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """(index int64, values fp32 or None) of one contribution; None for a rank that was not ok."""
    k = int(buf[:8].view(torch.int64))
    if k < 0:
        return None
    isz = torch.empty(0, dtype=index_dtype(numel)).element_size()
    index = buf[8:8 + k * isz].view(index_dtype(numel)).long()
    vals = buf[8 + k * isz:8 + k * isz + 4 * k].view(torch.float32) if values else None
    return index, vals


class DCTReducer:
    """The DCT mean over the ranks of `transport` of flat tensors of `numel` elements: a
    `lbcomm.reducer.Reducer` with a `Sparsifier` (this rank's residual and threshold).

    ``reduce_(source, sink)``: sink <- (sum over ranks, in rank order, of the sparse
    contributions) / world size; source is left alone (sink may be source). A rank whose
    input holds NaN/Inf tells every rank through its header: the call is skipped on every
    rank with the residual untouched ("skip", returns False) or raises a NonFiniteError
    on every rank ("raise"). ``exclude(index)``: positions averaged elsewhere (exact
    parameters), never sent and never kept.

    ``bytes_per_call()`` is what the last call sent (it changes from call to call): what
    `all_gather_v` sends, the lengths and the contribution padded to the longest one.
    """

    def __init__(self, numel: int, transport, *, density: float, refresh_every: int, nonfinite: str = "skip",
                 device=None):
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"DCTReducer: invalid nonfinite {nonfinite!r} (use one of {NONFINITE_POLICIES})")
        self.numel = int(numel)
        self.transport = transport
        self.world_size, self.rank = transport.world_size, transport.rank
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.nonfinite = nonfinite
        self.sparsifier = Sparsifier(self.numel, density, refresh_every, device=self.device)
        self.excluded: Optional[Tensor] = None
        self.calls = self.skipped = 0
        self.last_skipped = False
        self.last_bytes = self.total_bytes = 0
        self.sent_entries = 0  # pairs this rank sent, over all calls
        self.offered_entries = 0  # entries it could have sent

    def exclude(self, index: Optional[Tensor]) -> None:
        self.excluded = None if index is None or index.numel() == 0 else index.to(self.device)

    # ------------------------------------------------------------------ the call
    def reduce_(self, source: Tensor, sink: Tensor, *, checked: bool = False, async_op: bool = False,
                weights: Optional[Tensor] = None, cap: Optional[Tensor] = None) -> bool:
        if async_op or weights is not None or cap is not None or not isinstance(source, Tensor):
            raise ValueError("DCTReducer.reduce_: tensors only, blocking, without weights or caps")
        if source.numel() != self.numel or sink.numel() != self.numel:
            raise ValueError(f"DCTReducer.reduce_: expected {self.numel} elements, got {source.numel()} -> "
                             f"{sink.numel()}")
        self.calls += 1
        sp, ex = self.sparsifier, self.excluded
        acc, index, thr = sp.select(source, ex)
        ok = bool(torch.isfinite(acc).all())
        mine = acc.index_select(0, index)
        parts = self.transport.all_gather_v(pack(index, mine, self.numel, ok))
        self.last_bytes = gather_v_bytes(parts)
        self.total_bytes += self.last_bytes
        got = [unpack(x, self.numel) for x in parts]
        self.last_skipped = any(g is None for g in got)
        if self.last_skipped:
            self.skipped += 1
            bad = [r for r, g in enumerate(got) if g is None]
            if self.nonfinite == "raise":
                raise NonFiniteError(f"dct: the input holds NaN or Inf on rank(s) {bad}; the residual is unchanged")
            return False
        out = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        for idx, vals in got:
            out.index_add_(0, idx, vals)
        sink.reshape(-1).copy_(out.div_(self.world_size))
        sp.commit(acc, index, thr, ex, sent=mine)
        self.sent_entries += index.numel()
        self.offered_entries += self.numel - (0 if ex is None else ex.numel())
        return True

    def bytes_per_call(self, checked: bool = False) -> int:
        return self.last_bytes

    # ------------------------------------------------------------------ state
    @property
    def worker_error(self) -> Tensor:
        """The residual (named as the 1-bit reducers' error feedback)."""
        return self.sparsifier.residual

    @property
    def server_error(self) -> Tensor:
        return self.sparsifier.residual.new_zeros(0)

    def zero_errors_at(self, index: Tensor) -> None:
        self.sparsifier.residual.index_fill_(0, index.to(self.device), 0.0)

    @property
    def last_sent_norm(self) -> float:
        """L2 norm of the values this rank sent in its last call that went through
        (`Sparsifier.last_sent_norm`); 0.0 before the first one of this process."""
        return self.sparsifier.last_sent_norm

    def reset(self) -> None:
        self.sparsifier.reset()

    def compression_stats(self) -> Dict[str, Any]:
        """The keys every lbcomm compressor reports (`lbcomm.common.STATS_KEYS`; ``error_norm``
        is the residual's, ``error_ratio`` that over `last_sent_norm`) and ``sent_fraction``
        (pairs sent / entries offered)."""
        done = self.calls - self.skipped
        err = float(self.sparsifier.residual.double().norm())
        return {"compressed_calls": done, "skipped_calls": self.skipped, "bytes_sent": self.total_bytes,
                "error_norm": err, "error_ratio": error_ratio(err, self.last_sent_norm),
                "sent_fraction": self.sent_entries / self.offered_entries if self.offered_entries else 0.0}

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": "dct", "numel": self.numel, "world_size": self.world_size, "rank": self.rank,
                "calls": self.calls, "skipped": self.skipped, "bytes_sent": self.total_bytes, "sent_entries": self.sent_entries,
                "offered_entries": self.offered_entries, **self.sparsifier.state_dict()}

    def load_state_dict(self, sd: Dict[str, Any]) -> bool:
        """Restore a `state_dict`; False (residual reset, warned) when it was saved for
        another size or world size (`redistribute` maps another world size)."""
        if sd.get("kind") != "dct":
            raise ValueError("DCTReducer.load_state_dict: not a DCTReducer state_dict")
        self.calls, self.skipped, self.total_bytes = int(sd["calls"]), int(sd["skipped"]), int(sd["bytes_sent"])
        self.sent_entries, self.offered_entries = int(sd["sent_entries"]), int(sd["offered_entries"])
        if (sd["numel"], sd["world_size"]) != (self.numel, self.world_size):
            _log.warning("dct: a residual saved for (numel, world size) = %s does not fit %s; it is reset to zero",
                         (sd["numel"], sd["world_size"]), (self.numel, self.world_size))
            self.reset()
            return False
        self.sparsifier.load_state_dict(sd)
        return True

    @classmethod
    def redistribute(cls, saved: Sequence[Dict[str, Any]], world_size: int, rank: int) -> Dict[str, Any]:
        """The state of `rank` in a world of `world_size` from every saved rank's (elastic
        resume). What the residuals carry into the mean is sum_r residual_r / p: every new
        rank holds the mean of the saved residuals, which keeps it (up to the rounding of
        the mean). The thresholds are per rank: they are refreshed at the next call."""
        old = len(saved)
        if not old or any(sd.get("kind") != "dct" or (sd["world_size"], sd["rank"], sd["numel"])
                          != (old, r, saved[0]["numel"]) for r, sd in enumerate(saved)):
            raise ValueError("DCTReducer.redistribute: pass every saved rank's state_dict of one tensor, in rank order")
        res = torch.stack([sd["residual"].double() for sd in saved]).mean(0).float()
        first = saved[0]
        return {**first, "world_size": world_size, "rank": rank, "residual": res, "threshold": None}


def gather_v_bytes(parts: List[Tensor]) -> int:
    """Bytes one rank sent in an `all_gather_v` that returned `parts`."""
    return (len(parts) - 1) * (8 + max(x.numel() for x in parts)) if len(parts) > 1 else 0
