"""`FaultTolerantLocalUpdates`: lbcomm's local updates (DiLoCo with the 1-bit
error-feedback outer exchange) over torchft, for training across the internet with
replica groups that leave and join without a restart (docs/internet.md).

Every replica group trains rounds of H (`sync_every`) inner steps on its own. Right after
a synchronization (the first round: at its first step) it asks torchft's Manager for the
next round's quorum (``start_quorum``: the Lighthouse decides which replica groups take
part, the Manager reconfigures its process group, one that is behind heals from a live
peer), so the members ask together, before the caller evaluates; at the round's end it averages
the outer pseudo-gradient over the quorum through lbcomm's compressed allreduce on that
group (`TorchFTTransport`: the one path to the network), and steps the outer Nesterov
optimizer only when the Manager agrees to commit (``should_commit``). A failed exchange (a
peer died during the round) is reported to the Manager and retried at once with a new
quorum from the same local progress (``max_attempts``); only when every attempt fails is
the round discarded (the parameters return to its start).

The error feedback across membership changes (docs/internet.md): a change is seen alike
from one all-gather per exchange; each member folds what it owed into a reducer for the new
quorum, e' = (p'/p) e + p' s (s on the span it served), s' = 0: the survivors' share is
carried exactly, a joining or healed member starts at zero, and an uncommitted attempt
restores its snapshot. tests/test_ft.py checks the invariant on the survivors.

``compress=False`` averages the pseudo-gradient with a plain fp32 allreduce over the same
group: torchft's DiLoCo exchange, for comparison. Parameters of at most
``comm.exact_numel`` elements are averaged exactly in fp32 beside the compressed call (their
error feedback held at zero), as in `lbcomm.OneBitLocalUpdates`.

The node topology (``local_group``, docs/internet.md): a replica group of G replicas (DDP
inside it) is a node; rank l exchanges only slice l of the pseudo-gradient with the ranks l
of the other groups (torchft's Manager joins exactly those), then the group all-gathers
the slices and takes their worst status, so a slice skipped anywhere skips the round in
every group. Each rank holds the error feedback of its slice only.

Not done here: streaming fragments and overlap. torchft is optional (imported when an object
is built); the Manager must have ``use_async_quorum=False``: every member takes part in every exchange.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import os
import struct
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from .comm import get_transport
from .common import ring_allreduce_bytes
from .compressed import CompressionState
from .config import CommConfig, resolve
from .exact import exact_index
from .reduce.topology import slice_spans

__all__ = ["FaultTolerantLocalUpdates", "require_torchft"]

_log = logging.getLogger(__name__)
_KEY = "lbcomm_local_updates"


def require_torchft():
    """The torchft module; a clear ImportError when it is not installed."""
    try:
        import torchft
    except ImportError as exc:
        raise ImportError("lbcomm.ft needs torchft (fault-tolerant replica groups): pip install torchft") from exc
    return torchft


def _members_hash(members: Optional[Tuple[int, ...]]) -> int:
    if members is None:
        return 0
    digest = hashlib.blake2b(struct.pack(f"<{len(members)}q", *members), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] or 1


class FaultTolerantLocalUpdates:
    """Local updates with the 1-bit error-feedback outer exchange over a torchft Manager:
    replica groups may leave and join between synchronizations (see the module docs).

    Call `step` right after ``inner.step()`` at every inner step; every `sync_every` steps
    it synchronizes with the round's quorum and returns True when the outer step committed.

    Args:
        params (iterable of Tensor): the parameters, the same set as `inner`'s.
        inner (torch.optim.Optimizer): the optimizer of the inner steps.
        sync_every (int): H, inner steps per round.
        manager: a ``torchft.Manager`` with ``use_async_quorum=False`` (its state-dict functions
            may be None: this object registers its state, weights included, as "lbcomm_local_updates").
        pg: the torchft process group given to the Manager (``Manager(pg=pg, ...)``).
        outer_lr (float): the outer SGD's learning rate (default: 0.7).
        outer_momentum (float): its momentum (default: 0.9).
        nesterov (bool, optional): default: Nesterov when ``outer_momentum > 0``.
        compress (bool): True: the 1-bit error-feedback allreduce; False: plain fp32
            (torchft's DiLoCo exchange) (default: True).
        comm (lbcomm.CommConfig, optional): ``block_size`` and ``exact_numel``; ``process_group``,
            a ``Topology`` and ``nonfinite="raise"`` are refused: the group is the Manager's
            `pg`, and a non-finite round is skipped on every member (default: CommConfig()).
        max_attempts (int): quorums tried per synchronization before the round is
            discarded (default: 3).
        trace (bool): keep the last exchange's input, output and errors in `last_trace` (tests).
        local_group (torch.distributed.ProcessGroup, optional): this replica group's ranks when
            it has several replicas (the node topology); required then, and checked.
    """

    def __init__(self, params: Iterable[Tensor], inner: torch.optim.Optimizer, sync_every: int, *, manager, pg,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: Optional[bool] = None,
                 compress: bool = True, comm: Optional[CommConfig] = None, max_attempts: int = 3,
                 trace: bool = False, local_group=None):
        require_torchft()
        name = type(self).__name__
        comm = resolve(comm, name)
        if comm.process_group is not None or comm.topology not in ("auto", "flat") or comm.nonfinite != "skip":
            raise ValueError(f"{name}: the exchange runs flat over the Manager's pg and skips a non-finite round; "
                             "leave comm's process_group, topology and nonfinite at their defaults")
        self.params: List[Tensor] = list(params)
        if not self.params:
            raise ValueError(f"{name}: got no parameters")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"{name}: invalid sync_every {sync_every!r} (an int >= 1: inner steps per round)")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"{name}: invalid max_attempts {max_attempts!r} (an int >= 1)")
        if {id(p) for g in inner.param_groups for p in g["params"]} != {id(p) for p in self.params}:
            raise ValueError(f"{name}: params must be exactly the inner optimizer's parameters")
        if not isinstance(compress, bool):
            raise TypeError(f"{name}: compress must be a bool (False: plain fp32 allreduce, DiLoCo itself)")
        self.inner, self.sync_every, self.compress = inner, sync_every, compress
        self.manager, self.pg = manager, pg
        self.block_size, self.max_attempts, self.trace = comm.block_size, max_attempts, trace
        nesterov = outer_momentum > 0 if nesterov is None else nesterov
        device = self.params[0].device
        self.anchor = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        self.numel = self.anchor.numel()
        self.outer = torch.optim.SGD([self.anchor], lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
        self._buf = torch.empty_like(self.anchor)
        self.local_group, self.local_size, lo, hi = local_group, 1, 0, self.numel
        if local_group is not None:
            self.local_size, lo, hi = self._check_local_group(name)
        elif self._replicated(None):  # each rank would exchange on its own group, and they would drift apart
            raise ValueError(f"{name}: the ranks of the default process group hold the same weights (data "
                             "parallelism inside the replica group); pass local_group=torch.distributed.group.WORLD")
        self._lo, self._n = lo, hi - lo  # this rank's slice of the pseudo-gradient
        self._exact = None
        if compress:
            ex = exact_index([p.numel() for p in self.params], comm.exact_numel, device=device)
            self._exact = ex[(ex >= lo) & (ex < hi)] - lo if ex is not None else None
        self.uid = struct.unpack("<q", os.urandom(8))[0] or 1  # this process: a restarted replica is a new member
        self._reducer: Optional[CompressionState] = None
        self._members: Optional[Tuple[int, ...]] = None  # the membership the error feedback belongs to
        self._owed: Optional[Tuple[int, int, Tensor, Tensor]] = None  # (p, rank, e, s) without a live reducer
        self._snapshot: Optional[Tuple[int, int, Tensor, Tensor, int]] = None  # before this attempt's call
        self._calls = 0
        self._dirty = False  # the last exchange failed: the next one rebuilds the reducer
        self._healed = False
        self._round: Optional[Dict[str, Any]] = None  # the current round's quorum and timings
        self.inner_steps = self.syncs = self.skipped = self.failed = self.heals = self.bytes_sent = 0
        self.last_sync: Dict[str, Any] = {}
        self.last_trace: Optional[Dict[str, Any]] = None
        manager.register_state_dict_fn(_KEY, self._load_peer_state, self._peer_state)

    @torch.no_grad()
    def step(self) -> bool:
        """Count one inner step; the quorum of a round at its first step (`_begin_round`), a
        synchronization every `sync_every` steps. True when an outer step was committed."""
        self.inner_steps += 1
        if self._round is None:
            self._begin_round()
            if self._healed:  # this step's work is replaced by the peer's state and counters
                return False
        if self.inner_steps % self.sync_every:
            return False
        return self.sync()

    def _begin_round(self) -> None:
        """The round's quorum, asked as the members leave the last synchronization together
        (asked later, one late by over the join timeout is left out); one behind heals here."""
        self._round = {"attempts": 0, "quorum_s": 0.0, "exchange_s": 0.0, "commit_s": 0.0, "healed": False,
                       "members": 0, "rebuilt": False}
        self._healed = False
        t0 = time.perf_counter()
        self.manager.start_quorum()
        self._round["quorum_s"] = time.perf_counter() - t0
        self._round["healed"] = self._healed

    @torch.no_grad()
    def sync(self) -> bool:
        """One synchronization in the round's quorum: exchange, commit, outer step; retried in
        a new quorum (where a member that is behind heals) when it fails. True when committed."""
        if self._round is None:  # sync() called outside step()
            self._begin_round()
        info, self._round = self._round, None
        self.last_sync = info
        for attempt in range(self.max_attempts):
            info["attempts"] = attempt + 1
            t0 = time.perf_counter()
            if attempt:  # a new quorum for the retry (a member that is behind heals here)
                self._healed = False
                self.manager.start_quorum()
            t1 = time.perf_counter()
            info["quorum_s"] += t1 - t0
            info["healed"] = info["healed"] or self._healed
            ok = self._exchange(info)
            t2 = time.perf_counter()
            info["exchange_s"] += t2 - t1
            commit = self.manager.should_commit()
            info["commit_s"] += time.perf_counter() - t2
            if commit:
                if ok:
                    self._outer_step()
                else:  # non-finite on some member: every member discards the round alike
                    self.skipped += 1
                    if self.local_size > 1:  # another slice skipped: this slice's call must not count either
                        self._restore()
                    _log.warning("%s: the outer pseudo-gradient holds NaN/Inf on some replica group at inner step "
                                 "%s; the round is discarded on every one", type(self).__name__, self.inner_steps)
                self._write()
                self.syncs += 1
                self._begin_round()
                return ok
            self.failed += 1
            self._restore()
            _log.warning("%s: synchronization at inner step %s not committed (attempt %s of %s: %s); retrying with a "
                         "new quorum", type(self).__name__, self.inner_steps, attempt + 1, self.max_attempts,
                         self.manager.errored())
        _log.warning("%s: no synchronization committed in %s attempts at inner step %s; the round is discarded "
                     "(weights back to its start)", type(self).__name__, self.max_attempts, self.inner_steps)
        self._write()
        self._begin_round()
        return False

    def _restore(self) -> None:
        """Back to what was owed before the uncounted call; every member then rebuilds."""
        self._dirty = True
        if self._snapshot is not None:
            self._owed, self._calls, self._reducer = self._snapshot[:4], self._snapshot[4], None

    def _delta_(self) -> Tensor:
        """Δ = θ_start − θ into the buffer (compressed: u = β b + Δ, the outer momentum)."""
        buf = self._buf
        torch.cat([p.detach().reshape(-1).float() for p in self.params], out=buf)
        torch.sub(self.anchor, buf, out=buf)
        beta, mom = self._momentum()
        if mom is not None:
            buf.add_(mom, alpha=beta)
        return buf

    def _momentum(self) -> Tuple[float, Optional[Tensor]]:
        beta = self.outer.param_groups[0]["momentum"]
        if not (beta and self.compress):
            return beta, None
        return beta, self.outer.state.get(self.anchor, {}).get("momentum_buffer")

    def _exchange(self, info: Dict[str, Any]) -> bool:
        """The mean of Δ (or u) over the quorum into the buffer (a local group: this rank's slice,
        then the group's all-gather). False: non-finite on some member, or a failed exchange
        (reported to the Manager, whose should_commit then refuses)."""
        buf = self._delta_()
        x = buf[self._lo:self._lo + self._n]
        # the anchors of a group's ranks must agree: a sample of them (a few microseconds)
        check = int(self.anchor[::997].view(torch.int32).sum(dtype=torch.int64)) if self.local_size > 1 else 0
        status = self._exchange_slice(x, info)
        if self.local_size > 1:
            status = self._gather(buf, status, check)
        return status == 1

    def _exchange_slice(self, x: Tensor, info: Dict[str, Any]) -> int:
        """The mean of this rank's slice over the quorum, in place: 1 done, 0 non-finite
        on some member, -1 the exchange failed."""
        from .comm.torchft import TorchFTTransport
        p, rank = self.manager.num_participants(), self.manager.participating_rank()
        info["members"] = p
        if rank is None:
            raise RuntimeError(f"{type(self).__name__}: this replica group is not part of the quorum; create the "
                               "torchft Manager with use_async_quorum=False")
        self._snapshot = None
        if not self._n:  # an empty slice (a model smaller than the group): nothing to send
            return 1
        try:
            xport = TorchFTTransport(self.pg, rank, p)
            if not self.compress:
                xport.all_reduce(x, "mean")
                self.bytes_sent += int(ring_allreduce_bytes(4 * self._n, p))
                return int(bool(torch.isfinite(x).all()))
            if p == 1:  # alone: nothing to average, the error feedback waits for company
                return int(bool(torch.isfinite(x).all()))
            info["rebuilt"] = self._agree_members(xport)
            red = self._reducer
            self._snapshot = (red.world_size, red.rank, red.worker_error.clone(), red.server_error.clone(), red.calls)
            if self.trace:
                self.last_trace = {"x": x.clone(), "e0": red.worker_error[:self._n].clone(),
                                   "s0": red.server_error.clone(), "span": red.served_span(),
                                   "members": self._members, "rebuilt": info["rebuilt"]}
            exact = None
            if self._exact is not None:
                vals = x.index_select(0, self._exact)
                gathered = vals.new_empty(p * vals.numel())
                xport.all_gather(gathered.view(torch.uint8), vals.view(torch.uint8))
                exact = gathered.view(p, -1).sum(0) / p
            ok = bool(red.reduce_(x, x))
            self._calls = red.calls
            if ok:
                if exact is not None:
                    x.index_copy_(0, self._exact, exact)
                    red.zero_errors_at(self._exact)
                self.bytes_sent += red.bytes_per_call() + (4 * self._exact.numel() * (p - 1)
                                                           if self._exact is not None else 0)
                if self.trace:
                    self.last_trace.update(out=x.clone(), e1=red.worker_error[:self._n].clone(),
                                           s1=red.server_error.clone())
            return int(ok)
        except Exception as exc:  # noqa: BLE001 - a peer left: handed to the Manager
            _log.warning("%s: the exchange failed (%s: %s); reported to the torchft Manager", type(self).__name__,
                         type(exc).__name__, exc)
            self.manager.report_error(exc)
            return -1

    def _replicated(self, group) -> bool:
        """Whether `group`'s ranks (None: the default group, if there is one of several
        ranks) hold the same weights, compared by a hash."""
        import torch.distributed as dist
        if group is None and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        digest = hashlib.blake2b(self.anchor.cpu().numpy().tobytes(), digest_size=8).digest()
        mine = torch.tensor([struct.unpack("<q", digest)[0], self.numel], dtype=torch.int64, device=self.anchor.device)
        xport = get_transport(group)
        every = mine.new_empty(xport.world_size, 2)
        xport.all_gather(every.view(torch.uint8), mine.view(torch.uint8))
        return bool((every == mine).all())

    def _check_local_group(self, name: str) -> Tuple[int, int, int]:
        """(G, lo, hi): the group's size and this rank's slice; checks the weights agree."""
        import torch.distributed as dist
        size, rank = dist.get_world_size(self.local_group), dist.get_rank(self.local_group)
        if not self._replicated(self.local_group):
            raise ValueError(f"{name}: the ranks of local_group hold different weights; they must be replicas "
                             "(data parallelism inside the replica group) for the node topology")
        self._spans, self._local_xport = slice_spans(self.numel, size), get_transport(self.local_group)
        lo, hi = self._spans[rank]
        return size, lo, hi

    def _gather(self, buf: Tensor, status: int, check: int) -> int:
        """The G averaged slices (statuses, anchors' checksums) into the buffer; the worst
        status. Raises if the ranks' anchors differ (healed from peers that were not replicas)."""
        spans = self._spans
        width = spans[0][1] - spans[0][0]
        mine = buf.new_zeros(3 + width)  # checksum (int64 in two floats), status, slice
        mine[:2].view(torch.int64)[0] = check
        mine[2] = status
        mine[3:3 + self._n] = buf[self._lo:self._lo + self._n]
        every = buf.new_empty(len(spans), 3 + width)
        self._local_xport.all_gather(every.view(torch.uint8), mine.view(torch.uint8))
        if bool((every[:, :2].contiguous().view(torch.int64) != check).any()):
            raise RuntimeError(f"{type(self).__name__}: the ranks of this replica group hold different models at "
                               f"inner step {self.inner_steps}; every replica group must start from the same "
                               "weights (torchft heals each rank of a group from its own peer)")
        for (lo, hi), row in zip(spans, every):
            buf[lo:hi] = row[3:3 + hi - lo]
        return int(every[:, 2].min())

    def _agree_members(self, xport) -> bool:
        """One all-gather of (id, membership of the error feedback, calls, failed); on a change
        each member rebuilds its reducer and folds what it owed into it. True when rebuilt."""
        p = xport.world_size
        red = self._reducer
        calls = red.calls if red is not None else self._calls
        mine = torch.tensor([self.uid, _members_hash(self._members), calls,
                             int(self._dirty or red is None)], dtype=torch.int64, device=self.anchor.device)
        everyone = mine.new_empty(p * 4)
        xport.all_gather(everyone.view(torch.uint8), mine.view(torch.uint8))
        rows = everyone.view(p, 4).tolist()
        members = tuple(r[0] for r in rows)
        same = all(r[1] == _members_hash(members) and r[2] == rows[0][2] and not r[3] for r in rows)
        if same and red is not None:
            return False
        owed = (red.world_size, red.rank, red.worker_error, red.server_error) if red is not None else self._owed
        new = CompressionState(self._n, transport=xport, device=self.anchor.device, block_size=self.block_size,
                               nonfinite="skip")
        if owed is not None and not self._healed:
            old_p, old_rank, e, s = owed
            n = self._n
            e_new = new.worker_error
            e_new[:n].copy_(e[:n]).mul_(p / old_p)
            lo = min(n, old_rank * s.numel())
            hi = min(n, lo + s.numel())
            e_new[lo:hi].add_(s[:hi - lo], alpha=p)
        new.calls = max(r[2] for r in rows)
        _log.info("%s: membership changed (%s members, this one rank %s): error feedback folded into the new "
                  "reducer%s", type(self).__name__, p, xport.rank, " (healed: starts at zero)" if self._healed else "")
        self._reducer, self._members, self._owed, self._dirty = new, members, None, False
        return True

    def _outer_step(self) -> None:
        buf = self._buf
        beta, mom = self._momentum()
        if mom is not None:
            buf.sub_(mom, alpha=beta)
        self.anchor.grad = buf
        self.outer.step()
        self.anchor.grad = None

    def _write(self) -> None:
        """θ <- θ_start, the committed model (identical on every member)."""
        for p, v in zip(self.params, self.anchor.split([p.numel() for p in self.params])):
            p.detach().copy_(v.view_as(p))

    def _peer_state(self) -> Dict[str, Any]:
        """What a healing replica group receives from this one (copies: the Manager
        serves them while this one goes on)."""
        return {"anchor": self.anchor.detach().clone(), "outer": copy.deepcopy(self.outer.state_dict()),
                "inner": copy.deepcopy(self.inner.state_dict()), "params": [p.detach().clone() for p in self.params],
                "counters": {"inner_steps": self.inner_steps, "syncs": self.syncs, "skipped": self.skipped,
                             "calls": self._reducer.calls if self._reducer is not None else self._calls}}

    def _load_peer_state(self, sd: Dict[str, Any]) -> None:
        """Heal from a live peer: its anchor, outer momentum, inner state and weights; the
        error feedback starts at zero (module docs)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            self.anchor.copy_(sd["anchor"])
            for p, v in zip(self.params, sd["params"]):
                p.detach().copy_(v)
        self.outer.load_state_dict(sd["outer"])
        self.inner.load_state_dict(sd["inner"])
        c, was = sd["counters"], self.syncs  # was nonzero: left out of a round, not (re)started
        self.inner_steps, self.syncs, self.skipped = c["inner_steps"], c["syncs"], c["skipped"]
        self._calls = c["calls"]
        self._reducer, self._members, self._owed, self._dirty = None, None, None, True
        self._healed = True
        self.heals += 1
        (self._round if self._round is not None else self.last_sync)["heal_apply_s"] = time.perf_counter() - t0
        _log.log(logging.WARNING if was else logging.INFO, "%s: healed from a live peer at inner step %s%s",
                 type(self).__name__, self.inner_steps, " after being left out of a round (its work is lost; if it "
                 "repeats, set the Lighthouse's join_timeout_ms above a round and what runs after one)" * bool(was))

    def error_feedback(self) -> Optional[Dict[str, Any]]:
        """This member's error feedback: worker error (its first numel elements), server error,
        the span it serves and the membership; None before the first compressed exchange."""
        red = self._reducer
        if red is None:
            return None
        return {"worker_error": red.worker_error[:self._n].clone(), "server_error": red.server_error.clone(),
                "span": red.served_span(), "members": self._members}

    def stats(self) -> Dict[str, Any]:
        """Counters: inner steps, committed synchronizations, discarded (non-finite) ones,
        failed attempts, heals, bytes this member sent."""
        return {"inner_steps": self.inner_steps, "syncs": self.syncs, "skipped": self.skipped, "failed": self.failed,
                "heals": self.heals, "bytes_sent": self.bytes_sent}
