"""`OneBitLocalUpdates`: local updates with 1-bit compressed outer pseudo-gradients
(DiLoCo-style training; the algorithm and its choices in docs/local-updates.md).

Every rank takes H (`sync_every`) steps of its own optimizer (the *inner* one) without
communicating; then the outer pseudo-gradient Δ = θ_start − θ_local is averaged and an outer
Nesterov SGD steps the anchor θ_start with it, as in DiLoCo. Compressed, each rank sends the
outer momentum it would take, u = β b + Δ (b identical on every rank), through one lbcomm
reducer per fragment (`make_reducer`: flat, or hierarchical on nodes), whose error buffers
persist across rounds (the error-feedback invariant holds over the run), and the mean Δ is
mean(u) − β b. Every rank then continues from the same new θ (bitwise identical replicas).
``compress=False`` averages Δ in fp32: DiLoCo itself, the same code.

``fragments=K`` (Streaming DiLoCo, `lbcomm.fragments`) synchronizes K runs of parameters at
staggered inner steps; ``overlap=k`` runs each synchronization in the background while the
next k inner steps train, then applies it keeping their progress. Parameters of at most
``comm.exact_numel`` elements are averaged exactly beside the compressed call.

Never silent: gradients identical on every rank at the first inner steps (a DDP averaging
them every step) raise `AveragedGradientsError` (``comm.detect_averaged_grads``); a
non-finite Δ follows ``comm.nonfinite``: "skip" discards the round on every rank (counted in
``skipped_calls``), "raise" does the same and raises `NonFiniteError` on every rank.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

import torch
from torch import Tensor

from .comm import get_transport
from .common import NonFiniteError, compressor_stats, error_ratio, ring_allreduce_bytes
from .config import CommConfig, resolve
from .ddp.worker import BucketWorker
from .errors import AveragedGradientsError
from .exact import ExactMean, exact_index
from .fragments import Fragment, ceil_div, check_args, fragment_bounds
from .optim.agree import replica_slots, replicas_identical
from .reducer import make_reducer, redistribute, resolve_topology

__all__ = ["OneBitLocalUpdates", "fragment_bounds"]

_log = logging.getLogger(__name__)
_FORMAT = "lbcomm-local-updates"
_VERSION = 1


class OneBitLocalUpdates:
    """Local updates (DiLoCo) with 1-bit error-feedback compressed outer pseudo-gradients.

    Call `step` right after ``inner.step()`` at every inner step; it synchronizes every
    `sync_every` steps and returns True on those steps.

    Args:
        params (iterable of Tensor): the parameters, the same set as `inner`'s. Create this
            object after the model's weights are loaded (the first anchor is taken here) and
            identical on every rank.
        inner (torch.optim.Optimizer): the per-rank optimizer of the inner steps (its state
            stays local, as in DiLoCo).
        sync_every (int): H, inner steps per round.
        outer_lr (float): the outer SGD's learning rate (default: 0.7, DiLoCo's, made for
            rounds of hundreds of steps; for short rounds plain averaging,
            ``outer_lr=1.0, outer_momentum=0.0``, often suits them better: docs/local-updates.md).
        outer_momentum (float): its momentum (default: 0.9).
        nesterov (bool, optional): Nesterov momentum (default: None, Nesterov when
            ``outer_momentum > 0``; ``outer_lr=1.0, outer_momentum=0.0`` is then plain
            averaging of the replicas, local SGD).
        compress (bool): True: Δ through the compressed allreduce; False: a plain fp32
            allreduce (DiLoCo itself) (default: True).
        fragments (int): synchronize the model in this many staggered fragments
            (Streaming DiLoCo); 1 <= fragments <= sync_every (default: 1).
        overlap (int): 0: a synchronization finishes inside the `step` that starts it.
            k >= 1 (< sync_every): it runs on a background thread (flat: on a private
            duplicate of the process group) while the next k inner steps train, and is
            applied after the k-th of them, keeping their local progress
            (θ <- θ + θ_start_new − θ_sent); one more fragment-sized buffer (default: 0).
        comm (CommConfig, optional): process group, backend, topology, block size,
            exact_numel, non-finite policy, detect_averaged_grads (default: ``CommConfig()``).

    Example::

        >>> # xdoctest: +SKIP
        >>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> local = lbcomm.OneBitLocalUpdates(model.parameters(), inner, sync_every=32)
        >>> for x, y in loader:
        ...     inner.zero_grad(); loss_fn(model(x), y).backward(); inner.step()
        ...     local.step()
    """

    def __init__(self, params: Iterable[Tensor], inner: torch.optim.Optimizer, sync_every: int, *,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: Optional[bool] = None,
                 compress: bool = True, fragments: int = 1, overlap: int = 0,
                 comm: Optional[CommConfig] = None):
        name = type(self).__name__
        self.comm = resolve(comm, name)
        self.params: List[Tensor] = list(params)
        nesterov = outer_momentum > 0 if nesterov is None else nesterov
        check_args(name, self.params, inner, sync_every, outer_lr, outer_momentum, nesterov, compress, fragments)
        if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap < sync_every:
            raise ValueError(f"{name}: invalid overlap {overlap!r} (an int, 0 <= overlap < sync_every={sync_every}: "
                             "inner steps a synchronization runs behind the training)")
        self.inner, self.sync_every, self.compress, self.overlap = inner, sync_every, compress, overlap
        self.transport = get_transport(self.comm.process_group, backend=self.comm.backend)
        self.world_size, self.rank = self.transport.world_size, self.transport.rank
        # overlap: the synchronizations' collectives run on a worker thread, on their own group
        self._worker = BucketWorker(self.comm.process_group) if overlap and self.world_size > 1 else None
        self._xport = self._worker.transport if self._worker is not None else self.transport
        topo = resolve_topology(self.comm) if compress and self.world_size > 1 else None
        if topo is not None and topo.world_size != self.world_size:
            raise ValueError(f"{name}: the topology spans {topo.world_size} ranks but the process group has "
                             f"{self.world_size}")
        self.topology = None if topo is None or topo.flat else topo
        device = self.params[0].device
        numels = [p.numel() for p in self.params]
        bounds = fragment_bounds(numels, fragments)
        self.fragments: List[Fragment] = []
        for f in range(fragments):
            lo, hi = bounds[f], bounds[f + 1]
            anchor = torch.cat([p.detach().reshape(-1).float() for p in self.params[lo:hi]]).to(device)
            frag = Fragment(lo, hi, ceil_div((f + 1) * sync_every, fragments) % sync_every, anchor,
                             torch.empty_like(anchor))
            if compress:
                frag.reducer = make_reducer(anchor.numel(), self.comm, device=device, topology=self.topology,
                                            transport=self._worker.transport if self._worker is not None else None)
                frag.exact = exact_index(numels[lo:hi], self.comm.exact_numel, device=device)
            self.fragments.append(frag)
        self.outer = torch.optim.SGD([f.anchor for f in self.fragments], lr=outer_lr, momentum=outer_momentum,
                                     nesterov=nesterov)
        self._exact_mean = ExactMean(topology=self.topology) if self.topology is not None else None
        self.inner_steps = 0
        self.syncs = 0  # fragment synchronizations done, skipped ones included
        self.skipped = 0
        self.bytes_sent = 0
        self._probe = self.comm.detect_averaged_grads and self.world_size > 1
        if self.world_size == 1:
            _log.info("%s: one rank, nothing is communicated (the outer optimizer still steps every %s inner "
                      "steps)", name, sync_every)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> bool:
        """Count one inner step (call it right after ``inner.step()``); synchronize the
        fragments due at this step. Returns True when a synchronization happened."""
        self.inner_steps += 1
        if self._probe:
            self._probe_averaged_grads()
        done = False
        for frag in self.fragments:  # those started `overlap` steps ago
            if frag.due == self.inner_steps:
                self._finish(frag)
                done = True
        for frag in self.fragments:
            if self.inner_steps % self.sync_every == frag.phase:
                self._start(frag)
                if not self.overlap:
                    self._finish(frag)
                    done = True
        return done

    @torch.no_grad()
    def flush(self) -> bool:
        """Apply every synchronization still in flight (overlap) now, before its step: at
        the end of training, so that the last one is not lost. True if one was applied."""
        pending = [f for f in self.fragments if f.due is not None]
        for frag in pending:
            self._finish(frag)
        return bool(pending)

    @contextlib.contextmanager
    def at_anchor(self) -> Iterator[None]:
        """Inside the block the parameters hold θ_start, the model of the last applied
        synchronization: the same on every rank, where the trained weights differ (between
        synchronizations, and with overlap always). Evaluate it there; the weights are
        restored on exit."""
        kept = [p.detach().clone() for p in self.params]
        try:
            with torch.no_grad():
                for frag in self.fragments:
                    for p, a in self._views(frag, frag.anchor):
                        p.copy_(a)
            yield
        finally:
            with torch.no_grad():
                for p, k in zip(self.params, kept):
                    p.copy_(k)

    def _probe_averaged_grads(self) -> None:
        """Gradients identical on every rank: a DDP averaged them (one tiny allreduce per
        inner step until decided, at most the first round)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        slots = replica_slots(grads, self.rank, self.world_size, self.fragments[0].anchor.device)
        self.transport.all_reduce(slots, "sum")
        verdict = replicas_identical(slots)
        if verdict:
            raise AveragedGradientsError(
                f"{type(self).__name__}: at inner step {self.inner_steps} the gradients are identical on all "
                f"{self.world_size} ranks: something averages them every step (a DistributedDataParallel wrapper, "
                "or a communication hook), so the local updates would be averaged twice and nothing is saved. Train "
                "the plain module (not the DDP wrapper), or call backward inside ddp_model.no_sync(). If every rank "
                "really sees the same data, pass comm=lbcomm.CommConfig(detect_averaged_grads=False).")
        if verdict is not None or self.inner_steps >= self.sync_every:
            self._probe = False

    def _start(self, frag: Fragment) -> None:
        """Δ of `frag` (compressed: the outer momentum u = β b + Δ it would take) and its
        mean over the ranks: now, or on the worker thread with overlap."""
        for p, d in self._views(frag, frag.delta):
            d.copy_(p)
        if self.overlap:
            if frag.sent is None:
                frag.sent = torch.empty_like(frag.delta)
            frag.sent.copy_(frag.delta)
        torch.sub(frag.anchor, frag.delta, out=frag.delta)
        self.syncs += 1
        frag.due = self.inner_steps + self.overlap
        # What is compressed is the outer momentum this rank would take, u = β b + Δ (b: the
        # momentum buffer, identical on every rank), not Δ itself: u changes little from round
        # to round, so its signs and block scales carry more of it than Δ's; the mean Δ that
        # the outer SGD takes as its gradient is then mean(u) − β b (in `_finish`).
        beta, buf = self._momentum(frag)
        if buf is not None:
            frag.delta.add_(buf, alpha=beta)

        def run(_buf: Tensor) -> None:
            try:
                frag.result = self._mean_(frag)
            except NonFiniteError as exc:  # raised on every rank alike: handed to `_finish`
                frag.result = exc

        if self._worker is None:
            run(frag.delta)
        else:
            frag.future = self._worker.submit(frag.delta, run)

    def _finish(self, frag: Fragment) -> None:
        """The outer step with the mean Δ of `frag`, and the new θ on every rank (with
        overlap: plus each rank's local progress since the synchronization started)."""
        if frag.future is not None:
            frag.future.wait()
        result, frag.result, frag.future, frag.due = frag.result, None, None, None
        if isinstance(result, NonFiniteError):
            self.skipped += 1
            self._write(frag)
            raise result
        if not result:
            self.skipped += 1
            self._write(frag)  # the round is discarded on every rank alike
            if self.comm.nonfinite == "raise":
                raise NonFiniteError(f"{type(self).__name__}: the outer pseudo-gradient holds NaN/Inf on some rank "
                                     f"at inner step {self.inner_steps - self.overlap}; every rank returned to the "
                                     "round's start")
            _log.warning("%s: the outer pseudo-gradient holds NaN/Inf on some rank at inner step %s; the round is "
                         "skipped on every rank (parameters back to its start, momentum and error feedback "
                         "untouched)", type(self).__name__, self.inner_steps - self.overlap)
            return
        beta, buf = self._momentum(frag)  # unchanged since `_start`: only this fragment's outer step moves it
        if buf is not None:
            frag.delta.sub_(buf, alpha=beta)
        for f in self.fragments:
            f.anchor.grad = frag.delta if f is frag else None
        self.outer.step()
        frag.anchor.grad = None
        self._write(frag)

    def _mean_(self, frag: Fragment) -> bool:
        """Δ's (or u's) mean over the ranks in place; False (on every rank alike) when not
        finite. Runs on the worker thread with overlap: collectives on `_xport` only."""
        delta = frag.delta
        if not self.compress:
            self._xport.all_reduce(delta, "mean")
            self.bytes_sent += int(ring_allreduce_bytes(4 * delta.numel(), self.world_size))
            return bool(torch.isfinite(delta).all())
        exact = None
        if frag.exact is not None and self.world_size > 1:
            exact = self._exact_part_mean(delta.index_select(0, frag.exact))
        ok = frag.reducer.reduce_(delta, delta)
        if ok:
            self.bytes_sent += self._frag_bytes(frag)
            if exact is not None:
                delta.index_copy_(0, frag.exact, exact)
                frag.reducer.zero_errors_at(frag.exact)
        return bool(ok)

    def _exact_part_mean(self, values: Tensor) -> Tensor:
        """The exact fp32 mean of the exact coordinates' Δ: on nodes `hierarchical_mean_`
        (1/G of the bytes between nodes); flat, every rank's values gathered and summed in
        rank order, so that the result does not depend on the backend's summation order."""
        if self.topology is not None:
            return self._exact_mean.start(values)()
        p, k = self.world_size, values.numel()
        gathered = torch.empty(p * k * 4, dtype=torch.uint8, device=values.device)
        self._xport.all_gather(gathered, values.view(torch.uint8))
        return gathered.view(torch.float32).view(p, k).sum(0) / p

    def _write(self, frag: Fragment) -> None:
        """θ of `frag` <- θ_start; with overlap θ <- θ + (θ_start − θ_sent): the local
        steps since the synchronization started are kept."""
        if self.overlap:
            torch.sub(frag.anchor, frag.sent, out=frag.sent)
            for p, c in self._views(frag, frag.sent):
                p.add_(c)
        else:
            for p, a in self._views(frag, frag.anchor):
                p.copy_(a)

    def _views(self, frag: Fragment, flat: Tensor) -> Iterator[tuple]:
        """(parameter, its slice of the fragment-sized `flat` shaped like it), in order."""
        o = 0
        for p in self.params[frag.lo:frag.hi]:
            n = p.numel()
            yield p.detach(), flat[o:o + n].view_as(p)
            o += n

    def _momentum(self, frag: Fragment) -> tuple:
        """(β, the outer momentum buffer b of `frag`) when u = β b + Δ is what is compressed;
        b is None in the first round, without momentum and uncompressed."""
        beta = self.outer.param_groups[0]["momentum"]
        if not (beta and self.compress):
            return beta, None
        return beta, self.outer.state.get(frag.anchor, {}).get("momentum_buffer")

    # ------------------------------------------------------------------ figures
    def _frag_bytes(self, frag: Fragment) -> int:
        n = frag.anchor.numel()
        if not self.compress:
            return int(ring_allreduce_bytes(4 * n, self.world_size))
        exact = 0
        if frag.exact is not None and self.world_size > 1:
            k = frag.exact.numel()
            exact = self._exact_mean.bytes(k) if self.topology is not None else 4 * k * (self.world_size - 1)
        return frag.reducer.bytes_per_call() + exact

    def bytes_per_sync(self) -> int:
        """Bytes this rank sends per round of `sync_every` inner steps (every fragment once;
        between nodes for a hierarchical reduction)."""
        return sum(self._frag_bytes(f) for f in self.fragments)

    def bytes_per_inner_step(self) -> float:
        """`bytes_per_sync` / sync_every: compare with a fp32 ring allreduce of the
        gradients per step (`fp32_bytes_per_step`)."""
        return self.bytes_per_sync() / self.sync_every

    def fp32_bytes_per_step(self) -> int:
        """What data-parallel training's fp32 ring allreduce of every gradient sends per step."""
        return int(ring_allreduce_bytes(4 * sum(f.anchor.numel() for f in self.fragments), self.world_size))

    def compression_stats(self) -> Dict[str, Any]:
        """The keys every lbcomm compressor reports (`lbcomm.common.STATS_KEYS`): compressed
        synchronizations, skipped ones (non-finite Δ), bytes this rank sent (the exact part
        included), the norm of its error feedback and ``error_ratio``, that norm over the
        root-sum-square of what each fragment's reducer last sent (its ``last_sent_norm``; 0.0
        before the first compressed synchronization and without compression); plus inner
        steps, synchronizations and the bytes per sync and per inner step."""
        reducers = [f.reducer for f in self.fragments if f.reducer is not None]
        err = math.sqrt(sum(compressor_stats(r)["error_norm"] ** 2 for r in reducers))
        sent = math.sqrt(sum(r.last_sent_norm ** 2 for r in reducers))
        done = self.syncs - self.skipped
        return {"compressed_calls": done if self.compress else 0, "skipped_calls": self.skipped,
                "bytes_sent": self.bytes_sent, "error_norm": err, "error_ratio": error_ratio(err, sent),
                "inner_steps": self.inner_steps, "syncs": self.syncs, "bytes_per_sync": self.bytes_per_sync(),
                "bytes_per_inner_step": self.bytes_per_inner_step(),
                "fp32_bytes_per_step": self.fp32_bytes_per_step()}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """This rank's state: the anchors θ_start, the outer optimizer (momentum), each
        fragment's reducer error feedback (rank-local: save every rank's, e.g. with
        ``lbcomm.save_sharded(dir, inner, model, hook_state=local)``), the counters and, with
        overlap, the synchronizations in flight (waited for first)."""
        in_flight = [self._in_flight_state(f) for f in self.fragments]  # first: then no reducer is busy
        return {"format": _FORMAT, "version": _VERSION, "world_size": self.world_size, "rank": self.rank,
                "sync_every": self.sync_every, "compress": self.compress,
                "numels": [f.anchor.numel() for f in self.fragments],
                "anchors": [f.anchor.detach().clone() for f in self.fragments],
                "outer": copy.deepcopy(self.outer.state_dict()),  # a snapshot, like the anchors
                "reducers": [None if f.reducer is None else f.reducer.state_dict() for f in self.fragments],
                "inner_steps": self.inner_steps, "syncs": self.syncs, "skipped": self.skipped,
                "bytes_sent": self.bytes_sent, "probe": self._probe, "overlap": self.overlap,
                "in_flight": in_flight}

    def _in_flight_state(self, frag: Fragment) -> Optional[Dict[str, Any]]:
        """A synchronization started and not yet applied (overlap): waited for, and saved
        with its mean and θ_sent, so that the resumed run applies it at the same step."""
        if frag.due is None:
            return None
        if frag.future is not None:
            frag.future.wait()
            frag.future = None
        res = frag.result
        return {"due": frag.due, "sent": frag.sent.detach().clone(), "mean": frag.delta.detach().clone(),
                "result": str(res) if isinstance(res, NonFiniteError) else bool(res)}  # str: the error raised

    def load_state_dict(self, state_dict: Dict[str, Any], *,
                        all_ranks: Optional[Sequence[Dict[str, Any]]] = None) -> bool:
        """Restore a `state_dict`: bitwise the run that never stopped with the same world.
        Returns True when the error feedback carries into this run, False when reset.

        Saved with another world size (elastic resume), pass ``all_ranks``: every saved
        rank's state_dict in rank order (`lbcomm.load_sharded` with ``hook_state=`` does);
        each fragment's error feedback is then redistributed onto this world
        (`lbcomm.reducer.redistribute`, total carried error preserved; hierarchical ones
        start from zero, warned). Without it the error feedback is reset, warned."""
        name = type(self).__name__
        sd = state_dict
        if not isinstance(sd, dict) or sd.get("format") != _FORMAT or sd.get("version") != _VERSION:
            raise ValueError(f"{name}.load_state_dict: not a {name} state_dict of version {_VERSION}")
        mine = (self.sync_every, self.compress, [f.anchor.numel() for f in self.fragments], self.overlap)
        saved = (sd["sync_every"], sd["compress"], sd["numels"], sd.get("overlap", 0))
        if saved != mine:
            raise ValueError(f"{name}.load_state_dict: saved for (sync_every, compress, fragment sizes, overlap)="
                             f"{saved} but this object has {mine}")
        if any(f.due is not None for f in self.fragments):
            raise RuntimeError(f"{name}.load_state_dict: a synchronization is in flight; load before training")
        reducers = sd["reducers"]
        if sd["world_size"] != self.world_size and self.compress:
            if all_ranks is None:
                _log.warning("%s: the state was saved with world size %s and this run has %s; the compression error "
                             "feedback is reset to zero (pass all_ranks=, or use lbcomm.load_sharded(dir, "
                             "hook_state=...), to redistribute it)", name, sd["world_size"], self.world_size)
                reducers = [None] * len(self.fragments)
            else:
                if len(all_ranks) != sd["world_size"] or any(s.get("inner_steps") != sd["inner_steps"]
                                                              for s in all_ranks):
                    raise ValueError(f"{name}.load_state_dict: all_ranks must hold the state_dicts of all "
                                     f"{sd['world_size']} saved ranks of one checkpoint, in rank order")
                reducers = [redistribute([s["reducers"][k] for s in all_ranks], self.world_size, self.rank,
                                         where=f"{name} fragment {k}") for k in range(len(self.fragments))]
        carried = True
        for frag, anchor, red in zip(self.fragments, sd["anchors"], reducers):
            frag.anchor.copy_(anchor)
            if frag.reducer is not None:
                frag.reducer.reset()
                carried = red is not None and frag.reducer.load_state_dict(red) and carried
        self.outer.load_state_dict(sd["outer"])
        for frag, fl in zip(self.fragments, sd.get("in_flight") or [None] * len(self.fragments)):
            if fl is None:
                continue
            if frag.sent is None:
                frag.sent = torch.empty_like(frag.delta)
            frag.sent.copy_(fl["sent"])
            frag.delta.copy_(fl["mean"])
            frag.due = int(fl["due"])
            frag.result = NonFiniteError(fl["result"]) if isinstance(fl["result"], str) else fl["result"]
        self.inner_steps, self.syncs, self.skipped = sd["inner_steps"], sd["syncs"], sd["skipped"]
        self.bytes_sent = sd["bytes_sent"]
        self._probe = bool(sd["probe"]) and self.comm.detect_averaged_grads and self.world_size > 1
        return carried
